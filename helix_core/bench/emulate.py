"""The emulated GPU and the yardsticks of a benchmark run (pure functions plus one measurement).

A rank's GPU window for a batch is ``scale * (sum over samples of a*tokens + b*tokens**2) + c``
per model family (attention makes long clips superlinear). ``--regime`` picks ``scale`` from this
machine's measured decode cost so that a regime means the same on any machine: ``gpu-bound`` makes
the average step's window ~2x the pooled decode time of a step (deadlines can be met),
``cpu-bound`` ~0.7x (decode is the bottleneck).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

__all__ = ["MODEL_COSTS", "ModelCost", "REGIMES", "measure_decode", "regime_window_scale"]

#: window factor over the pooled decode time of a step
REGIMES = {"gpu-bound": 2.0, "cpu-bound": 0.7}


@dataclass(frozen=True)
class ModelCost:
    """GPU cost units of a sample: ``a * tokens + b * tokens**2``, plus ``c`` units per step."""

    a: float = 1.0
    b: float = 0.0
    c: float = 0.0

    def sample_units(self, tokens):
        t = np.asarray(tokens, dtype=np.float64)
        return self.a * t + self.b * t * t

    def step_units(self, tokens) -> float:
        return float(np.sum(self.sample_units(tokens)) + self.c)


#: relative costs per family: attention over ~25k tokens doubles a VideoMAE-L step's cost
MODEL_COSTS = {
    "videomae": ModelCost(a=1.0, b=1.0 / 25_000, c=500.0),
    "qwen2-vl": ModelCost(a=1.0, b=1.0 / 16_000, c=800.0),
    "qwen2.5-vl": ModelCost(a=1.0, b=1.0 / 16_000, c=800.0),
    "wan": ModelCost(a=1.0, b=1.0 / 32_000, c=1000.0),
}


def regime_window_scale(regime: str, decode_s: list[float], tokens: list[int], batch_size: int, ranks: int,
                        cpu_slots: int, cost: ModelCost) -> float:
    """Seconds per cost unit so that the mean step window = factor x pooled decode time per step.

    ``decode_s`` / ``tokens``: measured CPU seconds and tokens of the workload's samples. The pooled
    decode time of a step is ``ranks * batch_size * mean(decode_s) / cpu_slots``; the mean window
    is ``scale * (batch_size * mean(sample units) + c)``.
    """
    if regime not in REGIMES:
        raise ValueError(f"regime={regime!r}; valid: {', '.join(REGIMES)}")
    if not decode_s or len(decode_s) != len(tokens) or cpu_slots < 1:
        raise ValueError("regime calibration needs one measured decode time per sample and cpu_slots >= 1")
    pooled = ranks * batch_size * float(np.mean(decode_s)) / cpu_slots
    units = batch_size * float(np.mean(cost.sample_units(tokens))) + cost.c
    return REGIMES[regime] * pooled / units


def measure_decode(dataset, indices, progress=None) -> dict[int, float]:
    """CPU seconds of ``dataset[i]`` for each distinct ``i`` (one core, this thread): the run's
    decode yardstick, measured once and shared by every system."""
    out = {}
    for i in sorted(set(int(i) for i in indices)):
        c0 = time.thread_time()
        dataset[i]
        out[i] = time.thread_time() - c0
        if progress is not None:
            progress()
    return out
