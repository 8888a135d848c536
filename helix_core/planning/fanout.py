"""Automatic fan-out: a batch whose predicted CPU time exceeds its deadline is split into parts of
about equal cost, so several workers prepare it at once (pure code: lists in, lists out)."""

from __future__ import annotations

import math

from helix_core.data.descriptors import CostProfile

__all__ = ["fan_out", "sum_costs"]


def fan_out(indices: list[int], costs: list, deadline_s: float) -> list[list[int]]:
    """Contiguous parts of ``indices`` (at most one per sample) of about equal predicted CPU
    seconds, as many as the deadline needs; one part when it fits, or when a cost is unknown."""
    if len(indices) < 2 or any(c is None for c in costs):
        return [indices]
    total = sum(c.cpu_s for c in costs)
    if total <= deadline_s or total <= 0:
        return [indices]
    k = min(len(indices), max(2, math.ceil(total / max(deadline_s, 1e-3))))
    parts: list[list[int]] = []
    current: list[int] = []
    acc = 0.0
    for i, c in zip(indices, costs):
        current.append(i)
        acc += c.cpu_s
        if acc >= total * (len(parts) + 1) / k and len(parts) < k - 1:
            parts.append(current)
            current = []
    if current:
        parts.append(current)
    return parts


def sum_costs(costs: list) -> CostProfile | None:
    """The summed ``CostProfile`` of a part's samples (None if none is known)."""
    known = [c for c in costs if c is not None]
    if not known:
        return None
    return CostProfile(
        sum(c.cpu_s for c in known),
        sum(c.io_bytes for c in known),
        sum(c.out_bytes for c in known),
        sum(c.tokens for c in known),
        known[0].profile,
    )
