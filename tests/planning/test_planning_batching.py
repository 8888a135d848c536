"""Tier-1 planner: pure unit tests on plain lists (no gRPC, no processes but one, no clocks)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helix_core.planning.balance import fill_unknown_costs, imbalance_ratio
from helix_core.planning.batching import TokenPlanner
from helix_core.planning.gpu import GPU_COSTS, GpuCost, gpu_cost

#: VideoMAE cost units of kinetics-mixed's S / M / L clips (1568 / 7056 / 25088 tokens)
KMIX = (1666.0, 9047.0, 50263.0)


def sampler_steps(n: int, ranks: int, batch: int, seed: int, epoch: int) -> list[list[list[int]]]:
    """``steps[s][r]`` as a shuffled DistributedSampler gives them: pad by repeating, rank r
    takes every ranks-th index, batches of ``batch`` (the last one may be shorter)."""
    order = np.random.default_rng([seed, epoch]).permutation(n).tolist()
    per_rank = -(-n // ranks)
    order += order[: per_rank * ranks - n]
    shards = [order[r::ranks] for r in range(ranks)]
    return [[shards[r][k : k + batch] for r in range(ranks)] for k in range(0, per_rank, batch)]


def plan_epoch(planner: TokenPlanner, steps, costs) -> list:
    out = []
    for w in planner.windows(len(steps)):
        out += planner.plan_window(steps[w.start : w.stop], costs)
    return out


def flat(steps) -> Counter:
    return Counter(i for step in steps for batch in step for i in batch)


def shape(steps) -> list[list[int]]:
    return [[len(batch) for batch in step] for step in steps]


@st.composite
def windows(draw):
    """A window of 1-6 steps (the last may be shorter), 1-5 ranks, indices with repeats."""
    ranks = draw(st.integers(1, 5))
    batch = draw(st.integers(1, 4))
    n_steps = draw(st.integers(1, 6))
    sizes = [batch] * (n_steps - 1) + [draw(st.integers(1, batch))]
    pool = draw(st.integers(1, 40))
    steps = [[[draw(st.integers(0, pool - 1)) for _ in range(b)] for _ in range(ranks)] for b in sizes]
    costs = draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=pool, max_size=pool))
    return ranks, steps, costs


@settings(max_examples=150, deadline=None)
@given(windows())
def test_plan_keeps_shape_and_consumes_every_sample_exactly_once(case):
    ranks, steps, costs = case
    plan = TokenPlanner(ranks, window=len(steps)).plan_window(steps, costs)
    assert shape(plan) == shape(steps)
    assert flat(plan) == flat(steps)  # multiset: padding duplicates included
    assert all(isinstance(i, int) for step in plan for batch in step for i in batch)


@settings(max_examples=150, deadline=None)
@given(windows())
def test_plan_is_never_worse_than_the_sampler(case):
    ranks, steps, costs = case
    plan = TokenPlanner(ranks, window=len(steps)).plan_window(steps, costs)
    assert imbalance_ratio(plan, costs) <= imbalance_ratio(steps, costs) * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(windows())
def test_window_of_one_never_moves_a_sample_across_steps(case):
    ranks, steps, costs = case
    planner = TokenPlanner(ranks, window=1)
    plan = plan_epoch(planner, steps, costs)
    assert len(plan) == len(steps)
    for before, after in zip(steps, plan):
        assert flat([after]) == flat([before])
        assert shape([after]) == shape([before])


def test_short_last_step_keeps_its_size_and_costs_can_be_a_callable():
    costs = {i: KMIX[i % 3] for i in range(30)}
    steps = sampler_steps(30, ranks=4, batch=3, seed=0, epoch=0)  # 8 per rank: steps of 3, 3, 2
    assert shape(steps) == [[3] * 4, [3] * 4, [2] * 4]
    planner = TokenPlanner(4, window=8)
    from_array = planner.plan_window(steps, [costs[i] for i in range(30)])
    from_callable = planner.plan_window(steps, costs.__getitem__)
    assert shape(from_array) == shape(steps) and flat(from_array) == flat(steps)
    assert from_callable == from_array


def test_identical_plans_from_independent_instances_and_processes():
    costs = [KMIX[i % 3] * (1 + (i % 7) / 10) for i in range(48)]
    steps = sampler_steps(48, ranks=4, batch=2, seed=3, epoch=1)
    mine = plan_epoch(TokenPlanner(4, window=4), steps, costs)
    assert plan_epoch(TokenPlanner(4, window=4), steps, costs) == mine
    # numpy inputs plan the same as lists
    np_steps = [[np.asarray(b, dtype=np.int32) for b in step] for step in steps]
    assert plan_epoch(TokenPlanner(4, window=4), np_steps, np.asarray(costs)) == mine
    code = (
        "import json, sys; from helix_core.planning.batching import TokenPlanner; a = json.load(sys.stdin); "
        "p = TokenPlanner(4, window=4); "
        "print(json.dumps([p.plan_window(a['steps'][w.start:w.stop], a['costs']) for w in p.windows(6)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps({"steps": steps, "costs": costs}),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert [s for window in json.loads(out.stdout) for s in window] == mine


def test_balances_a_kinetics_mixed_epoch():
    """48 clips, S/M/L alternating, 4 ranks, batch 2: 6 steps an epoch (the bench's set)."""
    costs = [KMIX[i % 3] for i in range(48)]
    epochs = [sampler_steps(48, 4, 2, seed=0, epoch=e) for e in range(10)]
    sampler = imbalance_ratio([s for steps in epochs for s in steps], costs)
    ratios = {
        w: imbalance_ratio([s for steps in epochs for s in plan_epoch(TokenPlanner(4, w), steps, costs)], costs)
        for w in (1, 2, 4, 8)
    }
    assert sampler > 1.5
    assert ratios[1] < sampler - 0.2
    assert ratios[1] > ratios[2] > ratios[4] > ratios[8]
    assert ratios[8] <= 1.05  # the default window covers the epoch's 6 steps
    # the mixture is kept per window: a window's samples are the sampler's (no sorted prefix)
    planner = TokenPlanner(4, window=2)
    steps = epochs[0]
    plan = plan_epoch(planner, steps, costs)
    for w in planner.windows(len(steps)):
        assert flat(plan[w.start : w.stop]) == flat(steps[w.start : w.stop])


def test_continuous_costs_balance_through_swaps_between_steps():
    """Costs of many sizes (openvid-like, lognormal): forming good steps needs swaps between steps
    (without them: 1.18 at window 2, 1.12 at window 4)."""
    costs = np.random.default_rng(7).lognormal(8, 0.8, 48).round().tolist()
    epochs = [sampler_steps(48, 4, 2, seed=0, epoch=e) for e in range(10)]
    ratio = {
        w: imbalance_ratio([s for steps in epochs for s in plan_epoch(TokenPlanner(4, w), steps, costs)], costs)
        for w in (2, 4, 8)
    }
    assert imbalance_ratio([s for steps in epochs for s in steps], costs) > 1.5
    assert ratio[2] < 1.13 and ratio[4] < 1.08 and ratio[8] < 1.03


def test_a_window_of_one_step_balances_within_the_step():
    # one step, 2 ranks x 2 samples: the sampler gives L+L and S+S; balanced is L+S on each rank
    costs = {0: 50.0, 1: 1.0, 3: 50.0, 4: 1.0}.__getitem__
    plan = TokenPlanner(2, window=1).plan_window([[[0, 3], [1, 4]]], costs)
    assert [sum(costs(i) for i in batch) for batch in plan[0]] == [51.0, 51.0]


def test_heavy_and_light_steps_alternate():
    # 4 classes of clearly different cost, 4 clips each: one class per step once balanced;
    # the steps come heaviest, lightest, 2nd heaviest, 2nd lightest
    costs = [1000.0] * 4 + [100.0] * 4 + [10.0] * 4 + [1.0] * 4
    steps = [[[0, 4], [8, 12]], [[1, 5], [9, 13]], [[2, 6], [10, 14]], [[3, 7], [11, 15]]]
    plan = TokenPlanner(2, window=4).plan_window(steps, costs)
    totals = [sum(costs[i] for b in step for i in b) for step in plan]
    assert imbalance_ratio(plan, costs) == 1.0
    assert totals == [4000.0, 4.0, 400.0, 40.0]


def test_already_balanced_window_is_left_as_the_sampler_gave_it():
    steps = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    costs = [5.0, 1.0, 1.0, 5.0, 2.0, 2.0, 3.0, 1.0]
    assert TokenPlanner(2, window=2).plan_window(steps, costs) == steps


def test_windows_count_from_the_start_of_the_epoch():
    assert TokenPlanner(4, window=4).windows(10) == [range(0, 4), range(4, 8), range(8, 10)]
    assert TokenPlanner(4, window=8).windows(6) == [range(0, 6)]
    assert TokenPlanner(4).windows(0) == []
    assert TokenPlanner(4).window == 8


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "window": 0}, "window"),
        ({"world_size": 2, "window": 1.5}, "window"),
        ({"world_size": True}, "world_size"),
    ],
)
def test_bad_planner_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        TokenPlanner(**kwargs)


@pytest.mark.parametrize(
    "steps, costs, name",
    [
        ([[[0, 1], [2]]], [1.0, 1.0, 1.0], r"steps\[0\]: ranks have different lengths"),
        ([[[0, 1]]], [1.0, 1.0], r"steps\[0\] has 1 ranks"),
        ([[[0], [1]]] * 3, [1.0, 1.0], r"steps: 3 steps exceed window=2"),
        ([[[0], [5]]], [1.0, 1.0], r"steps: sample index 5"),
        ([[[0], [1]]], [1.0, -2.0], r"costs\[1\]=-2.0"),
        ([[[0], [1]]], [float("nan"), 1.0], r"costs\[0\]=nan"),
    ],
)
def test_bad_windows_name_the_argument(steps, costs, name):
    with pytest.raises(ValueError, match=name):
        TokenPlanner(2, window=2).plan_window(steps, costs)


def test_imbalance_ratio():
    assert imbalance_ratio([[[0], [1]], [[2], [3]]], [3.0, 1.0, 2.0, 2.0]) == pytest.approx((3 + 2) / (2 + 2))
    assert imbalance_ratio([], [1.0]) == 1.0
    assert imbalance_ratio([[[0], [1]]], [0.0, 0.0]) == 1.0


def test_fill_unknown_costs_uses_the_bucket_median():
    buckets = [(16, 224, 224)] * 4 + [(64, 448, 448)] * 3 + [(8, 112, 112)]
    costs = [1.0, 2.0, 9.0, None, 50.0, float("nan"), 70.0, None]
    out = fill_unknown_costs(costs, buckets)
    assert out.tolist() == [1.0, 2.0, 9.0, 2.0, 50.0, 60.0, 70.0, 9.0]  # last: no known peer -> median of all
    assert fill_unknown_costs([None, None], ["a", "b"]).tolist() == [1.0, 1.0]
    rows = np.array([[16, 224, 224], [16, 224, 224], [32, 336, 336]])
    assert fill_unknown_costs([4.0, np.nan, 7.0], rows).tolist() == [4.0, 4.0, 7.0]  # array rows are buckets
    with pytest.raises(ValueError, match="buckets"):
        fill_unknown_costs([1.0, 2.0], ["a"])


def test_gpu_cost_model():
    c = GpuCost(a=2.0, b=0.5, c=10.0)
    assert c.sample_units([1, 2]).tolist() == [2.5, 6.0]
    assert c.step_units([1, 2]) == 18.5
    assert gpu_cost("videomae").sample_units(25_000) == pytest.approx(50_000)  # attention doubles it
    assert gpu_cost("videomae").sample_units([1568, 7056, 25088]).round().tolist() == [1666, 9047, 50264]
    assert set(GPU_COSTS) == {"videomae", "qwen2-vl", "qwen2.5-vl", "wan"}
    with pytest.raises(ValueError, match="valid: videomae"):
        gpu_cost("resnet")
