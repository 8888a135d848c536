"""`helix planner` on the session's small kinetics-mixed workload (profile table, no decoding)."""

from __future__ import annotations

import pytest

from helix_bench.micro.planner import measure_planner, run_planner_bench, sampler_steps


def test_planner_bench_balances_the_sampler_steps(kmix):
    r = measure_planner(
        kmix / "manifest.jsonl", "videomae", windows=[1, 3], ranks=2, batch_size=1, epochs=4, workload="kinetics-mixed"
    )
    assert (r.samples, r.steps) == (6, 12)  # 6 clips / 2 ranks / batch 1 = 3 steps an epoch
    assert r.windows_planned == {1: 12, 3: 4}
    assert r.unbalanced > 1.0
    assert all(1.0 <= r.ratios[w] <= r.unbalanced for w in (1, 3))
    assert r.ratios[3] < r.unbalanced  # S, M, L alternate: a window of the whole epoch pairs them well
    assert all(t > 0 for t in r.median_us.values())


def test_sampler_steps_are_the_distributed_sampler_order():
    steps = sampler_steps(10, ranks=4, batch_size=2, seed=0, epoch=1)  # padded to 12: 3 per rank
    assert [[len(b) for b in s] for s in steps] == [[2] * 4, [1] * 4]
    assert set(i for s in steps for b in s for i in b) == set(range(10))
    assert steps != sampler_steps(10, ranks=4, batch_size=2, seed=0, epoch=2)  # set_epoch reshuffles


def test_bad_names_fail_before_any_synthesis(tmp_path):
    with pytest.raises(ValueError, match="workloads"):
        run_planner_bench(["kinetics-huge"], ["videomae"], [1], data_dir=tmp_path)
    with pytest.raises(ValueError, match="valid: videomae"):
        run_planner_bench(["kinetics-mixed"], ["resnet"], [1], data_dir=tmp_path)
    assert not any(tmp_path.iterdir())
