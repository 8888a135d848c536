"""`helix bench`: the paper's evaluation (§5) on this machine, with emulated GPU windows.

For each configuration the harness synthesizes (or reuses) the workload, rounds warm-up and
measured steps to whole planning windows, measures the decode cost of the exact samples the
measured steps consume (the yardstick every system shares) and the machine's decode capacity,
calibrates the emulated GPU window for the regime, then runs each input system with R real rank
processes at the same CPU budget, checks that every system consumed the same samples, and
measures where each system's CPU went (``cpu_s_by_role``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from helix_bench.benchconfig import BenchConfig
from helix_bench.emulate import measure_decode, regime_window_scale
from helix_bench.ranks import RankPlan
from helix_bench.results import RAY_MODES, system_result
from helix_bench.systemrun import run_system
from helix_core.planning.gpu import GPU_COSTS, GpuCost

__all__ = ["run_bench", "run_one"]


#: capacity probes before the first system runs (their median calibrates the regime)
CALIBRATION_PROBES = 3


def bench_dataset(cfg: BenchConfig, progress):
    from helix_core.data.media.synth import make_dataset
    from helix_core.data.profiles import profile_dataset
    from helix_core.data.video import VideoClipDataset

    root = Path(cfg.data_dir) / f"{cfg.workload}-{cfg.clips}-s{cfg.scale:g}-seed{cfg.seed}"
    make_dataset(
        root, cfg.workload, cfg.clips, seed=cfg.seed, scale=cfg.scale, workers=os.cpu_count() or 1, progress=progress
    )
    if cfg.profiles and not (root / "profiles.jsonl").exists():
        profile_dataset(root / "manifest.jsonl", calibrate_per_bucket=1, progress=progress)
    return VideoClipDataset(root / "manifest.jsonl", model=cfg.model, profiles=None if cfg.profiles else False)


def steps_per_epoch(n: int, cfg: BenchConfig) -> int:
    """Global steps of one epoch: DistributedSampler's shard of one rank, in batches."""
    per_rank = -(-n // cfg.ranks)  # ceiling divisions
    return -(-per_rank // cfg.batch_size)


def expected_indices(n: int, cfg: BenchConfig, total_steps: int | None = None) -> list[list[list[int]]]:
    """``[rank][step] -> indices`` the sampler gives (DistributedSampler, epoch after epoch), for
    ``total_steps`` steps (default warm-up + measured)."""
    from helix_core.planning.sampling import rank_batches

    total = cfg.warmup + cfg.steps if total_steps is None else total_steps
    out = []
    for r in range(cfg.ranks):
        steps, epoch = [], 0
        while len(steps) < total:
            steps += rank_batches(n, cfg.batch_size, r, cfg.ranks, True, cfg.seed, epoch)
            epoch += 1
        out.append(steps[:total])
    return out


def measured_gpu_s(expected: list, tokens: dict, cost: GpuCost, scale: float) -> float:
    """The bound's GPU term: the token-balanced GPU seconds of the measured steps, ``expected``
    being ``[rank][step] -> indices``."""
    from helix_bench.metrics import balanced_gpu_s

    ranks, steps = len(expected), len(expected[0])
    per_step = [
        [scale * float(cost.sample_units(tokens[i])) for r in range(ranks) for i in expected[r][s]]
        for s in range(steps)
    ]
    return balanced_gpu_s(per_step, ranks, scale * cost.c)


def run_one(cfg: BenchConfig, console=None, live=None) -> dict:
    """Run every system of one configuration; return the results dict of ``report.write_report``."""
    import tempfile

    from helix_bench.metrics import Bound
    from helix_bench.samples import round_to_windows, window_spans
    from helix_bench.timed import CapacityProbe, TimedClipDataset

    say = console.print if console is not None else (lambda *a, **k: None)
    live = live or (lambda *a: None)
    ds = bench_dataset(cfg, progress=console is not None)
    spe = steps_per_epoch(len(ds), cfg)
    warmup, steps = round_to_windows(cfg.warmup, cfg.steps, spe, cfg.window)
    cfg = replace(cfg, warmup=warmup, steps=steps)
    plan_idx = expected_indices(len(ds), cfg)
    expected = [rank[warmup:] for rank in plan_idx]  # [rank][measured step]: the sampler's
    spans = window_spans(warmup, steps, spe, cfg.window)
    flat = [i for rank in expected for b in rank for i in b]
    say(
        f"[bold]{cfg.workload}[/] {cfg.model}: {warmup} warm-up + {steps} measured steps (whole windows of "
        f"{cfg.window}; {spe} steps an epoch); measuring the decode yardstick and capacity on their samples ..."
    )
    decode = measure_decode(ds, flat)
    cores = os.cpu_count() or 1
    slots = min(cfg.budget, cores)

    with contextlib.ExitStack() as stack:  # the probe's decoders and the decode logs, until the results are made
        prober = (
            stack.enter_context(CapacityProbe(ds.helix_spec(), sorted(decode), slots, decode)) if slots > 1 else None
        )

        def probe() -> float:  # decoders' worth of work the machine does at once, now
            return min(prober.measure(), float(slots)) if prober is not None else 1.0

        # The machine's speed drifts from minute to minute, and one probe set both the regime and the
        # bound: the regime is calibrated on the median of a few probes, the bound on the median of
        # those and one after each system (each run is judged against the machine's speed around it).
        probes = [probe() for _ in range(CALIBRATION_PROBES)]
        capacity = float(np.median(probes))
        tokens = {i: ds.estimate_cost(i).tokens for i in decode}
        cost = GPU_COSTS[cfg.model]
        if cfg.gpu_cost == "linear":  # the attention term off: native's ranks wait on each other less
            cost = GpuCost(a=cost.a, b=0.0, c=cost.c)
        scale = cfg.window_scale or regime_window_scale(
            cfg.regime, [decode[i] for i in flat], [tokens[i] for i in flat], cfg.batch_size, cfg.ranks, capacity, cost
        )
        plan = RankPlan(
            system="",
            ranks=cfg.ranks,
            port=0,
            dataset=ds.helix_spec(),
            batch_size=cfg.batch_size,
            warmup=warmup,
            steps=steps,
            window_scale=scale,
            cost=(cost.a, cost.b, cost.c),
            workers_per_rank=max(1, cfg.budget // cfg.ranks),
            prefetch=cfg.prefetch,
            seed=cfg.seed,
            compute=cfg.compute,
            device=cfg.device,
            window=cfg.window,
        )
        units = {i: float(cost.sample_units(t)) for i, t in tokens.items()}
        systems, ran = {}, {}
        logs = stack.enter_context(tempfile.TemporaryDirectory(prefix="helix-bench-"))
        for system in cfg.systems:
            if system in RAY_MODES:
                from helix_bench.raypool import ray_available

                why = ray_available()
                if why:
                    say(f"[yellow]{system} skipped:[/] {why}")
                    systems[system] = {"skipped": why}
                    continue
            spec = TimedClipDataset(
                ds.manifest_path,
                model=cfg.model,
                decode_log=Path(logs) / system,
                profiles=None if cfg.profiles else False,
                estimate_noise=cfg.estimate_noise,
                noise_seed=cfg.seed,
            ).helix_spec()
            ran[system] = run_system(system, cfg, replace(plan, system=system, dataset=spec), live)
            probes.append(probe())
        bound = Bound(
            decode_s=sum(decode[i] for i in flat),
            gpu_s=measured_gpu_s(expected, tokens, cost, scale),
            cpu_slots=slots,
            samples=len(flat),
            capacity=float(np.median(probes)),
        )
        for system, (got, m) in ran.items():
            systems[system] = system_result(
                system, cfg, got, m, expected, spans, bound, decode, units, Path(logs) / system
            )
        systems = {name: systems[name] for name in cfg.systems}  # the order asked for (skipped ones too)
    return {
        "workload": cfg.workload,
        "model": cfg.model,
        "regime": cfg.regime,
        "window_scale": scale,
        "gpu_cost": cfg.gpu_cost,
        "profiles": cfg.profiles,
        "prefetch": cfg.prefetch,
        "estimate_noise": cfg.estimate_noise,
        "ranks": cfg.ranks,
        "budget": cfg.budget,
        "batch_size": cfg.batch_size,
        "steps": steps,
        "warmup": warmup,
        "window": cfg.window,
        "steps_per_epoch": spe,
        "ddl_tolerance_s": cfg.ddl_tolerance_s,
        "remote_servers": cfg.remote_servers,
        "compute": cfg.compute,
        "cores": cores,
        "label": f"{cfg.workload} b{cfg.batch_size} rd{cfg.remote_servers} {cfg.regime}",
        "bound": {
            **bound.as_dict(),
            "decode_s_per_sample_mean": float(np.mean(list(decode.values()))),
            "capacity_probes": probes,
            "calibration_capacity": capacity,
        },
        "systems": systems,
    }


def run_bench(configs: list[BenchConfig], out_dir: str | os.PathLike, console=None) -> list[dict]:
    """Run ``configs`` in turn with a rich live view; write results.json, report.md and figures."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from helix_bench.report.write import print_table, write_report

    runs = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        tasks: dict = {}

        def live(system, rank, step):
            key = (len(runs), system)
            if key not in tasks:
                cfg = configs[len(runs)]
                tasks[key] = bar.add_task(
                    f"{cfg.workload} {cfg.regime} b{cfg.batch_size} rd{cfg.remote_servers} {system} (rank 0)",
                    total=cfg.warmup + cfg.steps,
                )
            if rank == 0:
                bar.update(tasks[key], completed=step)

        for cfg in configs:
            runs.append(run_one(cfg, console=bar.console, live=live))
    if any(c.remote_servers for c in configs) and (os.cpu_count() or 1) <= 2:
        for run in runs:
            run["note"] = (
                "on a 2-core machine extra sidecars add no CPU: this sweep measures their overhead, not added capacity"
            )
    paths = write_report(out_dir, runs)
    if console is not None:
        for run in runs:
            print_table(console, run)
        console.print(f"report: {paths['report.md']}  (results.json and figures beside it)")
    return runs
