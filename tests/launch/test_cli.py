"""The `helix` command, run as a user runs it."""

import json
import subprocess
import sys

import pytest


def _helix(*args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "helix_core.launch.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_synth_then_profile(tmp_path):
    r = _helix(
        "synth", str(tmp_path), "--workload", "kinetics-small", "--clips", "2", "--scale", "0.2", "--workers", "1"
    )
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


@pytest.mark.timeout(400)
def test_demo_and_bench_write_a_report(tmp_path):
    import os

    env = {**os.environ, "HELIX_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    r = _helix(
        "demo",
        "--clips",
        "6",
        "--scale",
        "0.25",
        "--warmup",
        "1",
        "--steps",
        "4",
        "--out",
        str(tmp_path / "demo"),
        env=env,
        timeout=380,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "native" in r.stdout and "helix" in r.stdout and "report:" in r.stdout
    results = json.loads((tmp_path / "demo" / "results.json").read_text())
    assert {
        "workload",
        "regime",
        "window_scale",
        "ranks",
        "budget",
        "batch_size",
        "steps",
        "warmup",
        "ddl_tolerance_s",
        "bound",
        "systems",
    } <= set(results)
    assert set(results["systems"]) == {"native", "helix"} and results["steps"] == 4
    for name, m in results["systems"].items():
        assert m["throughput_sps"] > 0 and len(m["per_rank"]) == 2 and 0 < m["bound_fraction"], name
    assert (
        "x |" in (tmp_path / "demo" / "report.md").read_text()
        or "1.00x" in (tmp_path / "demo" / "report.md").read_text()
    )
    for fig in ("fig2_step_time_p95.png", "fig8_wait_breakdown.png", "fig10_throughput.png"):
        assert (tmp_path / "demo" / fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
