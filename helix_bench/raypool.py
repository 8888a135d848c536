"""The Ray baselines: N decoder actors (one CPU each) shared by all ranks, same prefetch depth.

``ray`` — as a Ray user would tune it: a batch request goes to an *idle* actor, whichever rank
sent it (``ray.util.ActorPool`` semantics, shared across processes). A small async dispatcher
actor (no CPU reserved) holds the idle actors in an ``asyncio.Queue``; a rank calls
``dispatcher.submit(indices, epoch)``, which waits for an idle actor, starts
``get_batch_numpy`` on it (two returns: a tiny done flag and the batch) and at once hands the
batch's ObjectRef back to the rank, wrapped in a list so that Ray does not resolve it; the actor
rejoins the idle queue when its done flag resolves. The payload never passes through the
dispatcher. Batches are dicts of numpy arrays, which ``ray.get`` maps zero-copy out of the
object store; the rank wraps them with ``torch.from_numpy`` (read-only tensors, no copy).

``ray-rr`` — the first baseline, kept for reference: each rank sends its requests round-robin
over the actors, whatever they are doing, and torch tensors travel through the object store
(pickled: copied in and out).

Ray binds loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before ``ray.init``) and the
actors live in a namespace of their own.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import uuid
import warnings

import numpy as np

__all__ = ["MODES", "RayPool", "ray_available", "ray_loader"]

#: RayPool modes: how a request finds an actor, and what travels back
MODES = {
    "idle": "idle-actor dispatch, numpy payloads read zero-copy",
    "rr": "round-robin per rank, torch payloads (copied)",
}
_TIMEOUT_S = 600.0


def ray_available() -> str | None:
    """None when Ray can be used, else why not."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (pip install 'helix[bench]')"
    return None


class _Decoder:
    """One decoder actor: the dataset, single-threaded."""

    def __init__(self, spec: dict):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        from helix_core.data.specs import resolve

        torch.set_num_threads(1)
        self.ds = resolve(spec["target"])(**spec["kwargs"])

    def pid(self) -> int:
        return os.getpid()

    def get_batch(self, indices: list[int], epoch: int) -> dict:
        """``pad_collate`` of the samples: torch tensors (``ray-rr``)."""
        from helix_core.data.collate import pad_collate

        if hasattr(self.ds, "set_epoch"):
            self.ds.set_epoch(epoch)
        return pad_collate([self.ds[i] for i in indices])

    def get_batch_numpy(self, indices: list[int], epoch: int) -> tuple[bool, dict]:
        """``(True, batch)`` with the batch's tensors as numpy arrays (``ray``): the flag tells the
        dispatcher the actor is idle without it touching the batch."""
        import torch

        batch = self.get_batch(indices, epoch)
        return True, {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class _Dispatcher:
    """Async actor: hands each request to an idle decoder, first come first served."""

    def __init__(self, actors: list):
        self.idle: asyncio.Queue = asyncio.Queue()
        for a in actors:
            self.idle.put_nowait(a)
        self._releases: set = set()
        self.failed = 0  # batches that raised

    def pid(self) -> int:
        return os.getpid()

    async def submit(self, indices: list[int], epoch: int) -> list:
        """``[batch_ref]`` as soon as an idle decoder has started on the batch."""
        actor = await self.idle.get()
        done, batch = actor.get_batch_numpy.options(num_returns=2).remote(indices, epoch)
        release = asyncio.get_running_loop().create_task(self._release(actor, done))
        self._releases.add(release)
        release.add_done_callback(self._releases.discard)
        return [batch]

    async def _release(self, actor, done) -> None:
        import ray

        try:
            await done
        except ray.exceptions.RayActorError:
            return  # a dead actor leaves the pool; its batch's ref carries the error to the rank
        except ray.exceptions.RayError:
            self.failed += 1  # a failed batch: the rank sees its error, the actor serves on
        self.idle.put_nowait(actor)


class RayPool:
    """Starts a local Ray instance with ``n`` CPUs, ``n`` named decoder actors and, in ``mode``
    ``"idle"``, the dispatcher actor. Owns them all: ``close()`` shuts Ray down."""

    def __init__(self, n: int, dataset_spec: dict, mode: str = "idle"):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; valid: {', '.join(MODES)}")
        if n < 1:
            raise ValueError(f"a Ray pool needs n >= 1 actors, got {n}")
        import psutil

        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        self.mode = mode
        self.namespace = f"helix-bench-{uuid.uuid4().hex[:8]}"
        me = psutil.Process()
        before = {p.pid for p in me.children()}
        ray.init(
            num_cpus=n,
            include_dashboard=False,
            namespace=self.namespace,
            logging_level="ERROR",
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )
        try:
            # the processes ray.init started (GCS, raylet, ...): Ray's, with all their descendants
            self._ray_roots = [p.pid for p in me.children() if p.pid not in before]
            self.address = ray.get_runtime_context().gcs_address
            self.names = [f"decoder-{i}" for i in range(n)]
            decoder = ray.remote(num_cpus=1)(_Decoder)
            self.actors = [decoder.options(name=name).remote(dataset_spec) for name in self.names]
            self._decoder_pids = ray.get([a.pid.remote() for a in self.actors], timeout=300)
            self.dispatcher_name = ""
            if mode == "idle":
                self.dispatcher_name = "dispatcher"
                self.dispatcher = (
                    ray.remote(num_cpus=0)(_Dispatcher).options(name=self.dispatcher_name).remote(self.actors)
                )
                ray.get(self.dispatcher.pid.remote(), timeout=300)
        except BaseException:
            ray.shutdown()
            raise

    def info(self) -> dict:
        """What a rank needs to join (picklable): ``address``, ``namespace``, decoder ``names``,
        ``mode`` and the ``dispatcher`` name ("" in mode ``"rr"``)."""
        return {
            "address": self.address,
            "namespace": self.namespace,
            "names": self.names,
            "mode": self.mode,
            "dispatcher": self.dispatcher_name,
        }

    def pids(self) -> dict[str, list[int]]:
        """Process ids by role: ``"ray-decoders"`` (the decoder actors) and ``"ray-system"``
        (the dispatcher, GCS, raylet, idle workers and every other live process Ray started)."""
        import psutil

        decoders = list(self._decoder_pids)
        system = []
        for root in self._ray_roots:
            try:
                proc = psutil.Process(root)
                system += [proc.pid, *(c.pid for c in proc.children(recursive=True))]
            except psutil.Error:
                continue
        return {"ray-decoders": decoders, "ray-system": sorted(set(system) - set(decoders))}

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()


class _RayLoader:
    """A rank's loader: its ``DistributedSampler`` batches, ``prefetch`` requests in flight."""

    def __init__(self, plan, rank: int, ds):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray
        import torch

        self.ray, self.torch = ray, torch
        self.mode = plan.ray.get("mode", "rr")
        if self.mode not in MODES:
            raise ValueError(f"plan.ray['mode']={self.mode!r}; valid: {', '.join(MODES)}")
        self._owns_ray = not ray.is_initialized()  # a rank process joins; the pool's own process already is
        if self._owns_ray:
            ray.init(
                address=plan.ray["address"], namespace=plan.ray["namespace"], logging_level="ERROR", log_to_driver=False
            )
        ns = plan.ray["namespace"]
        if self.mode == "idle":
            self.dispatcher = ray.get_actor(plan.ray["dispatcher"], namespace=ns)
        else:
            self.actors = [ray.get_actor(n, namespace=ns) for n in plan.ray["names"]]
        self.sampler = torch.utils.data.DistributedSampler(
            ds, num_replicas=plan.ranks, rank=rank, shuffle=True, seed=plan.seed
        )
        self.batch_size, self.prefetch, self.rank, self.epoch = plan.batch_size, plan.prefetch, rank, 0
        self._sent = rank  # ray-rr: round-robin offset, ranks start on different actors

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def _submit(self, indices: list[int]):
        if self.mode == "idle":
            return self.dispatcher.submit.remote(indices, self.epoch)
        actor = self.actors[self._sent % len(self.actors)]
        self._sent += 1
        return actor.get_batch.remote(indices, self.epoch)

    def _receive(self, ref) -> dict:
        if self.mode == "rr":
            return self.ray.get(ref, timeout=_TIMEOUT_S)
        [batch_ref] = self.ray.get(ref, timeout=_TIMEOUT_S)
        arrays = self.ray.get(batch_ref, timeout=_TIMEOUT_S)
        with warnings.catch_warnings():  # the object store's pages are read-only: so are the tensors
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return {k: self.torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}

    def __iter__(self):
        idx = list(self.sampler)
        batches = collections.deque(idx[i : i + self.batch_size] for i in range(0, len(idx), self.batch_size))
        inflight = collections.deque()
        while batches or inflight:
            while batches and len(inflight) < self.prefetch:
                inflight.append(self._submit(batches.popleft()))
            yield self._receive(inflight.popleft())

    def close(self) -> None:
        if self._owns_ray and self.ray.is_initialized():
            self.ray.shutdown()


def ray_loader(plan, rank: int, ds):
    """``(loader, set_epoch)`` for rank ``rank`` of a ``RayPool`` described by ``plan.ray``
    (its ``info()``); the mode comes from ``plan.ray["mode"]`` (``"rr"`` when absent)."""
    loader = _RayLoader(plan, rank, ds)
    return loader, loader.set_epoch
