"""A tiny real `helix bench` run: every system consumes the same samples; Ray absent is a clear skip."""

import json

import pytest

from helix_bench import harness
from helix_bench.benchconfig import BenchConfig
from helix_bench.harness import run_bench


@pytest.mark.timeout(400)
def test_tiny_run_writes_results_for_each_system(tmp_path, monkeypatch):
    monkeypatch.setattr("helix_bench.raypool.ray_available", lambda: "Ray is not installed (test)")
    # prefetch 1: a system that runs ahead must still decode most measured batches inside the measured window
    cfg = BenchConfig(
        ranks=2,
        budget=2,
        batch_size=2,
        warmup=1,
        steps=3,
        clips=6,
        scale=0.25,
        prefetch=1,
        systems=("native", "ray", "helix-pool", "helix", "helix-tier2"),
        data_dir=str(tmp_path / "data"),
    )
    runs = run_bench([cfg], tmp_path / "out")
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["systems"]["ray"] == {"skipped": "Ray is not installed (test)"}
    # 6 clips, 2 ranks, batch 2: 2 steps an epoch, so a window is an epoch: 1 + 3 steps round to 2 + 4
    assert (results["warmup"], results["steps"], results["steps_per_epoch"]) == (2, 4, 2)
    for name in ("native", "helix-pool", "helix"):
        m = results["systems"][name]
        assert m["steps"] == 4 and m["throughput_sps"] > 0 and [r["rank"] for r in m["per_rank"]] == [0, 1]
        roles = m["cpu_s_by_role"]
        # the ranks' own CPU over 4 tiny steps can be under one clock tick (10 ms): measured, maybe 0
        assert roles["decode"] > 0 and roles["ranks"] >= 0 and 0 < m["decode_efficiency"] <= 1.5
    assert "workers" in results["systems"]["helix"]["cpu_s_by_role"]
    assert "loader-workers" in results["systems"]["native"]["cpu_s_by_role"]
    assert results["systems"]["helix"]["imbalance_ratio"] <= results["systems"]["native"]["imbalance_ratio"]
    assert runs[0]["bound"]["decode_s"] > 0 and results["bound"]["throughput_sps"] > 0
    assert 0.5 < results["bound"]["decode_capacity"] <= 2
    probes = results["bound"]["capacity_probes"]  # 3 before the systems, one after each that ran (not ray)
    assert len(probes) == harness.CALIBRATION_PROBES + 4
    assert results["bound"]["decode_capacity"] == pytest.approx(sorted(probes)[len(probes) // 2])
    assert list(results["systems"]) == ["native", "ray", "helix-pool", "helix", "helix-tier2"]
    assert f"median of {len(probes)} probes" in (tmp_path / "out" / "report.md").read_text()
    assert "Ray is not installed" in (tmp_path / "out" / "report.md").read_text()
    helix = results["systems"]["helix"]
    assert 0 < helix["decode_slots_busy"] <= 1 and helix["decode_slots"] == 2 and helix["decode_timeline"]
    assert (tmp_path / "out" / "fig_decode_slots.png").stat().st_size > 0
    assert helix["stolen"] >= 0 and "stolen" not in results["systems"]["native"]  # pieces work stealing made
    assert "Stolen pieces" in (tmp_path / "out" / "report.md").read_text()
    t2 = results["systems"]["helix-tier2"]  # every step's round, seen by both ranks, in the report
    assert t2["steps"] == 4 and t2["tier2_rounds"]["rounds"] >= 6 and not t2["rebalance_errors"]
    assert t2["imbalance_within_step_floor"] <= t2["imbalance_ratio"]
    assert "Tier-2 rounds" in (tmp_path / "out" / "report.md").read_text()


def test_a_system_that_consumes_other_samples_is_caught(tmp_path, monkeypatch):
    real = harness.expected_indices

    def shifted(n, cfg):  # the harness expects other samples than the ranks will consume
        plan = real(n, cfg)
        return [[[(i + 1) % n for i in b] for b in rank] for rank in plan]

    monkeypatch.setattr(harness, "expected_indices", shifted)
    cfg = BenchConfig(
        ranks=2,
        budget=2,
        batch_size=2,
        warmup=0,
        steps=2,
        clips=6,
        scale=0.25,
        systems=("native",),
        data_dir=str(tmp_path / "data"),
    )
    with pytest.raises(RuntimeError, match="consumed samples"):
        harness.run_one(cfg)
