"""`helix planner`: how evenly the Tier-1 planner spreads predicted GPU cost, and what it costs.

For each workload x model family it replays ``epochs`` epochs of the bench's sampler order (a
shuffled ``DistributedSampler`` per rank, ``set_epoch(e)``, batches of ``batch_size``) and reports
the imbalance ratio — sum over steps of the slowest rank's predicted GPU cost / sum of the mean
rank's — of the sampler's own steps ("none") and of the planner's at each window. Costs come from
the profile table (tokens per sample, no decoding), so the run takes seconds once the workload
exists. Every plan is checked: same shape, same samples per window.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from helix_core.planning.balance import fill_unknown_costs, imbalance_ratio
from helix_core.planning.batching import TokenPlanner
from helix_core.planning.gpu import gpu_cost

__all__ = ["PlannerResult", "measure_planner", "run_planner_bench", "sample_costs", "sampler_steps"]


@dataclass(frozen=True)
class PlannerResult:
    """One workload x model. Ratios >= 1 (1.0: every step's ranks equal); times in microseconds
    of wall clock per planned window (median over the run); ``windows_planned`` per window size."""

    workload: str
    model: str
    samples: int
    steps: int  # global steps replayed (all epochs)
    unbalanced: float
    ratios: dict[int, float]
    median_us: dict[int, float]
    windows_planned: dict[int, int]


def sampler_steps(
    n: int, ranks: int, batch_size: int, seed: int, epoch: int, shuffle: bool = True
) -> list[list[list[int]]]:
    """``steps[s][r]``: rank r's batch at global step s, exactly as the bench's ranks draw them
    (``helix_core.planning.sampling``: the loader's own order)."""
    from helix_core.planning.sampling import steps

    return steps(n, batch_size, ranks, shuffle, seed, epoch)


def sample_costs(manifest: str | os.PathLike, model: str) -> np.ndarray:
    """Every sample's predicted GPU cost (units of ``gpu_cost(model)``) from the profile table;
    a clip that failed to probe gets its profile bucket's median (``fill_unknown_costs``)."""
    from helix_core.data.video import VideoClipDataset

    table = VideoClipDataset(manifest, model=model).cost_arrays()
    if table is None:
        raise FileNotFoundError(f"no profile table beside {manifest} (make it with `helix profile`)")
    units = gpu_cost(model).sample_units(table["tokens"])
    ok = np.asarray(table.get("ok", np.ones(len(units), bool)), bool)
    buckets = list(zip(*(np.asarray(table[k]).tolist() for k in ("t", "h", "w"))))  # the profile: t x h x w
    return fill_unknown_costs(np.where(ok, units, np.nan), buckets)


def measure_planner(
    manifest: str | os.PathLike,
    model: str,
    windows: Sequence[int],
    ranks: int,
    batch_size: int,
    epochs: int,
    seed: int = 0,
    workload: str = "",
    clock: Callable[[], float] = time.perf_counter,
) -> PlannerResult:
    """Replay ``epochs`` epochs of the sampler on ``manifest``'s samples, unplanned and planned at
    each window size; ``clock`` (seconds) times each ``plan_window`` call."""
    if epochs < 1 or ranks < 1 or batch_size < 1 or not windows:
        raise ValueError("epochs, ranks and batch_size must be >= 1 and windows non-empty")
    costs = sample_costs(manifest, model)
    epoch_steps = [sampler_steps(len(costs), ranks, batch_size, seed, e) for e in range(epochs)]
    unplanned = [s for steps in epoch_steps for s in steps]
    ratios, median_us, planned = {}, {}, {}
    for w in windows:
        planner = TokenPlanner(ranks, int(w))
        plan, times = [], []
        for steps in epoch_steps:
            for span in planner.windows(len(steps)):
                window = steps[span.start : span.stop]
                t0 = clock()
                out = planner.plan_window(window, costs)
                times.append(clock() - t0)
                if _shape_and_samples(out) != _shape_and_samples(window):
                    raise RuntimeError(f"planner broke steps {span} (window={w}): not the sampler's samples and shape")
                plan += out
        ratios[int(w)] = imbalance_ratio(plan, costs)
        median_us[int(w)] = float(np.median(times)) * 1e6
        planned[int(w)] = len(times)
    return PlannerResult(
        workload, model, len(costs), len(unplanned), imbalance_ratio(unplanned, costs), ratios, median_us, planned
    )


def _shape_and_samples(steps) -> tuple[list, Counter]:
    return [[len(b) for b in s] for s in steps], Counter(i for s in steps for b in s for i in b)


def _dataset(workload: str, clips: int, seed: int, data_dir: Path) -> Path:
    """The workload's manifest, synthesized and profiled once (the folder `helix bench` uses)."""
    from helix_core.data.media.synth import make_dataset
    from helix_core.data.profiles import profile_dataset

    scale = 1.0  # full-size clips: tokens, hence costs, depend on the real geometry
    root = make_dataset(
        data_dir / f"{workload}-{clips}-s{scale:g}-seed{seed}",
        workload,
        clips,
        seed=seed,
        scale=scale,
        workers=os.cpu_count() or 1,
        progress=True,
    )
    if not (root / "profiles.jsonl").exists():
        profile_dataset(root / "manifest.jsonl", calibrate_per_bucket=1, progress=True)
    return root / "manifest.jsonl"


def run_planner_bench(
    workloads: Sequence[str],
    models: Sequence[str],
    windows: Sequence[int],
    ranks: int = 4,
    batch_size: int = 2,
    clips: int = 48,
    epochs: int = 20,
    seed: int = 0,
    data_dir: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    console=None,
) -> list[PlannerResult]:
    """Every workload x model: print a table and, with ``out``, write the results as JSON."""
    from helix_core.data.media.synth import WORKLOADS

    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise ValueError(f"workloads {bad}; valid: {', '.join(WORKLOADS)}")
    for m in models:
        gpu_cost(m)  # a bad name fails before any synthesis
    data = Path(data_dir) if data_dir else Path.home() / ".cache" / "helix" / "bench-data"
    results = [
        measure_planner(_dataset(wl, clips, seed, data), m, windows, ranks, batch_size, epochs, seed, wl)
        for wl in workloads
        for m in models
    ]
    if console is not None:
        console.print(_table(results, windows, ranks, batch_size, epochs))
    if out:
        config = {
            "workloads": list(workloads),
            "models": list(models),
            "windows": [int(w) for w in windows],
            "ranks": ranks,
            "batch_size": batch_size,
            "clips": clips,
            "epochs": epochs,
            "seed": seed,
        }
        Path(out).write_text(json.dumps({"config": config, "results": [asdict(r) for r in results]}, indent=2))
    return results


def _table(results: list[PlannerResult], windows: Sequence[int], ranks: int, batch_size: int, epochs: int):
    from rich.console import Group
    from rich.table import Table

    ratios = Table(
        title=f"Tier-1 planner, {ranks} ranks x batch {batch_size}, {epochs} epochs: sum over steps of "
        "the slowest rank's GPU cost / sum of the mean rank's (none: the sampler's steps; "
        "wN: planned N steps at a time)"
    )
    times = Table(title="median planner time per window, µs")
    for t, first in ((ratios, ("none",)), (times, ())):
        t.add_column("workload", no_wrap=True)
        t.add_column("model", no_wrap=True)
        for col in (*first, *(f"w{w}" for w in windows)):
            t.add_column(col, justify="right", no_wrap=True)
    for r in results:
        ratios.add_row(r.workload, r.model, f"{r.unbalanced:.3f}", *(f"{r.ratios[int(w)]:.3f}" for w in windows))
        times.add_row(r.workload, r.model, *(f"{r.median_us[int(w)]:.0f}" for w in windows))
    return Group(ratios, times)
