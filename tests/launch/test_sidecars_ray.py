"""Sidecars on Ray: DataServers as Ray actors on a real Ray cluster (a head and a worker
node, on loopback) join a Helix cluster, serve its ranks, come back after their actor is killed
mid-epoch (the epoch still ends exactly once), and leave no actor or process behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import helix_core as hx

pytest.importorskip("ray", reason="Ray is not installed (pip install 'helix[bench]')")
APP = Path(__file__).resolve().parents[1] / "apps" / "ray_sidecars_app.py"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_ray_sidecars_register_serve_restart_after_a_kill_and_close_completely():
    done = subprocess.run(
        [sys.executable, str(APP)],
        capture_output=True,
        text=True,
        timeout=400,
        env={k: v for k, v in os.environ.items() if not k.startswith(("HELIX_", "RAY_"))},
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    got = json.loads(lines[-1][len("RESULT ") :])
    assert got["ray_nodes"] == 2
    first = got["first"]
    assert len({s["server_id"] for s in first}) == 2 and all(s["alive"] for s in first)
    assert all(s["address"].startswith("127.0.0.1:") for s in first)  # toward the loopback Coordinator
    assert got["exact"]  # the epoch ended exactly once, one sidecar killed mid-way
    assert got["cross_ds_bytes"] > 0  # sidecars streamed batches to the rank's local server
    assert got["after"] is not None, "Ray did not restart the killed sidecar"
    assert got["after"][0]["server_id"] != first[0]["server_id"]  # a new incarnation ...
    assert got["after"][0]["server_id"] in got["registered"]  # ... registered again with the Coordinator
    assert got["actors_left"] == []  # close() ended them
    pids = [s["pid"] for s in first + got["after"]] + [s["actor_pid"] for s in first + got["after"]]
    assert not [p for p in pids if _alive(p)]  # and their DataServers
    assert "failed to start" in got["unreachable"] and got["unreachable_s"] < 90


def test_ray_sidecars_bad_counts_are_named():
    with pytest.raises(ValueError, match="--count"):
        hx.ray_sidecars("127.0.0.1:1", count=0, workers=1)
    with pytest.raises(ValueError, match="--workers"):
        hx.ray_sidecars("127.0.0.1:1", count=1, workers=0)


def test_ray_sidecars_beyond_loopback_without_tls_name_the_python_parameters(monkeypatch):
    for k in [k for k in os.environ if k.startswith("HELIX_TLS_")]:
        monkeypatch.delenv(k)
    with pytest.raises(ValueError, match=r"ray_sidecars: .*host='192\.0\.2\.7'.*tls_env=.*insecure=True") as err:
        hx.ray_sidecars("127.0.0.1:1", count=1, workers=1, token="t", host="192.0.2.7")
    assert "--tls" not in str(err.value)
    with pytest.raises(ValueError, match=r"toward the Coordinator at 192\.0\.2\.8:1.*tls_env="):
        hx.ray_sidecars("192.0.2.8:1", count=1, workers=1, token="t")


def test_a_sidecar_binds_the_interface_toward_its_coordinator():
    from helix_core.launch.sidecars import toward

    assert toward("127.0.0.1:7070") == "127.0.0.1" and toward("localhost:7070") in ("127.0.0.1", "::1")


def test_helix_sidecars_command_names_a_ray_address_that_does_not_answer():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "helix_core.launch.cli",
            "sidecars",
            "--ray",
            "127.0.0.1:9",
            "--coordinator",
            "127.0.0.1:1",
            "--count",
            "1",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 2 and "--ray 127.0.0.1:9" in done.stdout + done.stderr, done.stdout + done.stderr
