"""Services start in any order, as a start script, two terminals or two pods start them: a
DataServer started before its Coordinator waits for it (and for the token file it writes) up to
``--connect-timeout-s``, saying once what it waits for, then serves; with no Coordinator at all it
fails, after that wait, with the error it gives at once today."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from dataplane import CFG, assert_same_batches, torch_batches

import helix_core as hx
from helix_core.testing.datasets import IndexDataset


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _helix(*args, env):
    return subprocess.Popen(
        [sys.executable, "-m", "helix_core.launch.cli", *args, "--config-json", json.dumps(CFG.to_dict())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _ready(proc, timeout_s: float = 60.0) -> dict:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    assert sel.select(timeout_s), f"no ready line within {timeout_s} s"
    line = proc.stdout.readline()
    assert line.startswith("HELIX_READY "), (line, proc.stderr.read() if proc.poll() is not None else "")
    return json.loads(line.split(" ", 1)[1])


def _stop(*procs):
    for p in procs:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        if p is not None:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def test_a_dataserver_started_before_its_coordinator_waits_for_it_then_serves(tmp_path):
    env = dict(os.environ, HELIX_RUNTIME_DIR=str(tmp_path / "runtime"))  # this user's private folder, empty
    address = f"127.0.0.1:{_free_port()}"
    server = coord = None
    try:
        server = _helix("dataserver", "--coordinator", address, "--local-rank", "0", "--workers", "1", env=env)
        time.sleep(1.5)  # the Coordinator comes up later (a start script's second line, another terminal)
        assert server.poll() is None, server.stderr.read()
        coord = _helix("coordinator", "--port", address.rsplit(":", 1)[1], env=env)
        assert _ready(coord)["address"] == address
        info = _ready(server)
        assert info["cluster_id"]
        ds = IndexDataset(10)
        token = (tmp_path / "runtime").glob("coordinator-*.token").__next__().read_text().strip()
        with hx.DistributedDataLoader(
            ds, batch_size=3, rank=0, world_size=1, coordinator=address, token=token, config=CFG
        ) as ld:
            assert_same_batches(list(ld), torch_batches(ds, 3, 0, 1))
    finally:
        _stop(server, coord)
    said = server.stderr.read()
    assert said.count("waiting up to 60 s for the Coordinator at " + address) == 1, said  # said once


def test_a_dataserver_whose_coordinator_never_comes_fails_after_its_connect_timeout(tmp_path):
    env = dict(os.environ, HELIX_RUNTIME_DIR=str(tmp_path / "runtime"))
    address = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    server = _helix(
        "dataserver",
        "--coordinator",
        address,
        "--local-rank",
        "0",
        "--workers",
        "1",
        "--connect-timeout-s",
        "1.5",
        env=env,
    )
    try:
        out, err = server.communicate(timeout=60)
    finally:
        _stop(server)
    assert server.returncode == 2 and time.monotonic() - t0 >= 1.5
    assert (
        "waiting up to 1.5 s for the Coordinator at" in err
        and f"error: no token for the Coordinator at {address}" in err
    ), err


def test_a_dataserver_with_a_token_waits_for_a_coordinator_that_answers(tmp_path):
    """With the token given (HELIX_TOKEN, a Kubernetes secret), it waits for the Coordinator's port."""
    env = dict(os.environ, HELIX_RUNTIME_DIR=str(tmp_path / "runtime"), HELIX_TOKEN="pod-token")
    address = f"127.0.0.1:{_free_port()}"
    server = coord = None
    try:
        server = _helix("dataserver", "--coordinator", address, "--local-rank", "0", "--workers", "1", env=env)
        time.sleep(1.5)
        assert server.poll() is None, server.stderr.read()
        coord = _helix("coordinator", "--port", address.rsplit(":", 1)[1], env=env)
        _ready(coord)
        assert _ready(server)["cluster_id"]
    finally:
        _stop(server, coord)
    assert server.stderr.read().count(f"waiting up to 60 s for the Coordinator at {address} to answer") == 1


def test_a_token_file_others_may_read_is_refused_at_once_not_waited_for(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    token_file.chmod(0o644)
    env = dict(os.environ, HELIX_RUNTIME_DIR=str(tmp_path / "runtime"))
    t0 = time.monotonic()
    server = _helix(
        "dataserver",
        "--coordinator",
        f"127.0.0.1:{_free_port()}",
        "--local-rank",
        "0",
        "--token-file",
        str(token_file),
        env=env,
    )
    try:
        _, err = server.communicate(timeout=60)
    finally:
        _stop(server)
    assert server.returncode == 2 and time.monotonic() - t0 < 30 and "chmod 600" in err, err
