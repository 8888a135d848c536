"""`helix bench --redistribute` on a tiny run: real member processes decode real clips, move them
by all_to_all, by gRPC and by handles, and write the figures; bad sizes are named."""

import json
import subprocess
import sys

import pytest

from helix_bench.micro.redistribute import run_redistribute


def test_a_tiny_redistribution_run_writes_its_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("HELIX_CACHE", str(tmp_path / "cache"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "helix_core.launch.cli",
            "bench",
            "--redistribute",
            "6",
            "--ranks",
            "3",
            "--repeats",
            "2",
            "--scale",
            "0.2",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "out" / "redistribute.json").read_text())
    assert figures["servers"] == 3 and figures["moved_clips"] == 3 and figures["moved_bytes"] > 0
    assert figures["all_to_all_s"] > 0 and figures["grpc_s"] > 0 and figures["handles_s"] > 0
    assert "all_to_all (gloo)" in done.stdout and "handle exchange" in done.stdout


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="servers >= 2, clips >= servers"):
        run_redistribute(servers=1, clips=4)
