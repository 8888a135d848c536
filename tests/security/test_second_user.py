"""A second local user against a Helix job (real processes, uid 65534): it reads the job's store
and finds no token and no key; it plants entries there and the ranks refuse them; it takes the
port of a Coordinator or DataServer that was SIGKILLed, and the channels connected before (lease
renewal, heartbeats, Execute / Configure / Cancel / LeaveRound) send it nothing. Also: a token
file others may read is refused, and ``repr`` shows no token and no private key."""

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest
from dataplane import CFG

import helix_core as hx
from helix_core.launch.embedded import Embedded, embedded_cluster
from helix_core.launch.rendezvous import JobRendezvous, derive, job_secret
from helix_core.loader.cluster_client import ClusterClient
from helix_core.security.hostid import host_id
from helix_core.security.listeners import ForeignListener, check_socket
from helix_core.security.tls import Tls
from helix_core.security.tokenfiles import load_token
from helix_core.testing.datasets import IndexDataset
from helix_core.wire.proto import helix_pb2 as pb

TOKEN = "second-user-tests-token"
SECRET = "a-job-secret-of-32-characters!!!"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="running a process as another user needs root (CI runs as root)"
)

# Another local user's view of the job's store: connect, read keys, plant entries.
_STORE_USER = """
import datetime, json, os, sys
import torch.distributed as dist
a = json.loads(sys.argv[1])
os.setgroups([]); os.setgid(65534); os.setuid(65534)
store = dist.TCPStore("127.0.0.1", a["port"], is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
out = {k: store.get(k).decode() if store.check([k]) else None for k in a.get("read", [])}
for k, v in a.get("plant", {}).items():
    store.set(k, v)
print(json.dumps({"uid": os.getuid(), "read": out}))
"""

# A squatter: a gRPC server of uid 65534 on a port this user's service left, recording every call.
_SQUATTER = """
import json, os, sys
import concurrent.futures.thread
from concurrent import futures
import grpc
port = int(sys.argv[1])
seen = []
class Every(grpc.GenericRpcHandler):
    def service(self, details):
        seen.append({"method": details.method, "metadata": [list(m) for m in details.invocation_metadata or ()]})
        return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[Every()], options=[("grpc.so_reuseport", 0)])
os.setgroups([]); os.setgid(65534); os.setuid(65534)  # (the interpreter's home may be private: imports first)
bound = server.add_insecure_port(f"127.0.0.1:{port}")  # its socket belongs to the uid that makes it
server.start()
print("listening" if bound == port else f"failed {bound}", flush=True)
sys.stdin.read()
server.stop(0)
print(json.dumps(seen), flush=True)
"""


def _stranger_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELIX_")}
    env["HOME"] = str(tmp_path / "stranger-home")
    return env


def _store_user(tmp_path, port: int, read=(), plant=None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _STORE_USER, json.dumps({"port": port, "read": list(read), "plant": plant or {}})],
        capture_output=True,
        text=True,
        env=_stranger_env(tmp_path),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["uid"] == 65534
    return out["read"]


@contextlib.contextmanager
def _squatter(tmp_path, port: int):
    """A uid-65534 gRPC server on ``port``; yields a list that holds, once it stopped, every call it got."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SQUATTER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_stranger_env(tmp_path),
    )
    calls: list = []
    try:
        assert proc.stdout.readline().strip() == "listening"
        yield calls
    finally:
        out, _ = proc.communicate("", timeout=30)
        calls.extend(json.loads(out.strip().splitlines()[-1]) if out.strip() else [])


@pytest.fixture
def job(monkeypatch):
    """A torchrun-like job environment around a real TCPStore (the job's store); yields a function
    that sets one rank's environment, and the store's port."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    for k in (
        "HELIX_JOB_SECRET",
        "HELIX_TOKEN",
        "HELIX_COORDINATOR",
        "HELIX_TLS_CA",
        "HELIX_TLS_CERT",
        "HELIX_TLS_KEY",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-x")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))

    def rank(rank: int, local_rank: int, world: int, local_world: int, node: int = 0) -> None:
        for k, v in dict(
            RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=local_world, GROUP_RANK=node
        ).items():
            monkeypatch.setenv(k, str(v))

    yield rank, store
    del store


def _leaks(text: str, token: str) -> bool:
    return token in text or "PRIVATE KEY" in text


@needs_root
def test_a_second_user_reads_the_job_store_and_finds_no_token_and_no_key(job, tmp_path, monkeypatch):
    rank, store = job
    rank(0, 0, 2, 2)  # one node, two ranks: local rank 0 starts the cluster
    one = embedded_cluster(2, 1, CFG)
    try:
        rank(1, 1, 2, 2)  # the other rank: the address from the store, the token from the private folder
        other = embedded_cluster(2, 1, CFG)
        assert other.cluster is None and (other.address, other.token) == (one.address, one.token)
        read = _store_user(tmp_path, store.port, ["helix/run-x/0/cluster"])["helix/run-x/0/cluster"]
        assert json.loads(read) == {"run_id": "run-x", "attempt": "0", "address": one.address}
        assert not _leaks(read, one.token)
    finally:
        one.cluster.close()
    # several nodes (two, one rank each) with the job's secret: the entries are sealed, no token or key
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-y")
    monkeypatch.setenv("HELIX_JOB_SECRET", SECRET)
    rank(0, 0, 2, 1)
    first = embedded_cluster(2, 1, CFG)
    try:
        assert first.tls is not None and first.cluster.tls is first.tls
        keys = ["helix/run-y/0/cluster", f"helix/run-y/0/node/{host_id()}"]
        read = _store_user(tmp_path, store.port, keys)
        for key in keys:
            entry = json.loads(read[key])
            assert set(entry) == {"run_id", "attempt", "sealed"} and not _leaks(read[key], first.token), entry
        # a rank of another node derives the same token and TLS, and opens the entry
        rank(1, 0, 2, 1, node=1)
        assert JobRendezvous(store, "run-y", "0", SECRET.encode()).wait("cluster", 5)["address"] == first.address
        derived = Tls.from_secret(derive(SECRET.encode(), "tls", "run-y/0"), "run-y/0")
        with hx.DistributedDataLoader(
            IndexDataset(4),
            batch_size=2,
            rank=1,
            world_size=2,
            coordinator=first.address,
            token=first.token,
            tls=derived,
            config=CFG,
        ) as loader:
            assert [b["index"].tolist() for b in loader] == [[1, 3]]
    finally:
        first.cluster.close()


@needs_root
def test_a_planted_store_entry_is_refused_with_a_clear_error(job, tmp_path, monkeypatch):
    rank, store = job
    SHORT = dataclasses.replace(CFG, startup_timeout_s=3.0)  # a planted entry is read again until then, then refused
    key = "helix/run-x/0/cluster"
    # one node: an address whose token is not in this user's private folder
    with socket.socket() as elsewhere:
        elsewhere.bind(("127.0.0.1", 0))
        planted = json.dumps({"run_id": "run-x", "attempt": "0", "address": f"127.0.0.1:{elsewhere.getsockname()[1]}"})
        _store_user(tmp_path, store.port, plant={key: planted})
        rank(1, 1, 2, 2)
        with pytest.raises(hx.ClusterError, match="holds no token for it.*planted"):
            embedded_cluster(2, 1, SHORT)
    # several nodes with the job's secret: unsealed, or sealed with another secret (another job's entry)
    monkeypatch.setenv("HELIX_JOB_SECRET", SECRET)
    rank(1, 0, 2, 1, node=1)
    other_job = _DictStore()
    JobRendezvous(other_job, "run-x", "0", b"someone-else's-secret-value").publish(
        "cluster", {"address": "127.0.0.1:1"}
    )
    for entry in (planted, other_job.data[key]):
        _store_user(tmp_path, store.port, plant={key: entry})
        with pytest.raises(hx.ClusterError, match="HELIX_JOB_SECRET does not open.*planted"):
            embedded_cluster(2, 1, SHORT)
    # several nodes and no secret: told what to set
    monkeypatch.delenv("HELIX_JOB_SECRET")
    with pytest.raises(hx.ClusterError, match="needs HELIX_JOB_SECRET.*head -c 32 /dev/urandom"):
        embedded_cluster(2, 1, SHORT)


class _DictStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def get(self, key):
        return self.data[key].encode()

    def wait(self, keys, timeout):
        if not all(k in self.data for k in keys):
            raise RuntimeError("timeout")


def test_a_sealed_entry_opens_only_under_its_own_name_run_and_attempt():
    secret = SECRET.encode()
    store = _DictStore()
    this = JobRendezvous(store, "run-7", "1", secret)
    this.publish("cluster", {"address": "10.0.0.3:1"})
    assert this.wait("cluster", 1)["address"] == "10.0.0.3:1"
    assert "10.0.0.3" not in store.data["helix/run-7/1/cluster"]
    store.data["helix/run-7/1/node/h"] = store.data["helix/run-7/1/cluster"]  # moved to another name
    with pytest.raises(hx.ClusterError, match="does not open"):
        this.wait("node/h", 1)
    earlier = JobRendezvous(store, "run-7", "0", secret)  # the attempt before: replayed under this attempt's key
    earlier.publish("cluster", {"address": "10.0.0.9:1"})
    forged = json.loads(store.data["helix/run-7/0/cluster"])
    forged["attempt"] = "1"
    store.data["helix/run-7/1/cluster"] = json.dumps(forged)
    with pytest.raises(hx.ClusterError, match="does not open"):
        this.wait("cluster", 1)


def test_a_short_job_secret_is_refused(monkeypatch):
    monkeypatch.setenv("HELIX_JOB_SECRET", "short")
    with pytest.raises(hx.ClusterError, match="HELIX_JOB_SECRET has 5 characters: give at least 16"):
        job_secret()


def _wait_for(what, condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


@needs_root
def test_a_coordinator_port_another_user_took_gets_no_lease_renewal_and_no_heartbeat(tmp_path, caplog, capfd):
    refused = "listened on by uid 65534"
    with hx.LocalCluster(local_servers=1, workers_per_server=1, token=TOKEN, config=CFG) as cluster:
        client = ClusterClient(cluster.address, TOKEN, CFG, rank=0, world_size=1)
        try:  # its channel, and the DataServer's heartbeat channel, are connected now
            port, err = int(cluster.address.rsplit(":", 1)[1]), []
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                check_socket(raw)  # this user's Coordinator
            cluster.kill_coordinator()
            with _squatter(tmp_path, port) as calls:
                # the client renews its lease every heartbeat interval; the DataServer heartbeats
                _wait_for("refused lease renewal", lambda: any(refused in r.getMessage() for r in caplog.records))
                _wait_for("refused heartbeat", lambda: err.append(capfd.readouterr().err) or refused in "".join(err))
                with pytest.raises(hx.ClusterError, match=refused):
                    client.telemetry()
                with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # a raw connection (bulk)
                    with pytest.raises(ForeignListener, match=refused):
                        check_socket(raw)
            assert calls == [], calls  # nothing reached it, so no token and no reply to load
        finally:
            client.close()


@needs_root
def test_a_dataserver_port_another_user_took_gets_no_execute_configure_cancel_or_leave(tmp_path):
    with hx.LocalCluster(local_servers=2, workers_per_server=1, token=TOKEN, config=CFG) as cluster:
        client = ClusterClient(cluster.address, TOKEN, CFG, rank=0, world_size=1)
        try:
            victim = cluster.servers[1].address
            stub = client.stub(victim)  # connected, protocol checked
            cluster.kill_server(1)
            with _squatter(tmp_path, int(victim.rsplit(":", 1)[1])) as calls:
                with pytest.raises(grpc.RpcError) as e:  # Configure first
                    client.execute(victim, ("spec", b"x", "json"), pb.ExecuteRequest())
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "uid 65534" in e.value.details()
                client._configured.add((victim, "spec"))
                with pytest.raises(grpc.RpcError, match="uid 65534"):
                    client.execute(victim, ("spec", b"x", "json"), pb.ExecuteRequest()).result(timeout=10)
                client.cancel(victim, [1, 2])
                with pytest.raises(grpc.RpcError, match="uid 65534"):
                    stub.LeaveRound(pb.LeaveRoundRequest(timeout_s=1), timeout=5, metadata=client.metadata)
                with pytest.raises(grpc.RpcError, match="uid 65534"):
                    client.stub(victim).Hello(pb.HelloRequest(), timeout=5, metadata=client.metadata)
            assert calls == [], calls
        finally:
            client.close()


def test_a_token_file_others_may_read_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("tok\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=rf"token file {path} is open to other users .*chmod 600 {path}"):
        load_token(token_file=str(path))
    path.chmod(0o600)
    assert load_token(token_file=str(path)) == "tok"
    path.chmod(0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        load_token(token_file=str(path))


def test_repr_shows_no_token_and_no_private_key():
    tls = Tls.for_job()
    assert b"PRIVATE KEY" in tls.key and "PRIVATE" not in repr(tls) and "<redacted>" in repr(tls)
    embedded = Embedded(None, "127.0.0.1:1", TOKEN, tls)
    assert TOKEN not in repr(embedded) and "PRIVATE" not in repr(embedded) and "<redacted>" in repr(embedded)
    cluster = hx.LocalCluster(token=TOKEN, config=CFG, start=False)
    assert TOKEN not in repr(cluster)


# A squatter that accepts one connection and closes its listener, keeping the connection: a later
# listener of this user on the port does not make that connection safe.
_ACCEPT_AND_HIDE = """
import os, socket, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC servers do
s.bind(("127.0.0.1", 0))
s.listen()
print(s.getsockname()[1], flush=True)
conn, _ = s.accept()
s.close()
print("hidden", flush=True)
sys.stdin.read()
"""


@needs_root
@pytest.mark.parametrize("netlink", [True, False], ids=["sock_diag", "proc"])
def test_a_new_listener_is_checked_with_every_connection_its_port_still_holds(tmp_path, monkeypatch, netlink):
    from helix_core.security import listeners

    monkeypatch.setattr(listeners, "_NETLINK", [netlink])
    proc = subprocess.Popen(
        [sys.executable, "-c", _ACCEPT_AND_HIDE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_stranger_env(tmp_path),
    )
    try:
        port = int(proc.stdout.readline())
        address = f"127.0.0.1:{port}"
        guard = listeners.TokenGuard(address)
        with pytest.raises(ForeignListener, match="listened on by uid 65534"):
            guard.check()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as held:  # gRPC's connection, say
            assert proc.stdout.readline().strip() == "hidden"
            with pytest.raises(ForeignListener, match="no listener"):
                guard.check()
            with pytest.raises(ForeignListener, match="uid 65534"):
                check_socket(held)
            with socket.socket() as ours:  # this user's server back on its port
                ours.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                ours.bind(("127.0.0.1", port))
                ours.listen()
                with pytest.raises(ForeignListener, match="listened on by uid 65534"):
                    guard.check()  # its listener is ours, but the port still holds the squatter's connection
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
    with socket.socket() as ours:
        ours.bind(("127.0.0.1", 0))
        ours.listen()
        guard = listeners.TokenGuard(f"127.0.0.1:{ours.getsockname()[1]}")
        guard.check()
        guard.check()  # (the same listener: one lookup)


def test_a_listener_check_that_fails_refuses_the_call_and_never_raises_into_the_caller(monkeypatch):
    """A lookup the kernel could not answer (a busy netlink socket, EINTR) fails closed, as a gRPC
    UNAVAILABLE the callers already retry, never as an OSError out of a stub call."""
    import errno

    from helix_core.security import listeners

    def busy(*_a, **_k):
        raise OSError(errno.ENOBUFS, "No buffer space available")

    for name in ("_lookup", "_dump_owners", "_proc_sockets", "port_owners"):
        if hasattr(listeners, name):
            monkeypatch.setattr(listeners, name, busy)
    refused = listeners.TokenGuard("127.0.0.1:1").refusal((("helix-token", "t"),))
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot be checked" in refused.details() or "No buffer space" in refused.details()


def test_ipv4_mapped_loopback_is_loopback():
    from helix_core.security.auth import is_loopback

    assert is_loopback("::ffff:127.0.0.1") and is_loopback("[::ffff:127.0.0.2]") and is_loopback("127.1.2.3")
    assert not is_loopback("::ffff:192.0.2.1") and not is_loopback("192.0.2.1")


def test_an_entry_planted_before_the_jobs_own_is_read_again_until_the_real_one_lands():
    import threading

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    job = JobRendezvous(store, "run", "0")
    store.set(job.prefix + "coordinator", json.dumps({"run_id": "other", "attempt": "0", "address": "x:1"}))
    threading.Timer(1.0, job.publish, args=("coordinator", {"address": "127.0.0.1:7"})).start()
    assert job.wait("coordinator", 20)["address"] == "127.0.0.1:7"
    store.set(job.prefix + "coordinator", b"not json")
    with pytest.raises(hx.ClusterError, match="malformed"):
        job.wait("coordinator", 1.0)
