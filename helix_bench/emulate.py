"""The emulated GPU and the yardsticks of a benchmark run (pure functions plus one measurement).

A rank's GPU window for a batch is ``scale * (sum over samples of a*tokens + b*tokens**2) + c``
per model family (``GpuCost`` in ``helix_core.planning.gpu``; attention makes long clips
superlinear). ``--regime`` picks ``scale`` from this machine's measured decode cost so that a
regime means the same on any machine: ``gpu-bound`` makes the average step's window ~2x the
pooled decode time of a step (deadlines can be met), ``cpu-bound`` ~0.7x (decode is the
bottleneck).
"""

from __future__ import annotations

import time

import numpy as np

from helix_core.planning.gpu import GPU_COSTS, GpuCost

__all__ = ["GPU_COSTS", "GpuCost", "REGIMES", "measure_decode", "regime_window_scale", "window_scale"]

#: window factor over the pooled decode time of a step
REGIMES = {"gpu-bound": 2.0, "cpu-bound": 0.7}


def regime_window_scale(
    regime: str, decode_s: list[float], tokens: list[int], batch_size: int, ranks: int, cpu_slots: float, cost: GpuCost
) -> float:
    """Seconds per cost unit so that the mean step window = factor x pooled decode time per step.

    ``decode_s`` / ``tokens``: measured CPU seconds and tokens of the workload's samples. The pooled
    decode time of a step is ``ranks * batch_size * mean(decode_s) / cpu_slots`` (``cpu_slots``: the
    decoders' worth of work the machine does at once, the measured decode capacity); the mean window
    is ``scale * (batch_size * mean(sample units) + c)``.
    """
    if regime not in REGIMES:
        raise ValueError(f"regime={regime!r}; valid: {', '.join(REGIMES)}")
    return window_scale(REGIMES[regime], decode_s, tokens, batch_size, ranks, cpu_slots, cost)


def window_scale(
    factor: float,
    decode_s: list[float],
    tokens: list[int],
    batch_size: int,
    ranks: int,
    cpu_slots: float,
    cost: GpuCost,
) -> float:
    """Seconds per cost unit so that the mean step window = ``factor`` x the pooled decode time of
    a step on ``cpu_slots`` decoders (``regime_window_scale`` with the factor given)."""
    if not decode_s or len(decode_s) != len(tokens) or not cpu_slots > 0:
        raise ValueError("regime calibration needs one measured decode time per sample and cpu_slots > 0")
    pooled = ranks * batch_size * float(np.mean(decode_s)) / cpu_slots
    units = batch_size * float(np.mean(cost.sample_units(tokens))) + cost.c
    return factor * pooled / units


def measure_decode(dataset, indices, progress=None, repeats: int = 2) -> dict[int, float]:
    """CPU seconds of ``dataset[i]`` for each distinct ``i`` (one core, this thread): the run's
    decode yardstick, measured once per run and shared by every system. One decode first pays the
    process's one-off codec set-up; each sample's figure is the least of ``repeats`` decodes (the
    machine is shared: noise only ever adds time)."""
    distinct = sorted(set(int(i) for i in indices))
    if distinct:
        dataset[distinct[0]]  # warm-up: not the first sample's cost
    out = {}
    for i in distinct:
        best = float("inf")
        for _ in range(max(1, repeats)):
            c0 = time.thread_time()
            dataset[i]
            best = min(best, time.thread_time() - c0)
        out[i] = best
        if progress is not None:
            progress()
    return out
