"""Bench metrics on hand-made step records (pure: no processes, no clocks)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from helix_bench.metrics import (
    PER_RANK_KEYS,
    SYSTEM_METRIC_KEYS,
    Bound,
    StepRecord,
    balanced_gpu_s,
    percentile,
    system_metrics,
)


def rec(rank, step, wait, compute=0.1, sync=0.0, step_s=None, ready=None, samples=2, tokens=100):
    step_s = wait + compute + sync if step_s is None else step_s
    return StepRecord(rank, step, wait, compute, sync, step_s, ready, samples, tokens)


# rank 0 waits, rank 1 syncs; 3 steps each, 2 samples per step: 12 samples in all.
WAITS = {0: [0.0, 0.010, 0.030], 1: [0.005, 0.0, 0.001]}
SYNCS = {0: [0.0, 0.0, 0.0], 1: [0.02, 0.04, 0.03]}


def two_ranks(ready=True):
    return [
        rec(r, s, WAITS[r][s], compute=0.1 + 0.01 * r, sync=SYNCS[r][s], ready=(0.001 * (s + 1) if ready else None))
        for r in (1, 0)
        for s in (2, 0, 1)  # out of order on purpose
    ]


def bound(samples=12, decode_s=1.0, gpu_s=0.2, cpu_slots=2):
    return Bound(decode_s=decode_s, gpu_s=gpu_s, cpu_slots=cpu_slots, samples=samples)


@pytest.mark.parametrize("q", [0, 5, 50, 95, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.3, 0.01, 5.0, 0.2, 0.2, 1.7, 0.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([4.0], q) == 4.0


def test_percentile_empty_and_bad_q():
    assert math.isnan(percentile([], 95))
    with pytest.raises(ValueError, match="q must be in 0..100"):
        percentile([1.0], 101)


def test_keys_are_exactly_the_contract():
    m = system_metrics(two_ranks(), ddl_tolerance_s=0.005, bound=bound())
    assert tuple(m) == SYSTEM_METRIC_KEYS
    assert all(tuple(row) == PER_RANK_KEYS for row in m["per_rank"])


def test_pooled_percentiles_and_means():
    records = two_ranks()
    m = system_metrics(records, ddl_tolerance_s=0.005, bound=bound())
    waits = [w for r in (0, 1) for w in WAITS[r]]
    steps = [r.step_s for r in records]
    assert m["input_wait_p50_s"] == pytest.approx(np.percentile(waits, 50))
    assert m["input_wait_p95_s"] == pytest.approx(np.percentile(waits, 95))
    assert m["step_time_p95_s"] == pytest.approx(np.percentile(steps, 95))
    assert m["batch_ready_p95_s"] == pytest.approx(np.percentile([0.001, 0.002, 0.003] * 2, 95))
    assert m["sync_wait_mean_s"] == pytest.approx((0.02 + 0.04 + 0.03) / 6)
    assert m["steps"] == 3


def test_ddl_miss_at_the_tolerance_is_not_a_miss():
    # waits: 0.0, 0.010, 0.030, 0.005, 0.0, 0.001 -> with tolerance 0.010 only 0.030 misses
    m = system_metrics(two_ranks(), ddl_tolerance_s=0.010, bound=bound())
    assert m["ddl_miss_rate"] == pytest.approx(1 / 6)
    assert [row["ddl_miss_rate"] for row in m["per_rank"]] == pytest.approx([1 / 3, 0.0])
    m = system_metrics(two_ranks(), ddl_tolerance_s=0.005, bound=bound())  # 0.005 itself: no miss
    assert m["ddl_miss_rate"] == pytest.approx(2 / 6)
    assert system_metrics(two_ranks(), ddl_tolerance_s=0.0, bound=bound())["ddl_miss_rate"] == pytest.approx(4 / 6)


def test_throughput_uses_the_slowest_rank_wall_time():
    records = two_ranks()
    wall = max(sum(r.step_s for r in records if r.rank == k) for k in (0, 1))
    m = system_metrics(records, ddl_tolerance_s=0.01, bound=bound())
    assert m["throughput_sps"] == pytest.approx(12 / wall)
    b = bound()
    assert m["bound_fraction"] == pytest.approx((12 / wall) / b.throughput_sps)
    assert m["bound_fraction"] == pytest.approx(b.time_s / wall)  # same samples: a ratio of times


def test_per_rank_rows_sorted_with_breakdown_means():
    m = system_metrics(two_ranks(), ddl_tolerance_s=0.01, bound=bound())
    r0, r1 = m["per_rank"]
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["input_wait_mean_s"] == pytest.approx(0.040 / 3)
    assert r0["input_wait_p95_s"] == pytest.approx(np.percentile(WAITS[0], 95))
    assert r0["compute_mean_s"] == pytest.approx(0.10)
    assert r1["compute_mean_s"] == pytest.approx(0.11)
    assert r0["sync_wait_mean_s"] == 0.0
    assert r1["sync_wait_mean_s"] == pytest.approx(0.03)
    steps1 = [WAITS[1][s] + 0.11 + SYNCS[1][s] for s in range(3)]
    assert r1["step_time_p95_s"] == pytest.approx(np.percentile(steps1, 95))
    assert r0["samples"] == r1["samples"] == 6


def test_optional_inputs():
    m = system_metrics(two_ranks(ready=False), ddl_tolerance_s=0.01, bound=bound())
    assert math.isnan(m["batch_ready_p95_s"]) and math.isnan(m["scheduler_overhead_us_p99"])
    assert m["cpu_util"] is None and m["cross_ds_bytes"] == 0
    us = [float(x) for x in range(1, 201)]
    m = system_metrics(
        two_ranks(),
        ddl_tolerance_s=0.01,
        bound=bound(),
        cross_ds_bytes=np.int64(5_000_000),
        scheduler_overhead_us=us,
        cpu_util=0.75,
    )
    assert m["scheduler_overhead_us_p99"] == pytest.approx(np.percentile(us, 99))
    assert m["cpu_util"] == 0.75 and m["cross_ds_bytes"] == 5_000_000 and type(m["cross_ds_bytes"]) is int


def test_bound_cpu_limited():
    b = Bound(decode_s=8.0, gpu_s=3.0, cpu_slots=2, samples=40)
    assert (b.time_s, b.limited_by, b.throughput_sps) == (4.0, "cpu", 10.0)
    assert b.as_dict()["cpu_time_s"] == 4.0


def test_bound_gpu_limited():
    b = Bound(decode_s=8.0, gpu_s=5.0, cpu_slots=4, samples=40)
    assert (b.time_s, b.limited_by, b.throughput_sps) == (5.0, "gpu", 8.0)
    assert {"throughput_sps", "decode_s", "gpu_s", "limited_by", "time_s"} <= set(b.as_dict())


def test_balanced_gpu_s_by_hand():
    # step 0: (0.4 + 0.2 + 0.1 + 0.1) / 2 + 0.05 = 0.45; step 1: (1.0 + 0.2) / 2 + 0.05 = 0.65
    assert balanced_gpu_s([[0.4, 0.2, 0.1, 0.1], [1.0, 0.2]], ranks=2, overhead_s=0.05) == pytest.approx(1.10)
    assert balanced_gpu_s([], ranks=4, overhead_s=0.1) == 0.0
    with pytest.raises(ValueError, match="ranks"):
        balanced_gpu_s([[0.1]], ranks=0, overhead_s=0.0)
    with pytest.raises(ValueError, match="step 0 sample cost"):
        balanced_gpu_s([[-0.1]], ranks=1, overhead_s=0.0)


def test_validation_errors():
    with pytest.raises(ValueError, match="no records"):
        system_metrics([], ddl_tolerance_s=0.01, bound=bound())
    with pytest.raises(ValueError, match="input_wait_s"):
        rec(0, 0, -0.001)
    with pytest.raises(ValueError, match="sync_wait_s"):
        rec(0, 0, 0.0, sync=-1e-9)
    with pytest.raises(ValueError, match="batch_ready_s"):
        rec(0, 0, 0.0, ready=math.nan)
    with pytest.raises(ValueError, match="different step counts"):
        system_metrics(two_ranks()[:-1], ddl_tolerance_s=0.01, bound=bound(samples=10))
    with pytest.raises(ValueError, match="duplicate"):
        system_metrics(two_ranks() + [rec(0, 1, 0.0)], ddl_tolerance_s=0.01, bound=bound(samples=14))
    with pytest.raises(ValueError, match="samples"):
        system_metrics(two_ranks(), ddl_tolerance_s=0.01, bound=bound(samples=99))
    with pytest.raises(ValueError, match="cpu_util"):
        system_metrics(two_ranks(), ddl_tolerance_s=0.01, bound=bound(), cpu_util=1.5)
    with pytest.raises(ValueError, match="ddl_tolerance_s"):
        system_metrics(two_ranks(), ddl_tolerance_s=-1, bound=bound())
    with pytest.raises(ValueError, match="wall time is 0"):
        system_metrics([rec(0, 0, 0.0, compute=0.0)], ddl_tolerance_s=0.01, bound=bound(samples=2))
    with pytest.raises(ValueError, match="cpu_slots"):
        Bound(decode_s=1.0, gpu_s=1.0, cpu_slots=0, samples=1)
    with pytest.raises(ValueError, match="bound time is 0"):
        Bound(decode_s=0.0, gpu_s=0.0, cpu_slots=1, samples=1)
