"""The emulated GPU window and the regime calibration, on hand-made numbers."""

import pytest

from helix_bench.benchconfig import BenchConfig
from helix_bench.emulate import GPU_COSTS, GpuCost, regime_window_scale
from helix_bench.harness import expected_indices


def test_model_cost_is_linear_plus_quadratic():
    c = GpuCost(a=2.0, b=0.5, c=10.0)
    assert c.sample_units(4) == 2 * 4 + 0.5 * 16
    assert c.step_units([1, 2]) == (2 + 0.5) + (4 + 2) + 10
    assert GPU_COSTS["videomae"].sample_units(25_000) == pytest.approx(50_000)  # attention doubles it


def test_regime_window_scale_hits_the_factor():
    cost = GpuCost(a=1.0, b=0.0, c=0.0)
    decode = [0.1, 0.3]  # mean 0.2 s per sample
    tokens = [100, 300]  # mean 200 units per sample
    # 4 ranks x batch 2 x 0.2 s over 2 CPU slots = 0.8 s pooled decode per step; a rank's batch = 400 units
    s = regime_window_scale("gpu-bound", decode, tokens, batch_size=2, ranks=4, cpu_slots=2, cost=cost)
    assert s * 400 == pytest.approx(2.0 * 0.8)
    s = regime_window_scale("cpu-bound", decode, tokens, batch_size=2, ranks=4, cpu_slots=2, cost=cost)
    assert s * 400 == pytest.approx(0.7 * 0.8)
    with pytest.raises(ValueError, match="gpu-bound"):
        regime_window_scale("io-bound", decode, tokens, 2, 4, 2, cost)


def test_expected_indices_follow_distributed_sampler_across_epochs():
    cfg = BenchConfig(ranks=2, batch_size=2, warmup=1, steps=4, budget=2)
    plan = expected_indices(6, cfg)  # 3 samples per rank per epoch: batches of 2 and 1
    assert [len(b) for b in plan[0]] == [2, 1, 2, 1, 2]
    flat = sorted(i for r in plan for b in r[:2] for i in b)
    assert flat == list(range(6))  # one epoch covers every sample once


def test_bench_config_validates():
    with pytest.raises(ValueError, match="native"):
        BenchConfig(systems=("native", "tf.data"))
    with pytest.raises(ValueError, match="budget"):
        BenchConfig(ranks=4, budget=2, systems=("helix",))
