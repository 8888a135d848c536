"""What the client predicts about a sample before it is decoded: GPU cost units (for Tier-1
planning and deadlines) from the dataset's tokens and the model family's cost, identical on every
rank because they come from offline profiles only (the online CPU-cost corrections stay out)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from helix_core.data.contract import CostArrays, Costed
from helix_core.planning.gpu import GPU_COSTS, GpuCost
from helix_core.planning.gpu import gpu_cost as family_cost

__all__ = ["PlanCosts", "gpu_units"]


def gpu_units(dataset, gpu_cost=None) -> tuple[Callable[[np.ndarray], np.ndarray], float]:
    """``(units(tokens) -> array, units per step)`` for ``gpu_cost``: None (the dataset's model
    family — ``dataset.spec.model`` — else tokens, linearly), a family name, a ``GpuCost``, or a
    callable mapping an array of token counts to cost units."""
    if gpu_cost is None:
        model = getattr(getattr(dataset, "spec", None), "model", None)
        gpu_cost = GPU_COSTS.get(model, GpuCost())
    elif isinstance(gpu_cost, str):
        gpu_cost = family_cost(gpu_cost)
    if isinstance(gpu_cost, GpuCost):
        return gpu_cost.sample_units, gpu_cost.c
    if callable(gpu_cost):
        return (lambda tokens: np.asarray(gpu_cost(np.asarray(tokens)), dtype=np.float64)), 0.0
    raise ValueError(
        f"gpu_cost={gpu_cost!r}; valid: None, a model family ({', '.join(GPU_COSTS)}), "
        "a helix_core GpuCost, or a callable of a token-count array"
    )


class PlanCosts:
    """``costs(indices) -> (units, buckets)`` for ``PlannedBatches``: each sample's GPU cost units
    (NaN where its cost cannot be estimated, e.g. a broken file) and its profile bucket.

    With a profile table (``dataset.cost_arrays()``) everything is vectorised once; otherwise each
    sample is costed once through ``dataset.estimate_cost`` (a metadata probe) and cached."""

    def __init__(self, dataset, units: Callable[[np.ndarray], np.ndarray]):
        if not isinstance(dataset, Costed):
            raise ValueError(
                f'balance="tokens" needs a dataset with estimate_cost(index) -> CostProfile '
                f"(its tokens); {type(dataset).__name__} has none"
            )
        self.dataset, self.units_fn = dataset, units
        arrays = dataset.cost_arrays() if isinstance(dataset, CostArrays) else None
        self._units = self._buckets = None
        if arrays is not None:
            self._units = np.where(arrays["ok"], units(arrays["tokens"]), np.nan)
            self._buckets = np.asarray(arrays["bucket"], dtype=object)
        self._cache: dict[int, tuple[float, str]] = {}

    def _one(self, i: int) -> tuple[float, str]:
        got = self._cache.get(i)
        if got is None:
            try:
                c = self.dataset.estimate_cost(i)
                got = (float(self.units_fn(np.asarray([c.tokens]))[0]), str(c.profile))
            except Exception:  # planned at the median; it fails (or is skipped) when fetched
                got = (float("nan"), "")
            self._cache[i] = got
        return got

    def __call__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        if self._units is not None:
            return self._units[idx], self._buckets[idx]
        pairs = [self._one(int(i)) for i in idx]
        return (np.array([p[0] for p in pairs], dtype=np.float64), np.array([p[1] for p in pairs], dtype=object))
