"""Tier 2's security guarantees, on real processes: on a TLS cluster no row and no rendezvous leaves
TLS (a capture on the emulated hosts' bridge sees only TLS records — and the bulk path's records
sealed with keys that crossed inside TLS — and never a row's bytes in clear) and no
Tier-2 listener binds beyond its service's address; the gloo collective is refused there; a
server that reads a rank's slab takes no lease, so a rank killed after its round leaks no slab;
and what a client sends a round's leader cannot hold a call for ever, starve its other RPCs, or
swap the policy another client's round runs."""

import dataclasses
import json
import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from dataplane import CFG

import helix_core as hx
import helix_core.testing.datasets
from helix_core.config import ClusterConfig
from helix_core.testing.datasets import IndexDataset
from helix_core.testing.emulated_hosts import EmulatedHosts
from helix_core.wire.proto import helix_pb2 as pb

APPS = Path(__file__).resolve().parents[1] / "apps"
needs_hosts = pytest.mark.skipif(EmulatedHosts.unavailable() is not None, reason=str(EmulatedHosts.unavailable()))
SHAPE = (512,)  # a sample's row: 512 seeded random bytes, recognisable anywhere in a capture


@pytest.fixture(scope="module")
def hosts():
    if EmulatedHosts.unavailable() is not None:
        pytest.skip(str(EmulatedHosts.unavailable()))
    with EmulatedHosts(["a", "b", "c"]) as h:
        yield h


# ---- what crosses the bridge ------------------------------------------------------------------


def _captured(path: Path) -> dict[tuple, dict[int, bytes]]:
    """The sniffer's segments: ``{(src, sport, dst, dport): {seq: payload}}`` (a segment seen on two
    ports of the bridge counts once)."""
    flows: dict[tuple, dict[int, bytes]] = {}
    data, at = path.read_bytes(), 0
    while at + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, at)
        head = json.loads(data[at + 4 : at + 4 + n])
        at += 4 + n
        (m,) = struct.unpack_from("<I", data, at)
        flows.setdefault((head["src"], head["sport"], head["dst"], head["dport"]), {})[head["seq"]] = data[
            at + 4 : at + 4 + m
        ]
        at += 4 + m
    return flows


def _stream(segments: dict[int, bytes]) -> bytes:
    """A flow's bytes in order (sequence numbers relative to its first segment, modulo 2**32)."""
    base = min(segments)
    if max(segments) - base > 1 << 31:  # it wrapped: count from the first one past the wrap
        base = min(s for s in segments if s > 1 << 31)
    out, end = bytearray(), None
    for seq, payload in sorted(segments.items(), key=lambda kv: (kv[0] - base) % (1 << 32)):
        off = (seq - base) % (1 << 32)
        if end is not None and off < end:  # a retransmission overlapping what we have
            payload, off = payload[end - off :], end
        assert end is None or off == end, f"a gap in the capture at byte {end}"
        out += payload
        end = off + len(payload)
    return bytes(out)


def _tls_records(stream: bytes) -> int:
    """How many records ``stream`` is, whole (a last one cut by the capture's end is allowed);
    AssertionError at anything else. TLS records: content type 20-23, version 0x0303 (0x0301 only
    in a hello's handshake record, as TLS allows). After a TLS session that closed (its last
    record a 19-byte TLS 1.3 alert: close_notify), the bulk path's ``Sealed`` records, with keys
    that crossed inside that session: ``u32`` plaintext length (1 B to 1 MiB), ciphertext, 16-byte tag."""
    at, count, last = 0, 0, None
    while at + 5 <= len(stream):
        kind, version, n = struct.unpack_from("!BHH", stream, at)
        if kind == 23 and version == 0x0303 or kind in (20, 21, 22) and version in (0x0303, 0x0301):
            at, count, last = at + 5 + n, count + 1, n
            continue
        assert last == 19, f"not a TLS record at byte {at}: {stream[at : at + 16]!r}"
        while at + 4 <= len(stream):  # the rest: sealed records only
            (n,) = struct.unpack_from("<I", stream, at)
            assert 0 < n <= 1 << 20, f"neither TLS nor a sealed record at byte {at}: {stream[at : at + 16]!r}"
            at, count = at + 4 + n + 16, count + 1
    return count


@needs_hosts
def test_a_tls_round_between_two_hosts_crosses_the_bridge_only_as_tls(hosts, tmp_path):
    """Ranks 0, 1 on host a and 2, 3 on host b; every sample moves to the rank two away, so each
    step's rows all cross hosts — by default (no ``exchange``) over gRPC and TLS. A raw-socket
    capture on the bridge reads every TCP payload between the hosts as TLS records, and no row's
    bytes in clear; no socket of either host listens on every interface."""
    from hostcluster import EVERY, Cluster, listeners, rank_results, sampler

    capture = tmp_path / "bridge.cap"
    sniffer = subprocess.Popen(
        ["ip", "netns", "exec", hosts.ns("br"), sys.executable, str(APPS / "bridge_sniffer.py"), str(capture)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert sniffer.stdout.readline().strip() == "ready"
        cluster = Cluster(hosts, tmp_path)
        rebalance = {"args": {"shift": 2, "world": 4}, "round_timeout_s": 5.0}
        try:
            started = cluster.ranks(
                [("a", 0), ("a", 1), ("b", 0), ("b", 1)],
                ["least-request"],
                n=32,
                rebalance=rebalance,
                shape=list(SHAPE),
            )
            listening = set()
            while any(proc.poll() is None for proc, _ in started):  # sampled while rounds run
                for name in ("a", "b", "c"):
                    listening.update((name, *x) for x in listeners(hosts, name))
                time.sleep(0.2)
            results = rank_results(started)
        finally:
            cluster.close()
    finally:
        sniffer.send_signal(signal.SIGTERM)
        sniffer.wait(timeout=30)
        sniffer.stdout.close()
    for rank, res in enumerate(results):
        run = res["runs"]["least-request"]
        assert "error" not in run, run.get("trace")
        assert run["equal"] and run["indices"] == sampler(32, (rank - 2) % 4, 4, 2)
        assert run["rebalance"].get("crossed_grpc") == 4 and not run["rebalance"].get("crossed_collective"), run[
            "rebalance"
        ]  # rows crossed, by gRPC: the default on a TLS cluster
    assert listening and not [x for x in listening if x[1] in EVERY], sorted(listening)
    rows = [IndexDataset(32, shape=SHAPE)[i]["x"].numpy().tobytes() for i in range(32)]  # as decoded
    flows = _captured(capture)
    between = {k: v for k, v in flows.items() if k[0].startswith(hosts.subnet) and k[2].startswith(hosts.subnet)}
    assert between, "the capture saw nothing between the hosts"
    records = tls_bytes = 0
    for key, segments in between.items():
        stream = _stream(segments)
        records += _tls_records(stream)
        tls_bytes += len(stream)
        for i, row in enumerate(rows):
            for part in (row[:64], row[200:264], row[-64:]):
                assert part not in stream, f"sample {i}'s row in clear text in {key}"
    assert records > 0 and tls_bytes > sum(map(len, rows)), (records, tls_bytes)  # the rows went by, sealed


def test_the_collective_is_refused_on_a_tls_cluster_naming_the_parameter():
    from helix_core.security.tls import Tls

    with hx.LocalCluster(local_servers=1, workers_per_server=1, token=True, tls=Tls.for_job(), config=CFG) as c:
        kw = dict(batch_size=2, rank=0, world_size=2, coordinator=c.address, token=c.token, tls=c.tls, config=CFG)
        with pytest.raises(ValueError, match=r"Rebalance\.exchange='collective' on a TLS cluster"):
            hx.DistributedDataLoader(IndexDataset(8), rebalance={"exchange": "collective"}, **kw)
        hx.DistributedDataLoader(IndexDataset(8), rebalance={"exchange": "grpc"}, **kw).close()
    assert hx.Rebalance().transport(tls=True) == "grpc" and hx.Rebalance().transport(tls=False) == "grpc"
    assert hx.Rebalance(exchange="collective").transport(tls=False) == "collective"  # only where asked for
    assert hx.Rebalance(exchange="grpc").transport(tls=False) == "grpc"


def test_a_tls_server_never_joins_nor_hosts_a_collective_whatever_a_rank_asks():
    from helix_core.errors import ClusterError
    from helix_core.tier2.crosshost import CrossHostMover, HostMember

    member = HostMember(None, None, None, False, "127.0.0.1", secure=True)
    with pytest.raises(ClusterError, match="joins no gloo collective"):
        member.serve(pb.ExchangeRequest(round="r", members=["x", "y"], transport="collective", store="127.0.0.1:1"))
    tls, plain = CrossHostMover(member, "t", CFG, tls=object()), CrossHostMover(member, "t", CFG, tls=None)
    try:
        assert [tls.transport(t) for t in ("", "grpc", "collective")] == ["grpc"] * 3
        assert [plain.transport(t) for t in ("", "grpc", "collective")] == ["grpc", "grpc", "collective"]  # asked for
    finally:
        tls.close()
        plain.close()


def test_a_collectives_rendezvous_listens_on_its_address_only():
    from helix_core.tier2.collective import open_store

    store = open_store("127.0.0.1", 2, timeout_s=5)
    done = subprocess.run(["cat", "/proc/net/tcp", "/proc/net/tcp6"], capture_output=True, text=True, timeout=10)
    mine = [
        line.split()[1]
        for line in done.stdout.splitlines()
        if len(line.split()) > 3 and line.split()[3] == "0A" and line.split()[1].endswith(f":{store.port:04X}")
    ]
    assert mine == [f"0100007F:{store.port:04X}"], mine  # 127.0.0.1 (little-endian hex), not 0.0.0.0 or ::
    del store


# ---- slab leases ------------------------------------------------------------------------------

_HEADERS = r"""
import json, os, stat, struct
out = []
for n in sorted(os.listdir("/dev/shm")):
    if n.startswith("helix-") and stat.S_ISREG(os.lstat("/dev/shm/" + n).st_mode):  # (cpu slots have a FIFO)
        with open("/dev/shm/" + n, "rb") as f:
            h = f.read(64)
        if h[:8] == b"HELIXSLB":
            out.append([n, struct.unpack_from("<Q", h, 16)[0], struct.unpack_from("<Q", h, 32)[0]])
print(json.dumps(out))
"""


def _slabs(hosts, name: str) -> list[tuple[str, int, int]]:
    """``(segment, state, lease holder pid)`` of every Helix slab on host ``name`` (state 0: FREE)."""
    done = hosts.run(name, [sys.executable, "-c", _HEADERS])
    assert done.returncode == 0, done.stderr
    return [tuple(x) for x in json.loads(done.stdout)]


@needs_hosts
def test_a_rank_killed_after_its_rounds_exchange_leaves_no_slab_held(hosts, tmp_path):
    """Rank 0 (host a) and rank 1 (host b) swap their batches; rank 0 is SIGKILLed as its first
    moved round answers it — its own slab read by host a's member for the exchange, the rows it
    takes written into new slabs. No slab names the member as holder (a server's read takes no
    lease), and once the lease timeout has passed every slab of host a is free again."""
    from hostcluster import Cluster

    config = ClusterConfig.for_tests(execute_timeout_s=6.0, sample_timeout_s=5.0)  # slab lease: 6 + 3 s
    cluster = Cluster(hosts, tmp_path, config=json.dumps(config.to_dict()))
    rebalance = {"args": {"shift": 1, "world": 2}, "round_timeout_s": 1.0}
    try:
        (r0, _), (r1, _) = cluster.ranks(
            [("a", 0), ("b", 0)], ["least-request"], n=16, rebalance=rebalance, die_rank=0, shape=list(SHAPE)
        )
        assert r0.wait(timeout=120) == -signal.SIGKILL
        killed = time.monotonic()
        server = cluster.info["local-a"]["pid"]
        held = _slabs(hosts, "a")
        assert not [s for s in held if s[1] and s[2] == server], held  # the member read rank 0's slab: no lease
        assert any(s[1] for s in held), held  # rank 0 died holding slabs of host a
        deadline = killed + config.execute_timeout_s + config.rpc_timeout_s + 30
        while any(s[1] for s in _slabs(hosts, "a")):
            assert time.monotonic() < deadline, f"host a's slabs still held: {_slabs(hosts, 'a')}"
            time.sleep(0.5)
        assert r1.wait(timeout=120) == 0
    finally:
        cluster.close()


def test_a_shared_slab_is_freed_once_its_live_readers_released_it_or_died(tmp_path):
    """A slab two ranks read (``share``) names no one reader: one that reads and dies holds it no
    longer than its share's lease; a reader that releases counts down, a server's read takes no lease."""
    from helix_core.memory.reader import SlabReader
    from helix_core.memory.slabpool import SlabPool

    pool = SlabPool(f"helix-t{os.getpid()}-", orphan_s=1.0)
    reader = SlabReader()
    try:
        slab = pool.acquire(64)
        handle = slab.handle(64)
        reader.view(handle, lease=False)[:4]  # a server's read: no holder
        assert struct.unpack_from("<Q", slab._mm, 32)[0] == 0
        assert reader.share(handle, 2)
        code = (
            "import json, os, signal, sys\nfrom helix_core.memory.reader import SlabReader\n"
            "from helix_core.memory.shm import SlabHandle\n"
            "r = SlabReader(); h = SlabHandle(**json.loads(sys.argv[1])); bytes(r.view(h)[:8])\n"
            "os.kill(os.getpid(), signal.SIGKILL) if sys.argv[2] == 'die' else print(r.release(h))"
        )
        arg = json.dumps(dataclasses.asdict(handle))  # the handle's JSON form: its fields by name
        dead = subprocess.run([sys.executable, "-c", code, arg, "die"], timeout=60)
        assert dead.returncode == -signal.SIGKILL
        assert struct.unpack_from("<Q", slab._mm, 32)[0] == 0  # the reader wrote no lease: none stands for both
        released = subprocess.run(
            [sys.executable, "-c", code, arg, "release"], timeout=60, capture_output=True, text=True
        )
        assert released.stdout.strip() == "False" and not slab.free  # one of two: it counts down
        deadline = time.monotonic() + 30
        while not pool.reclaim():  # the dead reader never releases: back after the share's lease
            assert time.monotonic() < deadline, "a shared slab whose reader died was never taken back"
            time.sleep(0.2)
        assert slab.free
    finally:
        reader.close()
        pool.close()


# ---- what a client may send a leader ----------------------------------------------------------


def test_a_nan_or_negative_round_timeout_is_an_invalid_argument_not_a_call_held_for_ever():
    from helix_core.security.auth import call_metadata
    from helix_core.tier2.leader import RoundTable
    from helix_core.wire.proto import helix_pb2_grpc as pbg
    from helix_core.wire.rpc import connect

    table = RoundTable(True)
    bad = pb.RebalanceRequest(
        group="s:0,1",
        rank=0,
        step=1,
        timeout_s=math.nan,
        features_json="[{}]",
        batch_rows=[1],
        batches=[pb.BatchHandle()],
    )
    assert table.rebalance(bad).outcome.startswith("error: bad Rebalance request")  # at once, never held
    with hx.LocalCluster(local_servers=1, workers_per_server=1, token=True, config=CFG) as c:
        with connect(c.servers[0].address, CFG, None) as ch:
            stub = pbg.DataServerStub(ch)
            for value in (math.nan, -1.0, math.inf):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Rebalance(
                        pb.RebalanceRequest(group="s:0,1", rank=0, step=1, timeout_s=value),
                        timeout=10,
                        metadata=call_metadata(c.token),
                    )
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                stub.LeaveRound(
                    pb.LeaveRoundRequest(group="s:0,1", rank=0, step=1, timeout_s=math.nan),
                    timeout=10,
                    metadata=call_metadata(c.token),
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_held_calls_are_bounded_so_a_leaders_other_rpcs_always_find_a_thread():
    from helix_core.tier2.leader import RoundTable

    table = RoundTable(True, max_held=1)

    def call(rank: int, step: int):
        return table.rebalance(
            pb.RebalanceRequest(
                group="s:0,1",
                rank=rank,
                step=step,
                timeout_s=30.0,
                buffer_size=8,
                features_json="[{}]",
                batch_rows=[1],
                batches=[pb.BatchHandle()],
                policy=b'{"sort_fn": null, "args": null}',
                policy_format="json",
            )
        )

    held = threading.Thread(target=call, args=(0, 1), daemon=True)
    held.start()
    deadline = time.monotonic() + 10
    while table._held < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    assert call(0, 2).outcome == "busy" and time.monotonic() - t0 < 5  # answered at once: it keeps its batch
    assert held.is_alive()
    table.close()


def test_a_leader_runs_the_policy_a_request_carries_whatever_id_it_names():
    from helix_core.testing.datasets import shift_ranks
    from helix_core.tier2.leader import RoundTable

    table = RoundTable(True)
    mine = pb.RebalanceRequest(
        policy_id="p",
        policy=json.dumps(
            {"sort_fn": "helix_core.testing.datasets:shift_ranks", "args": {"shift": 1, "world": 2}}
        ).encode(),
        policy_format="json",
    )
    theirs = pb.RebalanceRequest(policy_id="p", policy=b'{"sort_fn": null, "args": null}', policy_format="json")
    assert table.policies.get(mine.policy, mine.policy_format)[0] is shift_ranks
    # the same id, other bytes: its own policy, not the cached one
    assert table.policies.get(theirs.policy, theirs.policy_format)[0] is None
    assert table.policies.get(mine.policy, mine.policy_format)[0] is shift_ranks


def test_a_round_older_than_refusals_are_kept_can_never_commit():
    from helix_core.tier2.fates import SLACK_S, RoundFates

    now = [0.0]
    fates = RoundFates(clock=lambda: now[0], kept_s=600.0)
    assert fates.fate(("g", "", 1), 0, age_s=1.0) is None  # rank 0 asked: refused, it keeps
    now[0] = 700.0  # a slow leader's round, open 700 s: the refusal could be forgotten by now
    assert not fates.commit(("g", "", 1), {0: [1], 1: [2]}, age_s=700.0)
    assert not fates.commit(("g", "", 2), {0: [1], 1: [2]}, age_s=600.0 - SLACK_S)
    assert not fates.commit(("g", "", 3), {0: [1]}, age_s=math.nan)
    assert fates.commit(("g", "", 4), {0: [1], 1: [2]}, age_s=30.0)
    assert fates.fate(("g", "", 1), 0, age_s=700.0) is None
