"""Telemetry helpers: percentiles and the loader's running counters (constant memory)."""

from __future__ import annotations

import collections
import math

__all__ = ["CostErrors", "LoaderStats", "percentile"]


def percentile(values, q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0..100) of ``values``; NaN when empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] if lo == hi else xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class CostErrors:
    """Relative errors of CPU-cost predictions, |predicted - measured| / measured, at the start and
    the end of a run: the first and the last ``k`` decoded samples, ``k = min(n, count // 4)``
    (so a short run compares its first and last quarters): whether online feedback helped."""

    def __init__(self, n: int = 64):
        self.n = n
        self.first: list[float] = []
        self.last: collections.deque = collections.deque(maxlen=n)
        self.count = 0

    def add(self, predicted_s: float, measured_s: float) -> None:
        if not (measured_s > 0 and predicted_s >= 0):
            return
        err = abs(predicted_s - measured_s) / measured_s
        if len(self.first) < self.n:
            self.first.append(err)
        self.last.append(err)
        self.count += 1

    def as_dict(self) -> dict:
        k = max(1, min(self.n, self.count // 4))
        return {
            "cost_error_start": percentile(self.first[:k], 50),
            "cost_error_end": percentile(list(self.last)[-k:], 50),
            "cost_samples": self.count,
        }


class LoaderStats:
    """Per-loader counters. Times in seconds; a DDL miss is a batch whose input wait exceeded
    ``ddl_tolerance_s``. Keeps the last ``window`` samples of each timing."""

    def __init__(self, ddl_tolerance_s: float = 0.010, window: int = 10_000):
        self.ddl_tolerance_s = ddl_tolerance_s
        self.input_wait = collections.deque(maxlen=window)
        self.batch_ready = collections.deque(maxlen=window)
        self.wakeup = collections.deque(maxlen=window)  # reply landed -> next() returned, while the rank waited
        self.decision_us = collections.deque(maxlen=window)
        self.route_us = collections.deque(maxlen=window)  # Route round trips as the client sees them
        self.deadlines = collections.deque(maxlen=window)  # deadline_s sent with each request
        self.reasons: collections.Counter = collections.Counter()  # placement decisions by reason
        self.cost_errors = CostErrors()
        self.batches = self.skipped = self.resubmits = self.cross_ds_bytes = self.fanouts = 0
        self.stolen = 0  # batch pieces idle workers took over (a server split the batch among its workers)
        self.rebalance: collections.Counter = collections.Counter()  # Tier-2 rounds by outcome, samples moved
        self.rebalance_errors = collections.deque(maxlen=20)  # the last rounds that failed, and why
        self.rebalance_rounds = collections.deque(maxlen=1024)  # the last rounds, one dict each (client.tier2)

    def as_dict(self) -> dict:
        waits = list(self.input_wait)
        misses = sum(w > self.ddl_tolerance_s for w in waits)
        return {
            "batches": self.batches,
            "input_wait_p50_s": percentile(waits, 50),
            "input_wait_p95_s": percentile(waits, 95),
            "input_wait_last_s": waits[-1] if waits else math.nan,
            "batch_ready_p50_s": percentile(self.batch_ready, 50),
            "batch_ready_p95_s": percentile(self.batch_ready, 95),
            "wakeup_p50_s": percentile(self.wakeup, 50),
            "wakeup_p99_s": percentile(self.wakeup, 99),
            "ddl_miss_rate": misses / len(waits) if waits else math.nan,
            "ddl_tolerance_s": self.ddl_tolerance_s,
            "skipped": self.skipped,
            "resubmits": self.resubmits,
            "cross_ds_bytes": self.cross_ds_bytes,
            "scheduler_overhead_us_p50": percentile(self.decision_us, 50),
            "scheduler_overhead_us_p99": percentile(self.decision_us, 99),
            "route_us_p50": percentile(self.route_us, 50),
            "route_us_p99": percentile(self.route_us, 99),
            "deadline_p50_s": percentile(self.deadlines, 50),
            "fanouts": self.fanouts,
            "stolen": self.stolen,
            "placement_reasons": dict(self.reasons),
            **self.cost_errors.as_dict(),
            "rebalance": dict(self.rebalance),
            "rebalance_errors": list(self.rebalance_errors),
            "rebalance_rounds": list(self.rebalance_rounds),
        }
