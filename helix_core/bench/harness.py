"""`helix bench`: the paper's evaluation (§5) on this machine, with emulated GPU windows.

For each configuration the harness synthesizes (or reuses) the workload, measures the decode cost
of the exact samples the run will consume (the yardstick every system shares), calibrates the
emulated GPU window for the regime, then runs each input system with R real rank processes at the
same CPU budget and checks that every system consumed the same samples.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .emulate import MODEL_COSTS, REGIMES, measure_decode, regime_window_scale
from .ranks import HELIX_VARIANTS, RankPlan, rank_main

__all__ = ["BenchConfig", "SYSTEMS", "run_bench", "run_one"]

SYSTEMS = ("native", "ray", *HELIX_VARIANTS)


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
    compute: str = "emulate"  # or "model": a real tiny model's forward and backward (GPU machines)
    device: str = "cpu"
    data_dir: str = str(Path.home() / ".cache" / "helix" / "bench-data")

    def __post_init__(self):
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad:
            raise ValueError(f"systems {bad}; valid: {', '.join(SYSTEMS)}")
        if self.regime not in REGIMES:
            raise ValueError(f"regime={self.regime!r}; valid: {', '.join(REGIMES)}")
        if self.compute not in ("emulate", "model"):
            raise ValueError(f"compute={self.compute!r}; valid: emulate, model")
        if self.model not in MODEL_COSTS:
            raise ValueError(f"model={self.model!r}; valid: {', '.join(MODEL_COSTS)}")
        if min(self.ranks, self.batch_size, self.budget, self.steps, self.prefetch, self.clips) < 1 or self.warmup < 0:
            raise ValueError("ranks, batch_size, budget, steps, prefetch and clips must be >= 1, warmup >= 0")
        if self.budget < self.ranks + self.remote_servers and "helix" in "".join(self.systems):
            raise ValueError(f"budget {self.budget} is too small for {self.ranks} local + {self.remote_servers} "
                             "remote DataServers (each needs at least one worker)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dataset(cfg: BenchConfig, progress):
    from ..datasets import VideoClipDataset
    from ..media.synth import make_dataset
    from ..profiles import profile_dataset

    root = Path(cfg.data_dir) / f"{cfg.workload}-{cfg.clips}-s{cfg.scale:g}-seed{cfg.seed}"
    make_dataset(root, cfg.workload, cfg.clips, seed=cfg.seed, scale=cfg.scale, workers=os.cpu_count() or 1,
                 progress=progress)
    if not (root / "profiles.jsonl").exists():
        profile_dataset(root / "manifest.jsonl", calibrate_per_bucket=1, progress=progress)
    return VideoClipDataset(root / "manifest.jsonl", model=cfg.model)


def expected_indices(n: int, cfg: BenchConfig) -> list[list[list[int]]]:
    """``[rank][step] -> indices`` every system must consume (DistributedSampler, epoch after epoch)."""
    import torch

    out = []
    for r in range(cfg.ranks):
        sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=cfg.ranks, rank=r, shuffle=True,
                                                      seed=cfg.seed)
        steps, epoch = [], 0
        while len(steps) < cfg.warmup + cfg.steps:
            sampler.set_epoch(epoch)
            idx = list(sampler)
            steps += [idx[i:i + cfg.batch_size] for i in range(0, len(idx), cfg.batch_size)]
            epoch += 1
        out.append(steps[: cfg.warmup + cfg.steps])
    return out


def _run_system(system: str, cfg: BenchConfig, plan: RankPlan, live) -> tuple[list, list]:
    """Start the system's shared parts, run the rank processes, return (results, cpu_times)."""
    import psutil

    from ..runtime.cluster import LocalCluster

    ctx = mp.get_context("spawn")
    results, progress = ctx.Queue(), ctx.Queue()
    cluster = pool = None
    procs = []
    try:
        if system.startswith("helix"):
            servers = cfg.ranks + cfg.remote_servers
            cluster = LocalCluster(local_servers=cfg.ranks, remote_servers=cfg.remote_servers,
                                   workers_per_server=max(1, cfg.budget // servers))
            plan = replace(plan, coordinator=cluster.address)
        elif system == "ray":
            from .raypool import RayPool

            pool = RayPool(cfg.budget, plan.dataset)
            plan = replace(plan, ray=pool.info())
        procs = [ctx.Process(target=rank_main, args=(r, plan, results, progress), daemon=False)
                 for r in range(cfg.ranks)]
        for p in procs:
            p.start()
        got, cpu = [], [None, None]
        deadline = time.monotonic() + 3600
        while len(got) < cfg.ranks and time.monotonic() < deadline:
            try:
                while True:
                    _, rank, step = progress.get_nowait()
                    live(system, rank, step)
                    if rank == 0 and step == cfg.warmup:
                        cpu[0] = psutil.cpu_times()
            except queue.Empty:
                pass
            try:
                got.append(results.get(timeout=0.2))
                if len(got) == 1:
                    cpu[1] = psutil.cpu_times()
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
        errors = [g for g in got if g[0] == "error"]
        if errors or len(got) < cfg.ranks:
            detail = errors[0][2] if errors else "a rank process exited without a result"
            raise RuntimeError(f"{system}: {detail}")
        return got, cpu
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if cluster is not None:
            cluster.close()
        if pool is not None:
            pool.close()


def _cpu_util(cpu) -> float | None:
    a, b = cpu
    if a is None or b is None:
        return None
    total = sum(b) - sum(a)
    idle = (b.idle + getattr(b, "iowait", 0)) - (a.idle + getattr(a, "iowait", 0))
    return max(0.0, min(1.0, 1 - idle / total)) if total > 0 else None


def run_one(cfg: BenchConfig, console=None, live=None) -> dict:
    """Run every system of one configuration; return the results dict of ``report.write_report``."""
    from .metrics import Bound, StepRecord, balanced_gpu_s, system_metrics

    say = console.print if console is not None else (lambda *a, **k: None)
    live = live or (lambda *a: None)
    ds = _dataset(cfg, progress=console is not None)
    plan_idx = expected_indices(len(ds), cfg)
    measured = [idx for rank in plan_idx for idx in rank[cfg.warmup:]]
    say(f"[bold]{cfg.workload}[/] {cfg.model}: measuring the decode yardstick on the run's samples ...")
    decode = measure_decode(ds, [i for b in measured for i in b])
    tokens = {i: ds.estimate_cost(i).tokens for i in decode}
    cores = os.cpu_count() or 1
    slots = min(cfg.budget, cores)
    cost = MODEL_COSTS[cfg.model]
    scale = cfg.window_scale or regime_window_scale(cfg.regime, [decode[i] for b in measured for i in b],
                                                    [tokens[i] for b in measured for i in b], cfg.batch_size,
                                                    cfg.ranks, slots, cost)
    steps_gpu = [[scale * float(cost.sample_units(tokens[i])) for r in range(cfg.ranks)
                  for i in plan_idx[r][cfg.warmup + s]] for s in range(cfg.steps)]
    bound = Bound(decode_s=sum(decode[i] for b in measured for i in b),
                  gpu_s=balanced_gpu_s(steps_gpu, cfg.ranks, scale * cost.c), cpu_slots=slots,
                  samples=sum(len(b) for b in measured))
    plan = RankPlan(system="", ranks=cfg.ranks, port=0, dataset=ds.helix_spec(), batch_size=cfg.batch_size,
                    warmup=cfg.warmup, steps=cfg.steps, window_scale=scale, cost=(cost.a, cost.b, cost.c),
                    workers_per_rank=max(1, cfg.budget // cfg.ranks), prefetch=cfg.prefetch, seed=cfg.seed,
                    compute=cfg.compute, device=cfg.device)
    systems = {}
    for system in cfg.systems:
        if system == "ray":
            from .raypool import ray_available

            why = ray_available()
            if why:
                say(f"[yellow]ray skipped:[/] {why}")
                systems[system] = {"skipped": why}
                continue
        got, cpu = _run_system(system, cfg, replace(plan, system=system, port=_free_port()), live)
        records, overhead, cross = [], [], 0
        for _, rank, recs, extra in sorted(got, key=lambda g: g[1]):
            ready = extra.get("batch_ready_s") or []
            for k, rec in enumerate(recs):
                if rec["indices"] != plan_idx[rank][cfg.warmup + rec["step"]]:
                    raise RuntimeError(f"{system} rank {rank} step {rec['step']} consumed samples {rec['indices']}, "
                                       f"expected {plan_idx[rank][cfg.warmup + rec['step']]}")
                records.append(StepRecord(rank=rank, step=rec["step"], input_wait_s=rec["input_wait_s"],
                                          compute_s=rec["compute_s"], sync_wait_s=rec["sync_wait_s"],
                                          step_s=rec["step_s"], batch_ready_s=ready[k] if k < len(ready) else None,
                                          samples=rec["samples"], tokens=rec["tokens"]))
            stats = extra.get("stats") or {}
            cross += int(stats.get("cross_ds_bytes", 0) or 0)
            p99 = stats.get("scheduler_overhead_us_p99")
            if p99 is not None and not math.isnan(p99):  # native and ray make no placement decisions
                overhead.append(float(p99))
        systems[system] = system_metrics(records, ddl_tolerance_s=cfg.ddl_tolerance_s, bound=bound,
                                         cross_ds_bytes=cross, scheduler_overhead_us=overhead,
                                         cpu_util=_cpu_util(cpu))
    return {"workload": cfg.workload, "model": cfg.model, "regime": cfg.regime, "window_scale": scale,
            "ranks": cfg.ranks, "budget": cfg.budget, "batch_size": cfg.batch_size, "steps": cfg.steps,
            "warmup": cfg.warmup, "ddl_tolerance_s": cfg.ddl_tolerance_s, "remote_servers": cfg.remote_servers,
            "compute": cfg.compute,
            "cores": cores, "label": f"{cfg.workload} b{cfg.batch_size} rd{cfg.remote_servers} {cfg.regime}",
            "bound": {**bound.as_dict(), "decode_s_per_sample_mean": float(np.mean(list(decode.values())))},
            "systems": systems}


def run_bench(configs: list[BenchConfig], out_dir: str | os.PathLike, console=None) -> list[dict]:
    """Run ``configs`` in turn with a rich live view; write results.json, report.md and figures."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .report import print_table, write_report

    runs = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        tasks: dict = {}

        def live(system, rank, step):
            key = (len(runs), system)
            if key not in tasks:
                cfg = configs[len(runs)]
                tasks[key] = bar.add_task(f"{cfg.workload} {cfg.regime} b{cfg.batch_size} rd{cfg.remote_servers} "
                                          f"{system} (rank 0)", total=cfg.warmup + cfg.steps)
            if rank == 0:
                bar.update(tasks[key], completed=step)

        for cfg in configs:
            runs.append(run_one(cfg, console=bar.console, live=live))
    if any(c.remote_servers for c in configs) and (os.cpu_count() or 1) <= 2:
        for run in runs:
            run["note"] = ("on a 2-core machine extra remote DataServers add no CPU: this sweep measures their "
                           "overhead, not added capacity")
    paths = write_report(out_dir, runs)
    if console is not None:
        for run in runs:
            print_table(console, run)
        console.print(f"report: {paths['report.md']}  (results.json and figures beside it)")
    return runs
