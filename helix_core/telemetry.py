"""Telemetry helpers: percentiles and the loader's running counters (constant memory)."""
from __future__ import annotations

import collections
import math

__all__ = ["LoaderStats", "percentile"]


def percentile(values, q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0..100) of ``values``; NaN when empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] if lo == hi else xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class LoaderStats:
    """Per-loader counters. Times in seconds; a DDL miss is a batch whose input wait exceeded
    ``ddl_tolerance_s``. Keeps the last ``window`` samples of each timing."""

    def __init__(self, ddl_tolerance_s: float = 0.010, window: int = 10_000):
        self.ddl_tolerance_s = ddl_tolerance_s
        self.input_wait = collections.deque(maxlen=window)
        self.batch_ready = collections.deque(maxlen=window)
        self.decision_us = collections.deque(maxlen=window)
        self.batches = self.skipped = self.resubmits = self.cross_ds_bytes = 0

    def as_dict(self) -> dict:
        waits = list(self.input_wait)
        misses = sum(w > self.ddl_tolerance_s for w in waits)
        return {
            "batches": self.batches,
            "input_wait_p50_s": percentile(waits, 50), "input_wait_p95_s": percentile(waits, 95),
            "batch_ready_p50_s": percentile(self.batch_ready, 50), "batch_ready_p95_s": percentile(self.batch_ready, 95),
            "ddl_miss_rate": misses / len(waits) if waits else math.nan, "ddl_tolerance_s": self.ddl_tolerance_s,
            "skipped": self.skipped, "resubmits": self.resubmits,
            "cross_ds_bytes": self.cross_ds_bytes,
            "scheduler_overhead_us_p50": percentile(self.decision_us, 50),
            "scheduler_overhead_us_p99": percentile(self.decision_us, 99),
        }
