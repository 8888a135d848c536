"""One input system's run in `helix bench`: start its shared parts (a ``LocalCluster`` or a Ray
pool), run the R rank processes, follow their progress and snapshot the CPU by role at the start
and end of the measured steps; ``harness.py`` calls it once per system."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from dataclasses import replace

from helix_bench.benchconfig import BenchConfig
from helix_bench.ranks import CLUSTER_VARIANTS, RankPlan, rank_main
from helix_bench.results import RAY_MODES


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


def run_system(system: str, cfg: BenchConfig, plan: RankPlan, live) -> tuple[list, dict]:
    """Start the system's shared parts, run the rank processes; return (results, measurement):
    CPU snapshots by role and wall times (``time.time()``) at the start and end of the measured steps."""
    import psutil
    from torch.distributed import TCPStore

    from helix_bench.cpuroles import snapshot
    from helix_core.config import ClusterConfig
    from helix_core.launch.cluster import LocalCluster, host_layout

    ctx = mp.get_context("spawn")
    results, progress = ctx.Queue(), ctx.Queue()
    cluster = pool = None
    procs = []
    # the ranks' gloo store, bound and held here for the whole run: a port picked free and let go
    # could be taken by a DataServer starting meanwhile, and the ranks would wait on it for 30 min
    store = TCPStore(plan.master_addr, 0, plan.ranks, is_master=True, wait_for_workers=False)
    plan = replace(plan, port=store.port, store_held=True)
    try:
        if system.startswith("helix"):
            if cfg.remote_servers:  # the rd sweep: one server per rank plus the sidecars, the budget spread over all
                local, per = cfg.ranks, max(1, cfg.budget // (cfg.ranks + cfg.remote_servers))
            else:  # the budget's workers laid out as an embedded cluster lays them out
                local, per = host_layout(cfg.ranks, cfg.budget)
            cluster = LocalCluster(
                local_servers=local,
                remote_servers=cfg.remote_servers,
                workers_per_server=per,
                config=ClusterConfig(**CLUSTER_VARIANTS.get(system, {})),
            )
            plan = replace(plan, coordinator=cluster.address)
        elif system in RAY_MODES:
            from helix_bench.raypool import RayPool

            pool = RayPool(cfg.budget, plan.dataset, mode=RAY_MODES[system])
            plan = replace(plan, ray=pool.info())
        procs = [
            ctx.Process(target=rank_main, args=(r, plan, results, progress), daemon=False) for r in range(cfg.ranks)
        ]
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
