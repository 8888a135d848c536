"""What a Tier-1 plan is made from and how good it is (pure): ``fill_unknown_costs`` (a cost for
every sample, the same on every rank) and ``imbalance_ratio`` (how much longer the plan's steps
take than perfectly balanced ones)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

from helix_core.planning.batching import Costs, Plan

__all__ = ["fill_unknown_costs", "imbalance_ratio"]


def _cost_of(costs: Costs) -> Callable[[int], float]:
    if callable(costs):
        return lambda i: float(costs(int(i)))
    arr = np.asarray(costs, dtype=np.float64)
    return lambda i: float(arr[int(i)])


def imbalance_ratio(plan: Plan, costs: Costs) -> float:
    """Sum over steps of the slowest rank's cost / sum over steps of the mean rank's cost.

    1.0 means every step's ranks are equal (no rank waits at the gradient all-reduce); 1.5 means
    the steps take 1.5x the time of perfectly balanced ones. 1.0 for an empty plan or zero costs.
    """
    cost = _cost_of(costs)
    slowest = mean = 0.0
    for step in plan:
        loads = [sum(cost(i) for i in batch) for batch in step]
        if loads:
            slowest += max(loads)
            mean += sum(loads) / len(loads)
    return slowest / mean if mean > 0 else 1.0


def fill_unknown_costs(costs: Sequence[float | None], buckets: Sequence[Hashable]) -> np.ndarray:
    """Costs with each unknown one (None or NaN: a file that could not be probed) replaced by the
    median known cost of its profile bucket, else the median of all known costs, else 1.0.

    ``buckets[i]`` is sample ``i``'s profile (e.g. ``(frames, height, width)``; rows of an array
    become tuples). A pure function of its inputs: every rank fills the same values.
    """
    c = np.asarray([np.nan if v is None else float(v) for v in costs], dtype=np.float64)
    keys = [tuple(np.asarray(b).tolist()) if np.ndim(b) else b for b in buckets]  # type: ignore[arg-type]
    if len(keys) != len(c):
        raise ValueError(f"buckets has {len(keys)} entries for {len(c)} costs")
    known = ~np.isnan(c)
    if known.all():
        return c
    fallback = float(np.median(c[known])) if known.any() else 1.0
    by_bucket: dict = {}
    for i in np.flatnonzero(known):
        by_bucket.setdefault(keys[i], []).append(c[i])
    medians = {k: float(np.median(v)) for k, v in by_bucket.items()}
    out = c.copy()
    for i in np.flatnonzero(~known):
        out[i] = medians.get(keys[i], fallback)
    return out
