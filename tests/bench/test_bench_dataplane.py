"""`python -m helix_bench.micro.dataplane`: figure arithmetic on hand-made numbers, and one small
real run of the remote-stream and route parts (nothing here asserts a speed)."""

from __future__ import annotations

import json
import math

import psutil
import pytest

from helix_bench.micro import dataplane as bd
from helix_bench.micro.e2e import _run_ranks, e2e_figures


def _new_children(before: set[int]) -> list[psutil.Process]:
    """Live child processes not in ``before``, except multiprocessing's resource tracker (it
    serves the whole interpreter, started by the first spawn-context Queue)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid in before or p.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(p)
    return out


def test_stream_figures_subtract_the_local_execute():
    gb = 2_000_000_000
    f = bd.stream_figures(
        gb,
        remote_s=[2.0, 3.0, 2.5],
        local_s=[1.0, 1.5, 1.0],
        remote_exec_s=[1.0, 2.0, 1.5],
        local_exec_s=[0.9, 1.4, 0.9],
    )
    assert f["remote_s"] == 2.5 and f["local_s"] == 1.0
    assert f["stream_gb_s"] == pytest.approx(2.0 / 1.5)  # medians: 2.5 - 1.0 seconds of streaming
    assert f["e2e_gb_s"] == pytest.approx(0.8)
    # per call: wall - own exec_s - median local overhead (0.1 s) = 0.9 s each
    assert f["stream_per_call_gb_s"] == pytest.approx(2.0 / 0.9)
    assert f["repeats"] == 3


def test_stream_figures_without_a_positive_difference_is_nan():
    f = bd.stream_figures(1 << 20, remote_s=[1.0], local_s=[1.2])
    assert math.isnan(f["stream_gb_s"]) and math.isnan(f["stream_per_call_gb_s"])
    assert f["e2e_gb_s"] == pytest.approx((1 << 20) / 1e9)


def test_route_figures():
    f = bd.route_figures(4, [10, 20, 30, 40], 2.0, [10.0, 20.0, 30.0, 40.0, 50.0])
    assert f["requests"] == 100 and f["requests_per_s"] == 50.0
    assert f["scheduler_overhead_us_p50"] == 30.0
    assert f["scheduler_overhead_us_p99"] == pytest.approx(49.6)


def test_e2e_figures_pool_ranks_and_take_the_slowest():
    ranks = [
        {"waits_s": [1.0, 0.1, 0.2], "wall_s": 2.0, "samples": 6, "cross_ds_bytes": 5},
        {"waits_s": [3.0, 0.3], "wall_s": 4.0, "samples": 4, "cross_ds_bytes": 0},
    ]
    f = e2e_figures("helix", 2, 2, ranks)
    assert f["epoch_wall_s"] == 4.0 and f["samples"] == 10 and f["samples_per_s"] == 2.5
    assert f["steps"] == 5
    assert f["input_wait_p50_s"] == 0.3  # pooled: 0.1 0.2 0.3 1.0 3.0
    assert f["input_wait_p95_s"] == pytest.approx(2.6)
    assert f["first_wait_s"] == 2.0  # median of 1.0 and 3.0
    assert f["cross_ds_bytes"] == 5


def test_only_rejects_unknown_parts_and_plain_drops_nan():
    with pytest.raises(SystemExit):
        bd.main(["--only", "local,warp"])
    assert bd._plain({"a": [math.nan, 1.0], "b": math.inf, "c": "x"}) == {"a": [None, 1.0], "b": None, "c": "x"}


def test_quick_remote_and_route_run(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "figures.json"
    figures = bd.main(["--only", "route,remote", "--quick", "--out", str(out)])
    assert set(figures) == {"meta", "remote", "route"}
    assert [r["path"] for r in figures["remote"]] == ["bulk", "grpc"]  # both delivery paths, side by side
    for row in figures["remote"]:
        # the receiver's CPU is read in 10 ms ticks: a quick run's 16 MiB may cost less than one
        assert row["e2e_gb_s"] > 0 and row["bytes"] > 0 and row["recv_ms_per_mb"] >= 0
    assert [(r["scheduler"], r["threads"]) for r in figures["route"]] == [
        ("least-request", 1),
        ("least-request", 4),
        ("deadline", 1),
        ("deadline", 4),
    ]
    for row in figures["route"]:
        assert row["requests_per_s"] > 0 and row["scheduler_overhead_us_p50"] > 0 and row["candidates"] == 64
        assert row["route_us_p50"] >= row["scheduler_overhead_us_p50"]  # the client's round trip holds the decision
    assert json.loads(out.read_text())["route"][0]["requests"] == figures["route"][0]["requests"]
    left = _new_children(before)
    assert not left, f"processes left running: {left}"


def test_a_failing_rank_is_reported_and_every_rank_process_ends(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="native rank .* failed"):
        _run_ranks("native", 2, str(tmp_path / "missing" / "manifest.jsonl"), "", 1, 2, timeout_s=60)
    left = _new_children(before)
    assert not left, f"rank processes left running: {left}"
