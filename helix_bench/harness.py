"""`helix bench`: the paper's evaluation (§5) on this machine, with emulated GPU windows.

For each configuration the harness synthesizes (or reuses) the workload, rounds warm-up and
measured steps to whole planning windows, measures the decode cost of the exact samples the
measured steps consume (the yardstick every system shares) and the machine's decode capacity,
calibrates the emulated GPU window for the regime, then runs each input system with R real rank
processes at the same CPU budget, checks that every system consumed the same samples, and
measures where each system's CPU went (``cpu_s_by_role``).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from helix_core.planning.gpu import GPU_COSTS, GpuCost
from .emulate import REGIMES, measure_decode, regime_window_scale
from .ranks import CLUSTER_VARIANTS, HELIX_VARIANTS, RankPlan, rank_main
from .results import RAY_MODES, system_result

__all__ = ["BenchConfig", "SYSTEMS", "run_bench", "run_one"]

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
        if min(self.ranks, self.batch_size, self.budget, self.steps, self.prefetch, self.clips, self.window) < 1 \
                or self.warmup < 0:
            raise ValueError("ranks, batch_size, budget, steps, prefetch, clips and window must be >= 1, warmup >= 0")
        if self.budget < self.ranks + self.remote_servers and "helix" in "".join(self.systems):
            raise ValueError(f"budget {self.budget} is too small for {self.ranks} local + {self.remote_servers} "
                             "remote DataServers (each needs at least one worker)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dataset(cfg: BenchConfig, progress):
    from helix_core.datasets import VideoClipDataset
    from helix_core.media.synth import make_dataset
    from helix_core.profiles import profile_dataset

    root = Path(cfg.data_dir) / f"{cfg.workload}-{cfg.clips}-s{cfg.scale:g}-seed{cfg.seed}"
    make_dataset(root, cfg.workload, cfg.clips, seed=cfg.seed, scale=cfg.scale, workers=os.cpu_count() or 1,
                 progress=progress)
    if cfg.profiles and not (root / "profiles.jsonl").exists():
        profile_dataset(root / "manifest.jsonl", calibrate_per_bucket=1, progress=progress)
    return VideoClipDataset(root / "manifest.jsonl", model=cfg.model, profiles=None if cfg.profiles else False)


def steps_per_epoch(n: int, cfg: BenchConfig) -> int:
    """Global steps of one epoch: DistributedSampler's shard of one rank, in batches."""
    return -(-(-(-n // cfg.ranks)) // cfg.batch_size)


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


def _roles(procs, cluster, pool) -> dict[str, list[int]]:
    roles = {"ranks": [p.pid for p in procs if p.pid]}
    if cluster is not None:
        roles["coordinator"] = [cluster.coordinator_pid]
        roles["dataservers"] = [s.pid for s in cluster.servers]
    if pool is not None:
        roles.update(pool.pids())
    return roles


#: the role of the processes that decode, per kind of system (their CPU minus the decode is overhead)
_CHILD_ROLES = {"ranks": "loader-workers", "dataservers": "workers"}


def _run_system(system: str, cfg: BenchConfig, plan: RankPlan, live) -> tuple[list, dict]:
    """Start the system's shared parts, run the rank processes; return (results, measurement):
    CPU snapshots by role and wall times (``time.time()``) at the start and end of the measured steps."""
    import psutil

    from helix_core.config import ClusterConfig
    from helix_core.runtime.cluster import LocalCluster, host_layout
    from .cpuroles import snapshot

    ctx = mp.get_context("spawn")
    results, progress = ctx.Queue(), ctx.Queue()
    cluster = pool = None
    procs = []
    try:
        if system.startswith("helix"):
            if cfg.remote_servers:  # the rd sweep: one server per rank plus the sidecars, the budget spread over all
                local, per = cfg.ranks, max(1, cfg.budget // (cfg.ranks + cfg.remote_servers))
            else:  # the budget's workers laid out as an embedded cluster lays them out
                local, per = host_layout(cfg.ranks, cfg.budget)
            cluster = LocalCluster(local_servers=local, remote_servers=cfg.remote_servers, workers_per_server=per,
                                   config=ClusterConfig(**CLUSTER_VARIANTS.get(system, {})))
            plan = replace(plan, coordinator=cluster.address)
        elif system in RAY_MODES:
            from .raypool import RayPool

            pool = RayPool(cfg.budget, plan.dataset, mode=RAY_MODES[system])
            plan = replace(plan, ray=pool.info())
        procs = [ctx.Process(target=rank_main, args=(r, plan, results, progress), daemon=False)
                 for r in range(cfg.ranks)]
        for p in procs:
            p.start()
        got, m = [], {}
        me = os.getpid()

        def measure(key: str) -> None:
            m[key] = (time.time(), snapshot(_roles(procs, cluster, pool), me, _CHILD_ROLES), psutil.cpu_times())

        deadline = time.monotonic() + 3600
        while len(got) < cfg.ranks and time.monotonic() < deadline:
            try:
                while True:
                    _, rank, step = progress.get_nowait()
                    live(system, rank, step)
                    if rank == 0 and step == cfg.warmup:
                        measure("start")
            except queue.Empty:
                pass
            try:
                got.append(results.get(timeout=0.05))
                if len(got) == 1:
                    measure("end")
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
        errors = [g for g in got if g[0] == "error"]
        if errors or len(got) < cfg.ranks:
            detail = errors[0][2] if errors else "a rank process exited without a result"
            raise RuntimeError(f"{system}: {detail}")
        return got, m
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


def measured_gpu_s(expected: list, tokens: dict, cost: GpuCost, scale: float) -> float:
    """The bound's GPU term: the token-balanced GPU seconds of the measured steps, ``expected``
    being ``[rank][step] -> indices``."""
    from .metrics import balanced_gpu_s

    ranks, steps = len(expected), len(expected[0])
    per_step = [[scale * float(cost.sample_units(tokens[i])) for r in range(ranks) for i in expected[r][s]]
                for s in range(steps)]
    return balanced_gpu_s(per_step, ranks, scale * cost.c)


def run_one(cfg: BenchConfig, console=None, live=None) -> dict:
    """Run every system of one configuration; return the results dict of ``report.write_report``."""
    import tempfile

    from .metrics import Bound
    from .samples import round_to_windows, window_spans
    from .timed import TimedClipDataset, measure_capacity

    say = console.print if console is not None else (lambda *a, **k: None)
    live = live or (lambda *a: None)
    ds = _dataset(cfg, progress=console is not None)
    spe = steps_per_epoch(len(ds), cfg)
    warmup, steps = round_to_windows(cfg.warmup, cfg.steps, spe, cfg.window)
    cfg = replace(cfg, warmup=warmup, steps=steps)
    plan_idx = expected_indices(len(ds), cfg)
    expected = [rank[warmup:] for rank in plan_idx]  # [rank][measured step]: the sampler's
    spans = window_spans(warmup, steps, spe, cfg.window)
    flat = [i for rank in expected for b in rank for i in b]
    say(f"[bold]{cfg.workload}[/] {cfg.model}: {warmup} warm-up + {steps} measured steps (whole windows of "
        f"{cfg.window}; {spe} steps an epoch); measuring the decode yardstick and capacity on their samples ...")
    decode = measure_decode(ds, flat)
    cores = os.cpu_count() or 1
    slots = min(cfg.budget, cores)
    capacity = measure_capacity(ds.helix_spec(), sorted(decode), slots, decode) if slots > 1 else 1.0
    capacity = min(capacity, float(slots))
    tokens = {i: ds.estimate_cost(i).tokens for i in decode}
    cost = GPU_COSTS[cfg.model]
    if cfg.gpu_cost == "linear":  # the attention term off: native's ranks wait on each other less
        cost = GpuCost(a=cost.a, b=0.0, c=cost.c)
    scale = cfg.window_scale or regime_window_scale(cfg.regime, [decode[i] for i in flat], [tokens[i] for i in flat],
                                                    cfg.batch_size, cfg.ranks, capacity, cost)
    bound = Bound(decode_s=sum(decode[i] for i in flat), gpu_s=measured_gpu_s(expected, tokens, cost, scale),
                  cpu_slots=slots, samples=len(flat), capacity=capacity)
    plan = RankPlan(system="", ranks=cfg.ranks, port=0, dataset=ds.helix_spec(), batch_size=cfg.batch_size,
                    warmup=warmup, steps=steps, window_scale=scale, cost=(cost.a, cost.b, cost.c),
                    workers_per_rank=max(1, cfg.budget // cfg.ranks), prefetch=cfg.prefetch, seed=cfg.seed,
                    compute=cfg.compute, device=cfg.device, window=cfg.window)
    units = {i: float(cost.sample_units(t)) for i, t in tokens.items()}
    systems = {}
    with tempfile.TemporaryDirectory(prefix="helix-bench-") as logs:
        for system in cfg.systems:
            if system in RAY_MODES:
                from .raypool import ray_available

                why = ray_available()
                if why:
                    say(f"[yellow]{system} skipped:[/] {why}")
                    systems[system] = {"skipped": why}
                    continue
            spec = TimedClipDataset(ds.manifest_path, model=cfg.model, decode_log=Path(logs) / system,
                                    profiles=None if cfg.profiles else False, estimate_noise=cfg.estimate_noise,
                                    noise_seed=cfg.seed).helix_spec()
            got, m = _run_system(system, cfg, replace(plan, system=system, port=_free_port(), dataset=spec), live)
            systems[system] = system_result(system, cfg, got, m, expected, spans, bound, decode, units,
                                             Path(logs) / system)
    return {"workload": cfg.workload, "model": cfg.model, "regime": cfg.regime, "window_scale": scale,
            "gpu_cost": cfg.gpu_cost, "profiles": cfg.profiles, "prefetch": cfg.prefetch,
            "estimate_noise": cfg.estimate_noise,
            "ranks": cfg.ranks, "budget": cfg.budget, "batch_size": cfg.batch_size, "steps": steps,
            "warmup": warmup, "window": cfg.window, "steps_per_epoch": spe, "ddl_tolerance_s": cfg.ddl_tolerance_s,
            "remote_servers": cfg.remote_servers, "compute": cfg.compute,
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
