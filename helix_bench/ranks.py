"""Emulated training ranks: real processes in a torch.distributed (gloo) group.

Each step: ``next(loader)`` (input wait), an emulated GPU window (a sleep as long as the model's
cost of this rank's batch, or with ``compute="model"`` a real tiny model's forward and backward),
then an all_reduce (sync wait). The input systems compared at
an equal CPU budget are built here: ``native`` (per-rank torch DataLoader with DistributedSampler),
``ray`` (a shared Ray actor pool, see ``raypool``) and ``helix`` with its ablation variants.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field

__all__ = ["BALANCED", "CLUSTER_VARIANTS", "HELIX_VARIANTS", "RankPlan", "rank_main"]

#: Helix ablation (paper Table 3), each adding one mechanism to the one before: loader options.
HELIX_VARIANTS = {
    "helix-pool": {"prefetch_depth": 1, "device": "cpu"},  # shared pool only: copies out, no run-ahead
    "helix-transport": {"prefetch_depth": 1},  # + zero-copy shared-memory delivery
    "helix-prefetch": {},  # + requests ahead of the training loop
    "helix-tier1": {"balance": "tokens"},  # + Tier-1 token planning over a window
    "helix": {"balance": "tokens", "scheduler": "deadline"},  # + deadline placement and server ordering
    "helix-nosteal": {"balance": "tokens", "scheduler": "deadline"},  # helix, its servers without work stealing
    "helix-tier2": {
        "balance": "tokens",
        "scheduler": "deadline",
        "rebalance": {},
    },  # helix + Tier-2 rounds (its defaults)
}

#: Cluster options of a variant (``ClusterConfig`` fields) where it differs from the default.
CLUSTER_VARIANTS = {"helix-nosteal": {"work_stealing": False}}
#: systems whose batches are recomposed by the planner (the sample check is per window)
BALANCED = frozenset(name for name, opts in HELIX_VARIANTS.items() if opts.get("balance"))


@dataclass(frozen=True)
class RankPlan:
    """Everything a rank process needs (picklable)."""

    system: str
    ranks: int
    port: int
    dataset: dict  # helix_spec of the dataset: {"target", "kwargs"}
    batch_size: int
    warmup: int
    steps: int
    window_scale: float  # seconds per cost unit
    cost: tuple[float, float, float]  # GpuCost (a, b, c)
    workers_per_rank: int  # native: DataLoader workers of each rank
    prefetch: int
    seed: int = 0
    compute: str = "emulate"  # "emulate": sleep for the cost model's window; "model": a real tiny model
    device: str = "cpu"  # --compute model: where it runs ("cuda" takes GPU rank % count)
    coordinator: str = ""  # helix
    window: int = 8  # helix variants with balance="tokens": the planning window
    ray: dict = field(default_factory=dict)  # ray: address, namespace, actor names, mode
    master_addr: str = "127.0.0.1"  # the gloo group's rendezvous (host 0's address on emulated hosts)
    store_held: bool = False  # the parent holds the group's TCPStore at ``port`` (else rank 0 starts it there)


def _dataset(spec: dict):
    from helix_core.data.specs import resolve

    return resolve(spec["target"])(**spec["kwargs"])


def _native_loader(plan: RankPlan, rank: int, ds):
    import torch

    from helix_core.data.collate import pad_collate

    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=plan.ranks, rank=rank, shuffle=True, seed=plan.seed)
    kw = {}
    if plan.workers_per_rank > 0:
        kw = dict(
            num_workers=plan.workers_per_rank,
            prefetch_factor=plan.prefetch,
            persistent_workers=True,
            multiprocessing_context="spawn",
        )
    return torch.utils.data.DataLoader(
        ds, batch_size=plan.batch_size, sampler=sampler, collate_fn=pad_collate, **kw
    ), sampler.set_epoch


def _helix_loader(plan: RankPlan, rank: int, ds):
    from helix_core.data.collate import pad_collate
    from helix_core.loader.loader import DistributedDataLoader

    opts = dict(prefetch_depth=plan.prefetch, scheduler="least-request")
    opts.update(HELIX_VARIANTS[plan.system])
    if opts.get("balance"):
        opts["window"] = plan.window
    from helix_core.planning.gpu import GpuCost

    loader = DistributedDataLoader(
        ds,
        batch_size=plan.batch_size,
        rank=rank,
        world_size=plan.ranks,
        coordinator=plan.coordinator,
        shuffle=True,
        seed=plan.seed,
        collate_fn=pad_collate,
        gpu_cost=GpuCost(*plan.cost),
        **opts,
    )
    return loader, loader.set_epoch


def _batches(loader, set_epoch):
    """Endless batches: epoch after epoch, like a training loop with ``set_epoch``."""
    epoch = 0
    while True:
        set_epoch(epoch)
        yield from loader
        epoch += 1


def rank_main(rank: int, plan: RankPlan, results, progress) -> None:
    """Entry point of one rank process: run warm-up + measured steps, put its records on
    ``results`` (a multiprocessing queue), and step counts on ``progress``."""
    os.environ.update(MASTER_ADDR=plan.master_addr, MASTER_PORT=str(plan.port), OMP_NUM_THREADS="1")
    loader = None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if plan.store_held:  # the parent bound the store's port and holds it: no other process can take it
            store = dist.TCPStore(plan.master_addr, plan.port, plan.ranks, is_master=False)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=plan.ranks)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=plan.ranks)
        ds = _dataset(plan.dataset)
        if plan.system == "native":
            loader, set_epoch = _native_loader(plan, rank, ds)
        elif plan.system in ("ray", "ray-rr"):
            from helix_bench.raypool import ray_loader

            loader, set_epoch = ray_loader(plan, rank, ds)
        else:
            loader, set_epoch = _helix_loader(plan, rank, ds)
        a, b, c = plan.cost
        barrier = torch.zeros(1)
        model = None
        if plan.compute == "model":
            from helix_bench.model import ModelCompute

            device = plan.device
            if device == "cuda":
                device = f"cuda:{rank % max(torch.cuda.device_count(), 1)}"
            model = ModelCompute(device, seed=plan.seed)
        records, it = [], _batches(loader, set_epoch)
        measured = [0.0, 0.0]  # time.monotonic at the measured steps' start and end (hostcpu.py's window)
        for step in range(plan.warmup + plan.steps):
            if step == plan.warmup:
                measured[0] = time.monotonic()
            t0 = time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            tokens = batch["tokens"].double()
            if model is None:
                time.sleep(plan.window_scale * (float((a * tokens + b * tokens * tokens).sum()) + c))
            else:
                model(batch)
            t2 = time.perf_counter()
            if model is None:
                dist.all_reduce(barrier)
            else:
                model.all_reduce_grads()
            t3 = time.perf_counter()
            if step >= plan.warmup:
                records.append(
                    {
                        "rank": rank,
                        "step": step - plan.warmup,
                        "input_wait_s": t1 - t0,
                        "compute_s": t2 - t1,
                        "sync_wait_s": t3 - t2,
                        "step_s": t3 - t0,
                        "samples": len(batch["index"]),
                        "tokens": int(tokens.sum()),
                        "indices": batch["index"].tolist(),
                    }
                )
            progress.put((plan.system, rank, step + 1))
            del batch
        measured[1] = time.monotonic()
        extra = {
            "stats": loader.stats() if hasattr(loader, "stats") else {},
            "measured_monotonic": measured,
            "batch_ready_s": loader.batch_ready_s()[plan.warmup : plan.warmup + plan.steps]
            if hasattr(loader, "batch_ready_s")
            else [],
        }
        dist.barrier()
        results.put(("ok", rank, records, extra))
    except BaseException:
        results.put(("error", rank, traceback.format_exc(), {}))
    finally:
        if loader is not None and hasattr(loader, "close"):
            loader.close()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
