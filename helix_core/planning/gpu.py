"""The GPU cost model of a sample: what the Tier-1 planner balances and the bench emulates.

Costs are in relative *GPU cost units* (one unit ~ the work of one visual token through a
linear layer stack); the bench turns units into seconds with a measured ``scale``. Attention makes
a sample's cost superlinear in its tokens, so a clip with 16x the tokens costs more than 16x.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helix_core.data.families import FAMILIES

__all__ = ["GPU_COSTS", "GpuCost", "gpu_cost"]


@dataclass(frozen=True)
class GpuCost:
    """GPU cost units of a sample: ``a * tokens + b * tokens**2``, plus ``c`` units per step.

    ``a``: units per token (linear layers); ``b``: units per token squared (attention);
    ``c``: units per step whatever the batch holds (optimizer, launch overheads).
    """

    a: float = 1.0
    b: float = 0.0
    c: float = 0.0

    def sample_units(self, tokens):
        """Cost units of each sample (vectorised: ``tokens`` a number or an array of counts)."""
        t = np.asarray(tokens, dtype=np.float64)
        return self.a * t + self.b * t * t

    def step_units(self, tokens) -> float:
        """Cost units of one rank's step over a batch with these token counts (sum + ``c``)."""
        return float(np.sum(self.sample_units(tokens)) + self.c)


#: relative costs per model family (from the one table, ``helix_core.data.families.FAMILIES``)
GPU_COSTS = {name: GpuCost(*family.gpu_cost) for name, family in FAMILIES.items()}


def gpu_cost(model: str) -> GpuCost:
    """The cost model of family ``model`` (``ValueError`` listing the valid names)."""
    try:
        return GPU_COSTS[model]
    except KeyError:
        raise ValueError(f"model={model!r}; valid: {', '.join(GPU_COSTS)}") from None
