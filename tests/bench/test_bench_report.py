"""Bench report: results.json, report.md and figures from hand-made runs (no processes)."""

from __future__ import annotations

import json
import math

import pytest

from helix_bench.metrics import SYSTEM_METRIC_KEYS, Bound, StepRecord, system_metrics
from helix_bench.report.write import FIGURES, print_table, write_report
from helix_bench.runs import RUN_KEYS, write_results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metrics(step_s: float, wait_s: float, ranks=2, steps=4, samples=2, **kw) -> dict:
    """Every rank's step takes ``step_s`` (rank r waits ``wait_s * r``, the rest syncs)."""
    records = [
        StepRecord(r, s, wait_s * r, 0.5 * step_s, step_s - 0.5 * step_s - wait_s * r, step_s, None, samples, 64)
        for r in range(ranks)
        for s in range(steps)
    ]
    b = Bound(decode_s=1.0, gpu_s=0.5 * step_s * steps, cpu_slots=2, samples=ranks * steps * samples)
    return system_metrics(records, ddl_tolerance_s=0.01, bound=b, **kw)


def run(workload="kinetics-mixed", helix_step_s=0.1, **extra) -> dict:
    systems = {
        "native": metrics(0.2, 0.05),  # 10 samples/s at 2 ranks x 2 samples / 0.2 s ... x2
        "ray": {"skipped": "Ray is not installed (pip install 'helix[bench]')"},
        "helix": metrics(helix_step_s, 0.0, cross_ds_bytes=3_000_000, scheduler_overhead_us=[10.0, 20.0], cpu_util=0.9),
    }
    b = Bound(decode_s=1.0, gpu_s=0.2, cpu_slots=2, samples=16)
    return {
        "workload": workload,
        "regime": "gpu-bound",
        "window_scale": 1.5,
        "ranks": 2,
        "budget": 2,
        "batch_size": 2,
        "steps": 4,
        "warmup": 1,
        "ddl_tolerance_s": 0.01,
        "bound": b.as_dict(),
        "systems": systems,
        **extra,
    }


def check_pngs(paths):
    for name in FIGURES:
        data = paths[name].read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 1024, name


def test_one_run(tmp_path):
    paths = write_report(tmp_path, [run(note="on a 2-core machine extra sidecars add no CPU")])
    assert set(paths) == {"results.json", "report.md", *FIGURES}
    assert all(p.parent == tmp_path and p.exists() for p in paths.values())

    text = paths["results.json"].read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    assert set(RUN_KEYS) <= set(data)
    assert {"throughput_sps", "decode_s", "gpu_s"} <= set(data["bound"])
    native = data["systems"]["native"]
    assert set(native) == set(SYSTEM_METRIC_KEYS)
    assert native["batch_ready_p95_s"] is None  # NaN became null
    assert native["scheduler_overhead_us_p99"] is None
    assert data["systems"]["ray"] == {"skipped": "Ray is not installed (pip install 'helix[bench]')"}
    assert data["systems"]["helix"]["throughput_sps"] == pytest.approx(2 * native["throughput_sps"])

    md = paths["report.md"].read_text()
    assert "2.00x" in md and "1.00x" in md  # helix / native, native / native
    assert "skipped: Ray is not installed" in md
    assert "on a 2-core machine extra sidecars add no CPU" in md
    assert "| 3.0 |" in md  # cross-DS MB
    assert "limited by" in md
    for name in FIGURES:
        assert f"({name})" in md
    check_pngs(paths)


def test_sweep_of_two_runs(tmp_path):
    runs = [run(remote_servers=0), run("openvid-mixed", helix_step_s=0.05, remote_servers=8)]
    paths = write_report(tmp_path, runs)
    data = json.loads(paths["results.json"].read_text())
    assert list(data) == ["runs"] and len(data["runs"]) == 2
    assert data["runs"][1]["workload"] == "openvid-mixed"
    md = paths["report.md"].read_text()
    assert "## kinetics-mixed rd0" in md and "## openvid-mixed rd8" in md
    assert "2.00x" in md and "4.00x" in md
    assert md.count("skipped: Ray is not installed") == 2
    check_pngs(paths)


def test_missing_keys_are_named(tmp_path):
    bad = run()
    del bad["warmup"], bad["bound"]
    with pytest.raises(ValueError, match=r"missing keys \['warmup', 'bound'\]"):
        write_results(tmp_path, bad)
    with pytest.raises(ValueError, match=r"run 1: missing keys \['warmup', 'bound'\]"):
        write_report(tmp_path, [run(), bad])
    assert not (tmp_path / "results.json").exists()  # nothing written when a run is invalid

    bad = run()
    del bad["systems"]["helix"]["ddl_miss_rate"]
    with pytest.raises(ValueError, match=r"systems\['helix'\] is missing keys \['ddl_miss_rate'\]"):
        write_results(tmp_path, bad)
    bad = run()
    del bad["bound"]["gpu_s"]
    with pytest.raises(ValueError, match="bound needs keys"):
        write_results(tmp_path, bad)


def test_results_round_trip_and_rich_table(tmp_path):
    path = write_results(tmp_path, run())
    reloaded = json.loads(path.read_text())  # nulls in place of NaN still render
    paths = write_report(tmp_path / "again", reloaded)
    assert "2.00x" in paths["report.md"].read_text()

    from rich.console import Console

    console = Console(record=True, width=250)
    print_table(console, reloaded)
    out = console.export_text()
    assert "2.00x" in out and "skipped: Ray is not installed" in out and "n/a" in out
    narrow = Console(record=True, width=80)  # `helix demo` in an 80-column terminal: one row per metric
    print_table(narrow, reloaded)
    lines = narrow.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert any(line.lstrip("│┃ ").startswith("DDL miss") for line in lines) and "2.00x" in "\n".join(lines)
    assert not math.isnan(reloaded["systems"]["helix"]["bound_fraction"])


def test_tier2_rounds_join_the_ranks_views_and_the_report_shows_projected_against_realised(tmp_path):
    from helix_bench.results import tier2_rounds

    cost = {0: 10.0, 1: 1.0, 2: 10.0, 3: 1.0, 4: 5.0, 5: 5.0, 6: 2.0, 7: 2.0}.__getitem__

    def view(position, outcome, before, after, gain=0.0, input_wait=0.0):
        return {
            "epoch": 0,
            "position": position,
            "outcome": outcome,
            "closed_by": "complete",
            "round_samples": 4,
            "input_wait_s": input_wait,
            "gain_s": gain,
            "transfer_s": 0.001 if outcome == "moved" else 0.0,
            "wait_s": 0.02,
            "moved_in": sum(i not in before for i in after),
            "moved_out": sum(i not in after for i in before),
            "moved_bytes": 100 * sum(i not in before for i in after),
            "crossed_bytes": 0,
            "before": before,
            "after": after,
        }

    # step 0: rank 0 held both heavy samples (20 vs 2) and traded one; step 1 kept (10 vs 4, where the best deal
    # gives 7 and 7: the gate passed up 3 units); step 2 one rank only
    ranks = [
        {
            "rebalance_rounds": [
                view(0, "moved", [0, 2], [0, 3], gain=8.0, input_wait=0.1),
                view(1, "kept", [4, 5], [4, 5], gain=0.4, input_wait=0.3),
                view(2, "alone", [0, 1], [0, 1]),
            ]
        },
        {
            "rebalance_rounds": [
                view(0, "moved", [1, 3], [1, 2], gain=8.0, input_wait=0.1),
                view(1, "kept", [6, 7], [6, 7], gain=0.4, input_wait=0.3),
            ]
        },
    ]
    t = tier2_rounds(ranks, cost, seconds_per_unit=0.5)
    assert (t["rounds"], t["moved"], t["kept"], t["partial"]) == (2, 1, 1, 1)
    assert t["projected_gain_s"] == pytest.approx(8.0)
    assert t["realised_gain_s"] == pytest.approx((20 - 11) * 0.5)  # slowest rank 20 units before, 11 after
    assert t["moved_samples"] == 2 and t["moved_bytes"] == 200
    assert t["input_wait_s_p50"] == pytest.approx(0.2)  # the waits the gate discounted in the decided rounds
    assert t["closed_by"] == {"complete": 5}  # each rank's view of each step's round, partial ones too
    assert t["kept_projected_gain_s"] == pytest.approx(0.4) and t["kept_floor_gain_s"] == pytest.approx(3 * 0.5)

    r = run()
    r["systems"]["helix"]["tier2_rounds"] = t
    r["systems"]["helix"]["imbalance_within_step_floor"] = 1.02
    md = write_report(tmp_path, [r])["report.md"].read_text()
    assert "Tier-2 rounds" in md and "| 1 / 1 / 0 / 0 |" in md and "| 8.00 | 4.50 |" in md and "→ 1.020" in md
    assert "| complete 5 |" in md and "| 0.40 / 1.50 |" in md
