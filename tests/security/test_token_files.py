"""No unauthenticated cluster: a Coordinator started with no token makes one and leaves it, 0600,
in the user's private Helix folder; the same user's DataServers, loaders and ``helix`` commands
find it by the address; a process under another uid is refused on every RPC of every service."""

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys

import pytest
from dataplane import CFG, assert_same_batches, torch_batches

import helix_core as hx
from helix_core.security import tokenfiles
from helix_core.security.hostid import host_id
from helix_core.testing.datasets import IndexDataset


def test_token_files_are_private_and_found_by_any_loopback_name(tmp_path, monkeypatch):
    monkeypatch.delenv("HELIX_RUNTIME_DIR")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tokenfiles, "RUN_USER", str(tmp_path / "no-run-user"))
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tokenfiles.write_token("127.0.0.1:7070", "t0k")
    assert path.parent == tmp_path / ".local" / "share" / "helix" / "runtime"
    assert host_id().split("-")[0] in path.name  # an NFS home shared by nodes: one file per host
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert tokenfiles.find_token("localhost:7070") == tokenfiles.find_token("[::1]:7070") == "t0k"
    assert tokenfiles.find_token("127.0.0.1:7071") is None and tokenfiles.find_token(None) is None
    tokenfiles.remove_token("127.0.0.1:7070", "another Coordinator's")  # not ours: kept
    assert path.exists()
    path.chmod(0o644)
    with pytest.raises(ValueError, match=rf"token file {path} is readable by other users"):
        tokenfiles.find_token("127.0.0.1:7070")
    path.parent.chmod(0o755)
    with pytest.raises(ValueError, match=r"token folder .* is readable by other users .*chmod 700"):
        tokenfiles.write_token("127.0.0.1:7070", "t1")
    path.parent.chmod(0o700)
    tokenfiles.remove_token("127.0.0.1:7070", "t0k")
    assert not path.exists()
    (tmp_path / "elsewhere").write_text("planted\n")
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="is a symbolic link"):
        tokenfiles.find_token("127.0.0.1:7070")
    path.unlink()
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    tokenfiles.write_token("127.0.0.1:7071", "in-home")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))  # another shell of the same user: found in either folder
    assert tokenfiles.find_token("127.0.0.1:7071") == "in-home"
    with pytest.raises(ValueError, match="not host:port"):
        tokenfiles.token_path("7070")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("HELIX_TOKEN", "HELIX_COORDINATOR")}


def _start(args):
    proc = subprocess.Popen(
        [sys.executable, "-m", "helix_core.launch.cli", *args, "--config-json", json.dumps(CFG.to_dict())],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    line = proc.stdout.readline()
    assert line.startswith("HELIX_READY "), line
    return proc, json.loads(line.split(" ", 1)[1])


def _stop(*procs):
    for p in procs:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        if p is not None:
            assert p.wait(timeout=20) == 0
            p.stdout.close()


# Another local user: a process that drops to uid/gid 65534 (nobody) before it dials. It has
# its own (empty) HOME, so no private Helix folder of the owner's; it tries to read the owner's
# token file, then calls every method of both services without a token.
_STRANGER = """
import json, os, sys
import grpc
from helix_core.security.tokenfiles import load_token
from helix_core.wire.proto import helix_pb2 as pb
a = json.loads(sys.argv[1])
os.setgroups([]); os.setgid(65534); os.setuid(65534)
out = {"uid": os.getuid(), "calls": {}}
try:
    open(a["token_file"]).read()
    out["read"] = "read"
except PermissionError:
    out["read"] = "denied"
out["found"] = load_token(coordinator=a["coordinator"])
for service, address in (("Coordinator", a["coordinator"]), ("DataServer", a["dataserver"])):
    ch = grpc.insecure_channel(address)
    for m in pb.DESCRIPTOR.services_by_name[service].methods:
        path = f"/{m.containing_service.full_name}/{m.name}"
        ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            if m.client_streaming:
                ch.stream_unary(path, **ident)(iter([b""]), timeout=10)
            else:
                ch.unary_unary(path, **ident)(b"", timeout=10)
            out["calls"][path] = "OK"
        except grpc.RpcError as e:
            out["calls"][path] = e.code().name
    ch.close()
print(json.dumps(out))
"""


@contextlib.contextmanager
def _services():
    """``helix coordinator --port P`` and ``helix dataserver``, both with no token: (address, dataserver address)."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    procs = {}
    try:
        procs["coordinator"], info = _start(["coordinator", "--port", str(port)])
        assert info["address"] == address
        procs["dataserver"], sinfo = _start(
            ["dataserver", "--coordinator", address, "--local-rank", "0", "--workers", "1"]
        )
        yield address, sinfo["address"], procs
    finally:
        _stop(procs.get("dataserver"), procs.get("coordinator"))


def test_a_cluster_started_with_no_token_makes_one_its_user_finds_and_a_restart_keeps(tmp_path):
    ds = IndexDataset(8)
    with _services() as (address, _, procs):
        token_file = tokenfiles.token_path(address)
        token = token_file.read_text().strip()
        assert len(token) >= 32 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, coordinator=address, config=CFG) as ld:
            assert_same_batches(list(ld), torch_batches(ds, 2, 0, 1))  # the owner passed no token
        status = subprocess.run(
            [sys.executable, "-m", "helix_core.launch.cli", "status", "--coordinator", address, "--json"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert [s["alive"] for s in json.loads(status.stdout)["servers"]] == [True]
        # restarted on its address (by hand, systemd, ...): the same token, so its servers and clients stay in
        _stop(procs.pop("coordinator"))
        procs["coordinator"], _ = _start(["coordinator", "--port", address.rsplit(":", 1)[1]])
        assert token_file.read_text().strip() == token
        with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, coordinator=address, config=CFG) as ld:
            assert_same_batches(list(ld), torch_batches(ds, 2, 0, 1))  # the DataServer registered again
    assert token_file.exists()  # a made token on a fixed port stays for the next Coordinator there


def test_token_files_of_port_0_and_of_a_local_cluster_go_when_they_stop():
    coord, info = _start(["coordinator", "--port", "0"])
    path = tokenfiles.token_path(info["address"])
    assert path.exists()
    _stop(coord)
    assert not path.exists()
    cluster = hx.LocalCluster(local_servers=1, workers_per_server=1, config=CFG)
    path = tokenfiles.token_path(cluster.address)
    assert path.read_text().strip() == cluster.token
    cluster.kill_coordinator()  # SIGKILL: it never removed its file
    assert path.exists()
    cluster.close()
    assert not path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another user needs root (CI runs as root)")
def test_another_user_is_refused_on_every_rpc_and_never_reads_the_token(tmp_path):
    with _services() as (address, dataserver, _):
        token_file = tokenfiles.token_path(address)
        env = dict(_env(), HOME=str(tmp_path / "stranger-home"))
        env.pop("HELIX_RUNTIME_DIR")
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _STRANGER,
                json.dumps({"coordinator": address, "dataserver": dataserver, "token_file": str(token_file)}),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        stranger = json.loads(done.stdout)
        assert stranger["uid"] == 65534 and stranger["read"] == "denied" and stranger["found"] is None
        from helix_core.wire.proto import helix_pb2 as pb

        every = sum(len(pb.DESCRIPTOR.services_by_name[s].methods) for s in ("Coordinator", "DataServer"))
        assert len(stranger["calls"]) == every == 21 and set(stranger["calls"].values()) == {"UNAUTHENTICATED"}, (
            stranger
        )
        ds = IndexDataset(4)
        with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, coordinator=address, config=CFG) as ld:
            assert_same_batches(list(ld), torch_batches(ds, 2, 0, 1))  # still serving its owner


_SQUATTER = """
import os, socket, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
s = socket.socket()  # the socket's owner is the uid that made it
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another user needs root (CI runs as root)")
def test_a_port_another_user_took_never_gets_this_users_token(tmp_path):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    tokenfiles.write_token(address, "this-users-token")  # left by this user's Coordinator, which stopped
    squatter = subprocess.Popen(
        [sys.executable, "-c", _SQUATTER, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert squatter.stdout.readline().strip() == "listening"
        with pytest.raises(ValueError, match=f"{address} is listened on by uid 65534"):
            tokenfiles.find_token(address)
        with pytest.raises(hx.ClusterError, match="listened on by uid 65534.*refusing to send"):
            hx.DistributedDataLoader(
                IndexDataset(4),
                batch_size=2,
                rank=0,
                world_size=1,
                coordinator=address,
                token="this-users-token",
                config=CFG,
            )
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "helix_core.launch.cli",
                "dataserver",
                "--coordinator",
                address,
                "--local-rank",
                "0",
            ],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
        assert done.returncode == 2 and "listened on by uid 65534" in done.stderr
    finally:
        squatter.stdin.close()
        squatter.wait(timeout=10)
        tokenfiles.remove_token(address, "this-users-token")


def test_a_dataserver_without_a_token_for_its_coordinator_names_where_it_looked():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "helix_core.launch.cli",
            "dataserver",
            "--coordinator",
            f"127.0.0.1:{_free_port()}",
            "--local-rank",
            "0",
            "--connect-timeout-s",
            "0.5",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert done.returncode == 2
    assert "no token for the Coordinator at 127.0.0.1:" in done.stderr
    assert str(tokenfiles.runtime_dir()) in done.stderr and "--token-file" in done.stderr


def test_a_coordinator_that_cannot_leave_its_made_token_privately_refuses_to_start(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    env = dict(_env(), HELIX_RUNTIME_DIR=str(shared))
    done = subprocess.run(
        [sys.executable, "-m", "helix_core.launch.cli", "coordinator", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"token folder {shared} is readable by other users" in done.stderr and "HELIX_RUNTIME_DIR" in done.stderr
    assert list(shared.iterdir()) == []
