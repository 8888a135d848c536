"""``DistributedDataLoader``: the DataLoader programming model on a Helix cluster.

With ``balance=None`` (the default) and torch ``default_collate`` it yields exactly the batches of
a torch ``DataLoader`` with ``DistributedSampler(shuffle, seed)`` and that ``collate_fn`` — while
decoding runs in a shared pool of DataServer workers, requests run ahead of the training loop with
the rank's deadline attached, and batches arrive through shared memory. Placement (``scheduler``)
never changes what a batch holds; ``balance="tokens"`` (Tier 1) recomposes each window of global
steps so that ranks carry equal GPU cost.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import threading
import time
import warnings
import weakref

import grpc
import numpy as np
import torch

from ..config import ClusterConfig
from ..errors import ClusterError
from ..runtime import shm
from ..runtime.proto import helix_pb2 as pb
from ..runtime.specs import make_spec
from ..runtime.tensors import merge_batches
from ..telemetry import LoaderStats
from ..collate import pad_collate
from ..planning.batching import TokenPlanner
from .costing import PlanCosts, gpu_units
from .deadline import DeadlineEstimator
from .embedded import acquire_embedded, release_embedded
from .nodes import BatchJob, CostTagger, Dispatch, PlannedBatches, ShardBatches
from .transport import TRANSIENT, ClusterClient

__all__ = ["DistributedDataLoader"]

SCHEDULERS = ("deadline", "least-request")
BALANCES = (None, "tokens")
ON_ERROR = ("raise", "skip")
_EXACT_MERGE = (None, torch.utils.data.default_collate, pad_collate)  # collates whose microbatch merge is exact


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class DistributedDataLoader:
    """Iterate ``dataset`` in batches prepared by a Helix cluster.

    Arguments follow torch's ``DataLoader`` / ``DistributedSampler`` where they overlap
    (``batch_size``, ``shuffle``, ``seed``, ``drop_last``, ``collate_fn``, ``pin_memory``), plus:
    ``coordinator`` ("host:port"; default ``HELIX_COORDINATOR``, else an embedded LocalCluster),
    ``token``, ``prefetch_depth`` (batches requested ahead), ``microbatch_size`` (split each batch
    into requests of this many samples, merged — padded — before it is yielded), ``on_error``
    ("raise": ``SampleError`` at the batch; "skip": replaced from this rank's shard, counted in
    ``stats()["skipped"]``), ``device`` (copy batches there, non-blocking), ``num_workers`` (worker
    processes of an embedded cluster).

    Co-scheduling: ``scheduler`` names the placement policy of every request ("deadline": paper
    Eq. 1 against this rank's deadline; "least-request"); ``balance="tokens"`` plans each
    ``window`` of global steps so that every rank carries the same predicted GPU cost
    (``gpu_cost``: a model family, a ``GpuCost`` or a callable of token counts; default the
    dataset's family). Deadlines come from the time between ``next()`` calls, or from
    ``report_step_time(seconds)``.
    """

    def __init__(self, dataset, batch_size: int = 1, *, rank: int | None = None, world_size: int | None = None,
                 coordinator: str | None = None, token: str | None = None, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False, collate_fn=None, prefetch_depth: int = 4, scheduler: str = "deadline",
                 balance: str | None = None, window: int = 8, gpu_cost=None, microbatch_size: int | None = None,
                 on_error: str = "raise", pin_memory: bool = False, device=None, num_workers: int | None = None,
                 config: ClusterConfig | None = None, ddl_tolerance_s: float = 0.010):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={scheduler!r}; valid: {', '.join(SCHEDULERS)}")
        if balance not in BALANCES:
            raise ValueError(f"balance={balance!r}; valid: None, 'tokens'")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r}: the number of global steps the token planner recomposes "
                             "together must be an int >= 1 (1: within each step)")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}; valid: {', '.join(ON_ERROR)}")
        if batch_size < 1 or prefetch_depth < 1 or (microbatch_size is not None and microbatch_size < 1):
            raise ValueError("batch_size, prefetch_depth and microbatch_size must be >= 1")
        r, w = _default_rank_world()
        self.rank, self.world_size = (r if rank is None else rank), (w if world_size is None else world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.drop_last, self.collate_fn, self.on_error = drop_last, collate_fn, on_error
        self.microbatch_size, self.prefetch_depth = microbatch_size, prefetch_depth
        self.scheduler, self.balance, self.window = scheduler, balance, window
        self._units, self._step_units = gpu_units(dataset, gpu_cost)
        self._fanout = microbatch_size is None and collate_fn in _EXACT_MERGE  # automatic fan-out merges exactly
        self.deadlines = DeadlineEstimator()
        self.pin_memory, self.device = pin_memory, (torch.device(device) if device is not None else None)
        self.config = config or ClusterConfig()
        self._stats = LoaderStats(ddl_tolerance_s)
        shard = (self.rank, self.world_size, shuffle, seed, drop_last)
        if balance == "tokens":  # built before any cluster: a dataset it can't cost fails here, holding nothing
            self._batches = PlannedBatches(len(dataset), batch_size, *shard, TokenPlanner(self.world_size, window),
                                           PlanCosts(dataset, self._units))
        else:
            self._batches = ShardBatches(len(dataset), batch_size, *shard)
        self._cluster, self._embedded = None, False
        address = coordinator or os.environ.get("HELIX_COORDINATOR")
        if address is None:  # shared by this process's loaders (train and val)
            self._cluster, address, token = acquire_embedded(self.world_size, num_workers, self.config)
            self._embedded = True
        self._closed = True  # until construction succeeded (close() must not touch what isn't there)
        try:
            self.client = ClusterClient(address, token, self.config, self.rank, self.world_size)
            try:
                self.spec = make_spec(dataset, collate_fn, self.client.pickle_allowed)
            except BaseException:
                self.client.close()
                raise
        except BaseException:
            if self._embedded:
                release_embedded()
            raise
        self._tagger = CostTagger(self._batches, dataset, seed, microbatch_size)
        # weak callbacks: no loader <-> Dispatch cycle, so a loader dropped without close() closes
        # once its requests in flight are answered, not at some later cyclic collection
        self._epochs_advance = False  # set_epoch was called: the user advances epochs (a training loop)
        self._root = Dispatch(self._tagger, *map(_weak, (self._submit, self._collect, self._cancel)), prefetch_depth,
                              on_batch=_weak(self._record), next_epoch=_weak(self._next_epoch))
        self._epoch, self._resume, self._iteration, self._started = 0, 0, 0, 0
        self._position = 0  # batches yielded of the epoch (len(self) once it completed)
        self._task_ids = itertools.count(self.client.task_id_base + 1)  # unique in the cluster; next() is atomic
        self._unread: set = set()  # cancelled requests whose replies are still on their way
        self._unread_lock = threading.Lock()
        self._closed = False

    # ---- the torch DataLoader surface ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._batches)

    def set_epoch(self, epoch: int) -> None:
        """Like ``DistributedSampler.set_epoch``: the shuffle order of the next iteration. Setting
        the epoch a loaded state is in keeps its resume point (the usual resume loop does that)."""
        self._epochs_advance = True  # the user manages epochs: the next pass is likely epoch + 1
        if int(epoch) != self._epoch:
            self._epoch, self._resume, self._position = int(epoch), 0, 0

    def _next_epoch(self, epoch: int) -> int | None:
        """The epoch whose first batches are requested ahead once this one's are all sent: the
        next one where the user advances epochs with ``set_epoch`` (a training loop); None (no
        requests ahead) for a loader whose epoch never moves (say, a validation loader, which may
        not run again for a long time)."""
        return epoch + 1 if self._epochs_advance else None

    def __iter__(self) -> "_LoaderIter":
        if self._closed:
            raise RuntimeError("this DistributedDataLoader is closed")
        self._iteration += 1  # starts no work: the epoch and resume point are read at the first next()
        return _LoaderIter(self, self._iteration)

    def _begin(self, iteration: int) -> None:
        """The first ``next()`` of an iteration: request its epoch's batches (adopting requests
        already running ahead for exactly that epoch and position)."""
        self._root.reset({ShardBatches.EPOCH: self._epoch, ShardBatches.YIELDED: self._resume})
        self._resume = 0  # a resume point applies to one iteration; the next starts the epoch afresh
        self._started = iteration

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) pass iterates."""
        return self._epoch

    batch_sampler = None  # batches are planned by the loader itself (trainers probe this attribute)

    @property
    def sampler(self) -> "_EpochSampler":
        """A sampler-like view (``set_epoch``, ``len``) for trainers that call
        ``loader.sampler.set_epoch(e)`` at each epoch's start, as Lightning does."""
        return _EpochSampler(self)

    def state_dict(self) -> dict:
        """Rank-independent resume point: batches yielded to the user (not requests in flight)."""
        active = self._started == self._iteration and self._root.running and not self._closed \
            and self._root.get_state()[ShardBatches.EPOCH] == self._epoch  # not a run set_epoch moved past
        yielded = self._root.get_state()[ShardBatches.YIELDED] if active else (self._resume or self._position)
        return {"epoch": self._epoch, "seed": self.seed, "batches_yielded": int(yielded),
                "world_size": self.world_size, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "num_samples": len(self.dataset), "balance": self.balance,
                "window": self.window if self.balance else None}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` (any rank's): the next iteration continues mid-epoch.
        A state made with another seed, world size, batch size, dataset or balancing plan is refused."""
        mine = self.state_dict()
        for key in ("seed", "world_size", "batch_size", "shuffle", "drop_last", "num_samples", "balance", "window"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"cannot resume: state has {key}={state[key]!r}, this loader {mine[key]!r}")
        self._epoch, self._position = int(state["epoch"]), int(state["batches_yielded"])
        # a state saved after the epoch finished resumes to a fresh pass, never an empty one
        self._resume = self._position if self._position < len(self) else 0

    def report_step_time(self, seconds: float) -> None:
        """The trainer's measured GPU window of the batch being computed (seconds; e.g. CUDA-event
        timing from ``on_train_batch_start`` to ``on_train_batch_end``). Without it the loader
        measures the time between a ``next()`` returning and the next ``next()`` call."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0 \
                or seconds == float("inf"):
            raise ValueError(f"report_step_time(seconds={seconds!r}): seconds must be a finite number >= 0")
        self.deadlines.report(float(seconds))

    def stats(self) -> dict:
        """Counters and percentiles (seconds): input_wait_p50_s / p95_s, batch_ready_p95_s,
        ddl_miss_rate, skipped, resubmits, cross_ds_bytes, scheduler_overhead_us_p99 (the
        Coordinator's decision time), route_us_p50 / p99 (a Route as this client sees it),
        deadline_p50_s, placement_reasons, fanouts, cost_error_start / cost_error_end (median
        |predicted - measured| / measured CPU seconds of the first and last decoded samples), ..."""
        out = self._stats.as_dict()
        out["window_s_per_unit"] = self.deadlines.seconds_per_unit
        return out

    def batch_ready_s(self) -> list[float]:
        """Batch-ready latency of each batch so far, in order (seconds from dispatch to complete)."""
        return list(self._stats.batch_ready)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._root.shutdown()
        deadline = time.monotonic() + self.config.rpc_timeout_s
        while time.monotonic() < deadline:
            with self._unread_lock:
                if all(f.done() for f in self._unread):
                    break
            time.sleep(0.01)  # running tasks finish within a batch; their replies free their slabs
        self.client.close()
        if self._embedded:
            release_embedded()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return
        if threading.current_thread() is threading.main_thread():
            self._close_quietly()
        else:  # dropped on one of its own (or gRPC's) threads: closing there could wait on that very thread
            threading.Thread(target=self._close_quietly, name="helix-loader-close", daemon=True).start()

    def _close_quietly(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- dispatch callbacks (sender / fetcher threads) ----------------------------------------------
    def _submit(self, job: BatchJob) -> None:
        deadline = self._plan_deadline(job)
        if self._fanout and len(job.parts) == 1 and deadline is not None:
            job.parts = _fan_out(job.parts[0], job.costs, deadline)
            self._stats.fanouts += len(job.parts) > 1
        offset = 0
        for part in job.parts:
            task_id = next(self._task_ids)
            job.task_ids.append(task_id)
            job.excluded.append(set())
            job.attempts.append(0)
            job.routes.append(None)
            job.futures.append(None)
            job.part_costs.append(_sum_costs(job.costs[offset:offset + len(part)]))
            offset += len(part)
            self._start(job, len(job.task_ids) - 1)

    def _plan_deadline(self, job: BatchJob) -> float | None:
        """Register the batch's predicted GPU cost with the deadline estimator; its deadline."""
        if job.costs and all(c is not None for c in job.costs):
            units = self._units(np.array([c.tokens for c in job.costs], dtype=np.float64))
            self.deadlines.expect(job.seq, float(np.sum(units)) + self._step_units)
        return self.deadlines.deadline(job.seq)

    def _start(self, job: BatchJob, k: int) -> None:
        """Route part ``k`` with its deadline and send it; a server that can't even be configured
        is excluded."""
        cost = job.part_costs[k]
        while True:
            deadline = self.deadlines.deadline(job.seq)
            t0 = time.perf_counter()
            route = self.client.route(job.task_ids[k], cost, job.excluded[k], deadline, self.scheduler)
            self._stats.route_us.append((time.perf_counter() - t0) * 1e6)
            self._stats.decision_us.append(route.decision_us)
            self._stats.reasons[route.reason] += 1
            if deadline is not None:
                self._stats.deadlines.append(deadline)
            # a local server (same host) delivers by shared memory itself; a remote one streams to ours
            deliver = route.delivery_address if route.exec_kind == "remote" else ""
            req = pb.ExecuteRequest(task_id=job.task_ids[k], spec_id=self.spec[0], indices=job.parts[k],
                                    epoch=job.epoch, substitutes=job.substitutes,
                                    on_error=self.on_error, deliver_to=deliver, client_id=self.client.client_id,
                                    attempt=job.attempts[k], deadline_s=deadline or 0.0,
                                    has_deadline=deadline is not None,
                                    predicted_cpu_s=cost.cpu_s if cost is not None else 0.0)
            job.routes[k] = route
            try:
                fut = job.futures[k] = self.client.execute(route.exec_address, self.spec, req)
            except grpc.RpcError as e:
                if e.code() not in TRANSIENT or job.attempts[k] >= self.config.max_resubmits:
                    raise ClusterError(f"cannot send batch {job.position} to {route.exec_address}: "
                                       f"{e.code().name} {e.details()}") from None
                self.client.forget(route.exec_address)
                job.excluded[k].add(route.exec_server_id)
                job.attempts[k] += 1
                self._stats.resubmits += 1
                continue
            # the Coordinator hears of the completion as soon as the reply lands (its load counts)
            fut.add_done_callback(functools.partial(_report_done, self.client, job.task_ids[k],
                                                    route.exec_server_id, time.perf_counter()))
            return

    def _resubmit(self, job: BatchJob, k: int, why: str, *failed: str) -> None:
        """Part ``k`` was lost with a server (or its slab): exclude ``failed`` and send it again.
        Its task id stays, so a late duplicate is recognised and dropped."""
        if job.attempts[k] >= self.config.max_resubmits:
            raise ClusterError(f"batch {job.position} failed after {job.attempts[k]} resubmits: {why}")
        self.client.forget(job.routes[k].exec_address)
        job.excluded[k].update(f for f in failed if f)
        job.attempts[k] += 1
        self._stats.resubmits += 1
        self._start(job, k)

    def _wait(self, job: BatchJob, k: int, stop) -> pb.ExecuteReply:
        """The reply of part ``k``; on a lost server, exclude it and resubmit (bounded)."""
        while True:
            fut = job.futures[k]
            while not fut.done():
                if stop.wait(0.02):
                    raise ClusterError("loader stopped")
            route = job.routes[k]
            try:
                reply = fut.result()
            except grpc.RpcError as e:
                if e.code() not in TRANSIENT or shm.NO_ROOM in (e.details() or ""):  # a full /dev/shm is final
                    raise ClusterError(f"batch {job.position}: {e.code().name} {e.details()}") from None
                remote = route.exec_kind == "remote"
                lost_delivery = remote and "delivery server" in (e.details() or "")
                self._resubmit(job, k, f"{e.code().name} {e.details()}",
                               route.delivery_server_id if lost_delivery else "",
                               "" if lost_delivery else route.exec_server_id)
                continue
            if reply.error_kind == "internal" and "not completed" in reply.error:
                self._resubmit(job, k, reply.error, route.exec_server_id)
                continue
            return reply

    def _collect(self, job: BatchJob, stop):
        copy = self.pin_memory or self.device is not None
        batches, error = [], None
        for k in range(len(job.parts)):
            while True:
                reply = self._wait(job, k, stop)
                try:
                    batch = None if reply.error_kind else self.client.materialize(reply, copy=copy)
                    break
                except FileNotFoundError:  # its producer died and the slab was swept: run it again
                    self._resubmit(job, k, "slab vanished")
            job.taken.add(k)
            self._observe_costs(job, reply)
            self._stats.skipped += len(reply.skipped)
            self._stats.cross_ds_bytes += reply.cross_ds_bytes
            error = error or self.client.error_of(reply)
            if batch is not None:
                batches.append(batch)
        if error is not None:
            raise error
        batch = batches[0] if len(batches) == 1 else merge_batches(batches, rows=[len(p) for p in job.parts])
        if self.pin_memory:
            batch = _map_tensors(batch, _pin)
        if self.device is not None:
            batch = _map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
        return batch

    def _observe_costs(self, job: BatchJob, reply) -> None:
        """Measured decode CPU seconds: the prediction error (stats) and the dataset's online cost
        model (``observe_cost``), whose refined estimates the next requests carry to placement."""
        predicted = {i: c.cpu_s for i, c in zip(job.indices, job.costs) if c is not None}
        observe = getattr(self.dataset, "observe_cost", None)
        for index, seconds in zip(reply.decoded, reply.decode_cpu_s):
            if index in predicted:
                self._stats.cost_errors.add(predicted[index], seconds)
            if observe is not None:
                observe(int(index), float(seconds))

    def _record(self, job: BatchJob) -> None:
        self._stats.batch_ready.append(time.perf_counter() - job.t_dispatch)

    def _cancel(self, job: BatchJob) -> None:
        """Cancel a job's unread requests. The RPCs are left to finish (a gRPC cancel can race a
        reply already on the wire and strand its slab): the servers drop tasks not yet started,
        and every reply that still arrives has its slab released. The Coordinator hears of each
        (``ok=False``), so its outstanding counts come back down. Idempotent."""
        if sys.is_finalizing():  # at exit no RPC can start (its thread never would)
            return
        for k, fut in enumerate(job.futures):
            if fut is None or k in job.taken or fut in job.cancelled:
                continue
            job.cancelled.add(fut)  # per future: a resubmission made after an earlier cancel is cancelled too
            if not fut.done():
                self.client.cancel(job.routes[k].exec_address, [job.task_ids[k]])
                with self._unread_lock:
                    self._unread.add(fut)  # close() waits for these, or their slabs would be stranded
            fut.add_done_callback(self._release_reply)

    def _release_reply(self, fut) -> None:
        with self._unread_lock:
            self._unread.discard(fut)
        try:
            reply = fut.result()
        except Exception:
            return
        if reply.batch.slab.segment:
            self.client.reader.release({"segment": reply.batch.slab.segment, "generation": reply.batch.slab.generation})


def _report_done(client: ClusterClient, task_id: int, server_id: str, t0: float, fut) -> None:
    """A request's reply landed (or it failed): tell the Coordinator, fire and forget."""
    if sys.is_finalizing():
        return
    try:
        ok = not fut.cancelled() and fut.exception() is None and not fut.result().error_kind
    except Exception:
        ok = False
    client.report(task_id, server_id, time.perf_counter() - t0, ok)


def _fan_out(indices: list[int], costs: list, deadline_s: float) -> list[list[int]]:
    """Split a batch whose predicted CPU time exceeds its deadline into contiguous parts of about
    equal cost (at most one per sample), so several workers prepare it at once; the merge of the
    parts is exact for the collates that allow it. Unknown costs: no split."""
    if len(indices) < 2 or any(c is None for c in costs):
        return [indices]
    total = sum(c.cpu_s for c in costs)
    if total <= deadline_s or total <= 0:
        return [indices]
    k = min(len(indices), max(2, math.ceil(total / max(deadline_s, 1e-3))))
    parts, current, acc = [], [], 0.0
    for i, c in zip(indices, costs):
        current.append(i)
        acc += c.cpu_s
        if acc >= total * (len(parts) + 1) / k and len(parts) < k - 1:
            parts.append(current)
            current = []
    if current:
        parts.append(current)
    return parts


def _weak(method):
    """A callable that calls ``method`` while its object lives (and raises ReferenceError after)."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        if bound is None:
            raise ReferenceError("the DistributedDataLoader is gone")
        return bound(*args, **kwargs)

    return call


class _LoaderIter:
    """One pass over the epoch. Like torch's iterator, an error at one batch (``SampleError``)
    does not end the pass; dropping the iterator early (``break``) cancels work in flight."""

    def __init__(self, loader: DistributedDataLoader, iteration: int):
        self._loader, self._iteration, self._done = loader, iteration, False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        ld = self._loader
        if ld._closed:
            raise RuntimeError("this DistributedDataLoader is closed")
        if ld._iteration != self._iteration:
            raise RuntimeError("a newer iteration of this DistributedDataLoader began (iter() was called again); "
                               "this iterator has ended")
        if ld._started != self._iteration:
            ld._begin(self._iteration)
        ld.deadlines.asked()  # the window of the batch it computed (if any) ends here
        t0 = time.perf_counter()
        try:
            batch = next(ld._root)
        except StopIteration:
            self._finish(completed=True)  # the end of the epoch is not an input wait
            raise
        except BaseException:
            ld._stats.input_wait.append(time.perf_counter() - t0)
            raise
        ld._stats.input_wait.append(time.perf_counter() - t0)
        ld._stats.batches += 1
        ld.deadlines.yielded(ld._root.last_seq)
        if ld._root.get_state()[ShardBatches.YIELDED] >= len(ld) and ld._root.read_end():
            # the epoch is complete: a trainer may stop after len batches without asking for more, and
            # the requests already running ahead for the next epoch must survive for it to adopt
            self._finish(completed=True)
        return batch

    def _finish(self, completed: bool) -> None:
        ld = self._loader
        if self._done or ld._iteration != self._iteration or ld._started != self._iteration or ld._closed:
            self._done = True  # superseded, or never started (nothing to stop)
            return
        self._done = True
        if completed:  # requests for the next pass run on (adopted by it, or cancelled)
            ld._position = len(ld)
            return
        ld._position = ld._root.get_state()[ShardBatches.YIELDED]
        ld._root.shutdown()  # cancels what is in flight and frees its slabs

    def __del__(self):
        if sys.is_finalizing():  # the process is exiting: its clusters stop and sweep; no RPC can start
            return
        try:
            self._finish(completed=False)
        except Exception:
            pass


class _EpochSampler:
    """``loader.sampler``: what a trainer may call on a DataLoader's ``DistributedSampler``."""

    def __init__(self, loader: DistributedDataLoader):
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self._loader.epoch

    def __len__(self) -> int:  # this rank's samples per epoch, as DistributedSampler's len
        return len(self._loader._batches.sampler)


def _sum_costs(costs):
    costs = [c for c in costs if c is not None]
    if not costs:
        return None
    from ..descriptors import CostProfile

    return CostProfile(sum(c.cpu_s for c in costs), sum(c.io_bytes for c in costs), sum(c.out_bytes for c in costs),
                       sum(c.tokens for c in costs), costs[0].profile)


def _pin(t: torch.Tensor) -> torch.Tensor:
    if torch.cuda.is_available():
        return t.pin_memory()
    warnings.warn("pin_memory=True but no accelerator is available: batches stay in pageable memory", stacklevel=3)
    return t


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj
