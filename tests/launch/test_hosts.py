"""Helix across hosts, on emulated hosts: each a network + mount + UTS namespace with its own
address, /dev/shm and hostname (helix_core.testing.emulated_hosts). Services start through the CLI as a
user starts them on each machine; ranks are processes on their own host."""

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from hostcluster import EVERY, TOKEN, Cluster, busy_slabs, listeners, rank_results, sampler, wait_first_batches

from helix_core.testing.emulated_hosts import EmulatedHosts, leftovers

pytestmark = pytest.mark.skipif(EmulatedHosts.unavailable() is not None, reason=str(EmulatedHosts.unavailable()))

APPS = Path(__file__).resolve().parents[1] / "apps"


@pytest.fixture(scope="module")
def hosts():
    with EmulatedHosts(["a", "b", "c"]) as h:
        yield h


def test_two_hosts_and_a_sidecar_through_the_cli(hosts, tmp_path):
    cluster = Cluster(hosts, tmp_path)
    try:
        placement = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]  # both hosts' local servers have local rank 0
        # 20 ms a sample keeps a local server busy while its ranks ask ahead, so least-request (which
        # keeps ties local) spills to the sidecar from both hosts; instant samples left it to chance
        results = rank_results(cluster.ranks(placement, ["least-request", "deadline"], delay_s=0.02))
        status = cluster.status()
    finally:
        cluster.close()
    host_of = {r: res["host"] for r, res in enumerate(results)}
    assert host_of[0] == host_of[1] != host_of[2] == host_of[3]  # two hosts, by identity
    for rank, res in enumerate(results):
        for scheduler, run in res["runs"].items():
            assert "error" not in run, run.get("trace")
            assert run["equal"], (rank, scheduler)  # the sampler's batches, tensors included
            assert run["indices"] == sampler(48, rank, 4, 2)
    # the sidecar served ranks of both hosts (a sidecar always streams: cross-DS bytes)
    for pair in ((0, 1), (2, 3)):
        assert sum(results[r]["runs"]["least-request"]["cross_ds_bytes"] for r in pair) > 0, pair
    # the Coordinator lists every host's servers; each rank delivered through its own host's only
    servers = {s["server_id"]: s for s in status["servers"]}
    assert set(status["hosts"]) == {host_of[0], host_of[2]}
    assert [s["kind"] for s in status["servers"]].count("remote") == 1
    sidecar = next(s for s in status["servers"] if s["kind"] == "remote")  # over TLS, by the bulk path
    assert sidecar["bulk_bytes"] == sidecar["cross_ds_bytes"] > 0, json.dumps(status["servers"])
    assert all(len(ids) == 1 and servers[ids[0]]["local_rank"] == 0 for ids in status["hosts"].values())
    # each client registered with its own host (asked while it ran: a client that left has no lease)
    assert all(run["registered_host"] == host_of[r] for r, res in enumerate(results) for run in res["runs"].values())


def test_a_hosts_last_local_server_killed_its_ranks_get_an_error_naming_it_other_hosts_go_on(hosts, tmp_path):
    cluster = Cluster(hosts, tmp_path)
    try:
        # samples decode slowly (12 per rank, 0.25 s each): b loses its server once each rank has its first batch
        started = cluster.ranks([("a", 0), ("b", 0)], ["least-request"], n=24, delay_s=0.25, mark_first=True)
        wait_first_batches(started)
        cluster.procs["local-b"].send_signal(signal.SIGKILL)
        results = rank_results(started)
        status = cluster.status("a")
    finally:
        cluster.close()
    a, b = results[0]["runs"]["least-request"], results[1]["runs"]["least-request"]
    assert "error" not in a, a.get("trace")
    assert a["equal"] and a["indices"] == sampler(24, 0, 2, 2)
    assert "ClusterError" in b.get("error", "") and repr(results[1]["host"]) in b["error"], b
    local_b = [s for s in status["servers"] if s["host"] == results[1]["host"]]
    assert local_b and not any(s["alive"] for s in local_b)


@pytest.mark.parametrize("exchange", ["collective", "grpc"])
def test_tier2_moves_rows_between_hosts_bit_identical_and_leaves_no_slab(hosts, tmp_path, exchange):
    """Ranks 0, 1 on host a and 2, 3 on host b; the policy sends every sample to rank + 2: each
    step's rows all cross hosts — through one gloo all_to_all of the hosts' DataServers, or by
    one gRPC stream per slab — into slabs on the taker's host. gloo has no TLS: the collective runs
    on an --insecure cluster only (on a TLS one it is refused: test_tier2_security.py)."""
    before = {name: set(busy_slabs(hosts, name)) for name in hosts.names}  # a SIGKILLed server's, from an earlier test
    cluster = Cluster(hosts, tmp_path, tls=exchange != "collective")
    rebalance = {"args": {"shift": 2, "world": 4}, "round_timeout_s": 5.0, "exchange": exchange}
    try:
        for role in ("local-a", "local-b", "sidecar"):  # reachable from other hosts: torch loaded before it serves
            assert "libtorch" in Path(f"/proc/{cluster.info[role]['pid']}/maps").read_text(), role  # (no PID namespace)
        placement = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
        started = cluster.ranks(placement, ["least-request"], n=32, rebalance=rebalance)
        listening = set()
        while any(proc.poll() is None for proc, _ in started):  # the collective's store among them
            listening.update((name, *x) for name in ("a", "b") for x in listeners(hosts, name))
            time.sleep(0.2)
        results = rank_results(started)
    finally:
        cluster.close()
    assert not [x for x in listening if x[1] in EVERY], sorted(listening)  # each on its host's address
    for rank, res in enumerate(results):
        run = res["runs"]["least-request"]
        assert "error" not in run, run.get("trace")
        assert not run["rebalance_errors"], run["rebalance_errors"]
        assert run["indices"] == sampler(32, (rank - 2) % 4, 4, 2)  # the batches of the rank 2 away ...
        assert run["equal"], rank  # ... tensors and all, bit-identical
        t2 = run["rebalance"]
        assert t2["moved"] == 4 and t2["moved_in"] == t2["moved_out"] == 8, t2
        assert t2[f"crossed_{exchange}"] == 4 and t2["crossed_bytes"] > 0, t2
    for name in hosts.names:  # every slab released on every host (its rows read or dropped)
        assert not set(busy_slabs(hosts, name)) - before[name], name


def test_a_hosts_member_killed_mid_epoch_its_rounds_keep_and_every_sample_comes_once(hosts, tmp_path):
    """Host b has two local servers; rank 2 delivers through local-b (local rank 0), which is also
    host b's member of the cross-host exchange. SIGKILLed mid-epoch: rank 2 goes on through its
    host's other server, a round in flight falls back (kept), later rounds cross again."""
    cluster = Cluster(hosts, tmp_path, more_locals=(("b", 1),))
    rebalance = {"args": {"shift": 2, "world": 4}, "round_timeout_s": 5.0}
    try:
        placement = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
        started = cluster.ranks(placement, ["least-request"], n=64, delay_s=0.1, mark_first=True, rebalance=rebalance)
        wait_first_batches(started)
        cluster.procs["local-b"].send_signal(signal.SIGKILL)
        results = rank_results(started)
    finally:
        cluster.close()
    runs = [res["runs"]["least-request"] for res in results]
    for run in runs:
        assert "error" not in run, run.get("trace")
    own = [sampler(64, r, 4, 2) for r in range(4)]
    seen = Counter()
    for step in range(len(own[0])):
        planned = sorted(i for r in range(4) for i in own[r][step])
        got = [runs[r]["indices"][step] for r in range(4)]
        assert sorted(i for b in got for i in b) == planned, step  # every step: its samples, once
        for r in range(4):  # a batch shifted by its round, or kept by one that failed
            assert got[r] in (own[(r - 2) % 4][step], own[r][step]), (step, r)
        seen.update(i for b in got for i in b)
    assert seen == Counter(range(64))
    assert sum(run["rebalance"].get("moved", 0) for run in runs) > 0  # rounds crossed hosts


_PICKLED = """
import json, sys
import grpc, torch
import helix_core as hx
from helix_core.config import ClusterConfig
from helix_core.wire.proto import helix_pb2 as pb, helix_pb2_grpc as pbg

class Squares(torch.utils.data.Dataset):  # no helix_spec(): only cloudpickle could carry it
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.tensor([i * i])

a = json.loads(sys.argv[1])
out = {}
try:
    hx.DistributedDataLoader(Squares(), batch_size=2, rank=0, world_size=1, coordinator=a["coordinator"],
                             token=a["token"], config=ClusterConfig.for_tests())
    out["loader"] = "accepted"
except ValueError as e:
    out["loader"] = str(e)
stub = pbg.DataServerStub(grpc.insecure_channel(a["server"]))  # the raw RPC, with the token
try:
    stub.Configure(pb.ConfigureRequest(spec_id="x", payload=b"\\x80\\x04N.", format="cloudpickle"),
                   metadata=(("helix-token", a["token"]),), timeout=10)
    out["configure"] = "accepted"
except grpc.RpcError as e:
    out["configure"] = f"{e.code().name}: {e.details()}"
print(json.dumps(out))
"""


def test_insecure_services_take_no_pickled_data(hosts, tmp_path):
    cluster = Cluster(hosts, tmp_path, tls=False)  # --insecure: the token crosses the bridge in clear text
    try:
        args = {"coordinator": cluster.coordinator, "token": TOKEN, "server": cluster.info["local-a"]["address"]}
        done = hosts.run("b", [sys.executable, "-c", _PICKLED, json.dumps(args)], env=cluster.env)
    finally:
        cluster.close()
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "dataset Squares (it has no helix_spec())" in got["loader"] and "TLS" in got["loader"], got
    assert got["configure"].startswith("PERMISSION_DENIED") and "--insecure" in got["configure"], got


def test_emulated_hosts_are_isolated_and_leave_nothing_behind_even_after_a_failure():
    with pytest.raises(RuntimeError, match="a test failed"):
        with EmulatedHosts(["x", "y"], cpus={"y": 0.5}, link_mbps={"y": 20}) as h:
            tag = h.tag
            assert h.run("x", ["hostname"]).stdout.strip() == "x"
            assert h.run("x", ["sh", "-c", "touch /dev/shm/helix-probe && ls /dev/shm"]).stdout.split() == [
                "helix-probe"
            ]
            assert "helix-probe" not in h.run("y", ["ls", "/dev/shm"]).stdout  # each host its own /dev/shm
            assert not os.path.exists("/dev/shm/helix-probe")
            reach = h.run(
                "x", [sys.executable, "-c", f"import socket; socket.create_connection(('{h.address('y')}', 9), 2)"]
            )
            assert "ConnectionRefused" in reach.stderr  # y's address answers on the bridge (nothing listens on 9)
            # each host's CPU is counted; y's is held to its quota: 1.5 busy seconds get ~0.75 CPU-s there
            busy = [sys.executable, "-c", "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.5: pass"]
            before = {n: h.cpu_seconds(n) for n in "xy"}
            for n in "xy":
                h.run(n, busy)
            after = {n: h.cpu_seconds(n) for n in "xy"}
            used = {n: after[n]["used_s"] - before[n]["used_s"] for n in "xy"}
            assert 0.3 < used["y"] < 1.1 and after["y"]["throttled_periods"] > before["y"]["throttled_periods"], used
            assert used["x"] > used["y"] and after["x"]["throttled_periods"] == 0, used  # no quota: never held back
            h.popen("y", ["sleep", "600"])  # still running when the test fails
            assert leftovers(tag)
            raise RuntimeError("a test failed")
    assert leftovers(tag) == []
