"""`helix bench`'s configuration: :class:`BenchConfig` (one configuration, validated) and the
input :data:`SYSTEMS` it may compare."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from helix_bench.emulate import REGIMES
from helix_bench.ranks import HELIX_VARIANTS
from helix_core.planning.gpu import GPU_COSTS

__all__ = ["BenchConfig", "SYSTEMS"]

SYSTEMS = ("native", "ray", "ray-rr", *HELIX_VARIANTS)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration. Seconds; ``budget`` = worker processes in all."""

    workload: str = "kinetics-mixed"
    model: str = "videomae"
    ranks: int = 4
    batch_size: int = 2
    budget: int = 4
    systems: tuple[str, ...] = ("native", "ray", "helix")
    warmup: int = 20
    steps: int = 100
    regime: str = "gpu-bound"
    window_scale: float | None = None  # seconds per cost unit; None: from the regime
    remote_servers: int = 0
    prefetch: int = 4
    clips: int = 48
    scale: float = 1.0
    seed: int = 0
    ddl_tolerance_s: float = 0.010
    window: int = 8  # Tier-1 planning window (global steps) of the balanced systems
    compute: str = "emulate"  # or "model": a real tiny model's forward and backward (GPU machines)
    device: str = "cpu"
    gpu_cost: str = "family"  # the emulated GPU cost: the model family's (superlinear) or "linear" (tokens only)
    profiles: bool = True  # False: no profile table (costs from probing each clip, as a new user's data)
    estimate_noise: float = 0.0  # > 0: the costs the loaders plan with are off by a seeded log-normal factor
    data_dir: str = str(Path.home() / ".cache" / "helix" / "bench-data")

    def __post_init__(self):
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad:
            raise ValueError(f"systems {bad}; valid: {', '.join(SYSTEMS)}")
        if self.regime not in REGIMES:
            raise ValueError(f"regime={self.regime!r}; valid: {', '.join(REGIMES)}")
        if self.compute not in ("emulate", "model"):
            raise ValueError(f"compute={self.compute!r}; valid: emulate, model")
        if not (0.0 <= self.estimate_noise < 10.0):
            raise ValueError(f"estimate_noise={self.estimate_noise!r}: a log-normal sigma in [0, 10)")
        if self.gpu_cost not in ("family", "linear"):
            raise ValueError(f"gpu_cost={self.gpu_cost!r}; valid: family, linear")
        if self.model not in GPU_COSTS:
            raise ValueError(f"model={self.model!r}; valid: {', '.join(GPU_COSTS)}")
        if (
            min(self.ranks, self.batch_size, self.budget, self.steps, self.prefetch, self.clips, self.window) < 1
            or self.warmup < 0
        ):
            raise ValueError("ranks, batch_size, budget, steps, prefetch, clips and window must be >= 1, warmup >= 0")
        if self.budget < self.ranks + self.remote_servers and "helix" in "".join(self.systems):
            raise ValueError(
                f"budget {self.budget} is too small for {self.ranks} local + {self.remote_servers} "
                "sidecars (each needs at least one worker)"
            )
