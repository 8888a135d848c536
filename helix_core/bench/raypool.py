"""The Ray baseline: a pool of N actors (one CPU each), shared by all ranks, same prefetch depth.

Each actor holds the dataset and returns collated batches through Ray's object store; each rank
keeps ``prefetch`` batch requests in flight, spread round-robin over the actors. Ray binds
loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before ``ray.init``) and the actors live in
a namespace of their own.
"""
from __future__ import annotations

import collections
import os
import uuid

__all__ = ["RayPool", "ray_available", "ray_loader"]


def ray_available() -> str | None:
    """None when Ray can be used, else why not."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (pip install 'helix[bench]')"
    return None


class _Decoder:
    def __init__(self, spec: dict):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        from ..runtime.specs import resolve

        torch.set_num_threads(1)
        self.ds = resolve(spec["target"])(**spec["kwargs"])

    def ready(self) -> bool:
        return True

    def get_batch(self, indices: list[int], epoch: int):
        from ..collate import pad_collate

        if hasattr(self.ds, "set_epoch"):
            self.ds.set_epoch(epoch)
        return pad_collate([self.ds[i] for i in indices])


class RayPool:
    """Starts a local Ray instance with ``n`` CPUs and ``n`` named decoder actors."""

    def __init__(self, n: int, dataset_spec: dict):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        self.namespace = f"helix-bench-{uuid.uuid4().hex[:8]}"
        ray.init(num_cpus=n, include_dashboard=False, namespace=self.namespace, logging_level="ERROR",
                 log_to_driver=False, _node_ip_address="127.0.0.1")
        self.address = ray.get_runtime_context().gcs_address
        actor = ray.remote(num_cpus=1)(_Decoder)
        self.names = [f"decoder-{i}" for i in range(n)]
        self.actors = [actor.options(name=name).remote(dataset_spec) for name in self.names]
        ray.get([a.ready.remote() for a in self.actors], timeout=300)

    def info(self) -> dict:
        return {"address": self.address, "namespace": self.namespace, "names": self.names}

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()


class _RayLoader:
    def __init__(self, plan, rank: int, ds):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray
        import torch

        self.ray = ray
        ray.init(address=plan.ray["address"], namespace=plan.ray["namespace"], logging_level="ERROR",
                 log_to_driver=False)
        self.actors = [ray.get_actor(n) for n in plan.ray["names"]]
        self.sampler = torch.utils.data.DistributedSampler(ds, num_replicas=plan.ranks, rank=rank, shuffle=True,
                                                           seed=plan.seed)
        self.batch_size, self.prefetch, self.rank, self.epoch = plan.batch_size, plan.prefetch, rank, 0
        self._sent = rank  # round-robin offset: ranks start on different actors

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        idx = list(self.sampler)
        batches = collections.deque(idx[i:i + self.batch_size] for i in range(0, len(idx), self.batch_size))
        inflight = collections.deque()
        while batches or inflight:
            while batches and len(inflight) < self.prefetch:
                actor = self.actors[self._sent % len(self.actors)]
                self._sent += 1
                inflight.append(actor.get_batch.remote(batches.popleft(), self.epoch))
            yield self.ray.get(inflight.popleft(), timeout=600)

    def close(self) -> None:
        if self.ray.is_initialized():
            self.ray.shutdown()


def ray_loader(plan, rank: int, ds):
    loader = _RayLoader(plan, rank, ds)
    return loader, loader.set_epoch
