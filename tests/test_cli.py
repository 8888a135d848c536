"""The `helix` command, run as a user runs it."""
import json
import subprocess
import sys

import pytest


def _helix(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "helix_core.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_synth_then_profile(tmp_path):
    r = _helix("synth", str(tmp_path), "--workload", "kinetics-small", "--clips", "2", "--scale", "0.2", "--workers", "1")
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "manifest.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["path"] == "clip_000000.mp4"
    r = _helix("profile", str(tmp_path / "manifest.jsonl"), "--calibrate", "1")
    assert r.returncode == 0, r.stderr
    assert "16f" in r.stdout or "32f" in r.stdout or "64f" in r.stdout
    assert (tmp_path / "profiles.jsonl").exists()


def test_bad_manifest_gives_a_clear_error(tmp_path):
    (tmp_path / "manifest.jsonl").write_text('{"path": "a.mp4"}\n{oops\n')
    r = _helix("profile", str(tmp_path / "manifest.jsonl"))
    assert r.returncode == 2 and "line 2" in r.stdout


def test_unknown_workload_lists_valid_ones(tmp_path):
    r = _helix("synth", str(tmp_path), "--workload", "nope")
    assert r.returncode == 2 and "kinetics-mixed" in r.stderr


@pytest.mark.timeout(300)
def test_demo_runs(tmp_path):
    import os

    r = _helix("demo", "--clips", "3", env={**os.environ, "HELIX_CACHE": str(tmp_path), "COLUMNS": "160"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "predicted CPU ms" in r.stdout and "64x448x448" in r.stdout
