"""The client's ``torchdata.nodes`` graph: ShardBatches (or PlannedBatches) -> CostTagger -> Dispatch.

``ShardBatches`` yields this rank's index batches exactly as a torch DataLoader with
``DistributedSampler`` would; ``PlannedBatches`` recomposes each window of global steps with the
Tier-1 token planner (every rank plans the same window identically, no communication); ``CostTagger`` attaches each sample's ``CostProfile`` (never
decoding); ``Dispatch`` runs a sender thread (requests ahead, bounded by ``prefetch_depth``) and a
fetcher thread (results back in task order), so ``next()`` blocks only when nothing is ready.
State is what means something to a user: the epoch and the batches yielded.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from torch.utils.data import DistributedSampler
from torchdata.nodes import BaseNode

__all__ = ["BatchJob", "CostTagger", "Dispatch", "PlannedBatches", "ShardBatches"]


class _Len:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class ShardBatches(BaseNode):
    """This rank's batches of sample indices for one epoch (``DistributedSampler`` + batching)."""

    EPOCH, YIELDED = "epoch", "batches_yielded"

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, shuffle: bool, seed: int,
                 drop_last: bool):
        super().__init__()
        self.sampler = DistributedSampler(_Len(num_samples), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last)
        self.batch_size, self.drop_last = batch_size, drop_last
        self.epoch, self._batches, self._pos = 0, [], 0

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def shard(self, epoch: int) -> list[int]:
        self.sampler.set_epoch(epoch)
        return list(self.sampler)

    def reset(self, initial_state: dict | None = None):
        super().reset(initial_state)
        if initial_state is not None:
            self.epoch = int(initial_state[self.EPOCH])
        idx = self.shard(self.epoch)
        b = self.batch_size
        self._batches = [idx[i:i + b] for i in range(0, len(idx), b)]
        if self.drop_last and self._batches and len(self._batches[-1]) < b:
            self._batches.pop()
        self._pos = int(initial_state[self.YIELDED]) if initial_state is not None else 0

    def next(self) -> tuple[int, list[int]]:
        if self._pos >= len(self._batches):
            raise StopIteration
        self._pos += 1
        return self._pos - 1, self._batches[self._pos - 1]

    def get_state(self) -> dict:
        return {self.EPOCH: self.epoch, self.YIELDED: self._pos}


class PlannedBatches(ShardBatches):
    """This rank's batches under Tier-1 token planning (``balance="tokens"``).

    The epoch's global steps are the samplers' (rank r's batch s is what ``DistributedSampler``
    gives rank r at step s); each window of ``planner.window`` steps (counted from the start of the
    epoch; the last may be shorter) is recomposed by ``planner.plan_window`` from the samples' GPU
    costs. ``costs(indices) -> (units, buckets)``: GPU cost units per sample (NaN when unknown)
    and profile buckets (unknown costs are planned at their bucket's median), identical on every
    rank. A window is planned when this rank first reaches it, so resuming mid-window lands on
    exactly the batch the uninterrupted run would have yielded.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, shuffle: bool, seed: int,
                 drop_last: bool, planner, costs):
        super().__init__(num_samples, batch_size, rank, world_size, shuffle, seed, drop_last)
        self.planner, self.costs, self.rank = planner, costs, rank
        self._samplers = [DistributedSampler(_Len(num_samples), num_replicas=world_size, rank=r, shuffle=shuffle,
                                             seed=seed, drop_last=drop_last) for r in range(world_size)]
        self._shards: list[list[int]] = []
        self._plan: tuple[int, list] | None = None  # (window index, plan) of the window last planned

    def reset(self, initial_state: dict | None = None):
        super().reset(initial_state)
        self._shards, self._plan = [], None

    def _steps(self, window: range) -> list[list[list[int]]]:
        if not self._shards:
            for sampler in self._samplers:
                sampler.set_epoch(self.epoch)
            self._shards = [list(sampler) for sampler in self._samplers]
        b = self.batch_size
        return [[shard[s * b:(s + 1) * b] for shard in self._shards] for s in window]

    def window_plan(self, w: int) -> list:
        """``plan[step in window][rank] -> indices`` of window ``w`` of this epoch."""
        if self._plan is None or self._plan[0] != w:
            window = self.planner.windows(len(self))[w]
            steps = self._steps(window)
            flat = np.fromiter((i for step in steps for batch in step for i in batch), dtype=np.int64)
            units, buckets = self.costs(flat)
            from ..planning.batching import fill_unknown_costs

            units = fill_unknown_costs(units, buckets)
            by_index = dict(zip(flat.tolist(), units.tolist()))
            self._plan = (w, self.planner.plan_window(steps, by_index.__getitem__))
        return self._plan[1]

    def next(self) -> tuple[int, list[int]]:
        if self._pos >= len(self._batches):
            raise StopIteration
        w = self._pos // self.planner.window
        batch = self.window_plan(w)[self._pos - w * self.planner.window][self.rank]
        self._pos += 1
        return self._pos - 1, list(batch)


@dataclass
class BatchJob:
    """One logical batch in flight: its position in the epoch, its parts (microbatch requests) and
    what came back. Times from ``time.perf_counter``."""

    position: int
    parts: list[list[int]]
    costs: list  # CostProfile (or None) of each sample, in batch order
    substitutes: list[int]
    part_costs: list = field(default_factory=list)  # summed CostProfile of each part
    epoch: int = 0
    seq: int = 0  # order among every batch this loader yields, across epochs (the deadline clock's position)
    task_ids: list[int] = field(default_factory=list)
    futures: list = field(default_factory=list)
    routes: list = field(default_factory=list)
    excluded: list = field(default_factory=list)
    attempts: list = field(default_factory=list)
    taken: set = field(default_factory=set)  # parts whose reply was read (their slab is the batch's)
    cancelled: set = field(default_factory=set)  # futures already given up (cancel is idempotent per future)
    t_dispatch: float = 0.0
    error: BaseException | None = None

    @property
    def indices(self) -> list[int]:
        """The batch's sample indices, in order."""
        return [i for part in self.parts for i in part]


class CostTagger(BaseNode):
    """Attaches ``CostProfile``s (from the dataset's table, vectorised, else a metadata probe) and
    deterministic substitutes from the same rank's shard (for ``on_error="skip"``)."""

    def __init__(self, source: ShardBatches, dataset, seed: int, microbatch_size: int | None, substitutes: int = 8):
        super().__init__()
        self.source, self.dataset, self.seed = source, dataset, seed
        self.microbatch_size, self.n_subs = microbatch_size, substitutes
        self._shard: list[int] = []

    def reset(self, initial_state: dict | None = None):
        super().reset(initial_state)
        self.source.reset(initial_state)
        self._shard = self.source.shard(self.source.epoch)

    def _cost(self, i: int):
        fn = getattr(self.dataset, "estimate_cost", None)
        if fn is None:
            return None
        try:
            return fn(i)
        except Exception:  # a bad sample fails when fetched, where skip mode can replace it
            return None

    def next(self) -> BatchJob:
        position, indices = self.source.next()
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.source.epoch, position])
        subs = [self._shard[int(k)] for k in rng.integers(0, len(self._shard), size=self.n_subs)] if self._shard else []
        m = self.microbatch_size or len(indices)
        parts = [indices[i:i + m] for i in range(0, len(indices), m)]
        return BatchJob(position, parts, [self._cost(i) for i in indices], subs, epoch=self.source.epoch)

    def get_state(self) -> dict:
        return self.source.get_state()


class _Run:
    """The threads and queues of a run of epochs. Threads get their run as an argument: a thread
    that outlives ``shutdown`` (a slow RPC) only ever sees its own, stopped run, never the next one's.

    ``order`` and ``out`` hold an epoch's jobs / results, then ``END``, then the next epoch's (sent
    ahead), and so on; ``epochs`` lists the epochs whose jobs follow the current one's."""

    def __init__(self, prefetch_depth: int, seq: int):
        self.stop = threading.Event()
        self.slots = threading.Semaphore(prefetch_depth)  # plain: a stop wakes the sender with one release
        self.order: queue.Queue = queue.Queue()
        self.out: queue.Queue = queue.Queue()
        self.inflight: list[BatchJob] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.seq = seq  # the next job's sequence number
        self.epochs: collections.deque = collections.deque()  # epochs sent ahead, in order
        self.ended = False  # the current epoch's END was read: next() stops until a reset adopts the next

    def wake(self) -> None:
        """Stop: the threads see it at once, not at their next poll."""
        self.stop.set()
        self.slots.release()
        self.order.put(_STOP)


_END, _STOP = "end-of-epoch", "stop"  # markers in a run's queues


class Dispatch(BaseNode):
    """Sender / fetcher threads around a ``submit(job)`` / ``collect(job) -> batch`` pair.

    ``submit`` starts a job's requests; ``collect`` waits for them (resubmitting on server loss) and
    returns the batch or raises; ``cancel(job)`` gives up a job's unread requests (idempotent). At
    most ``prefetch_depth`` jobs are in flight or waiting.

    Requests run ahead across epoch boundaries: once an epoch's last job is sent, the sender goes on
    with the jobs of ``next_epoch(epoch)`` (None: it stops there), as slots free up. A ``reset`` to
    exactly that epoch's start (the usual ``set_epoch(e + 1); iter()``) carries on with the same
    threads, so an epoch's first batches are neither decoded cold nor delayed by a thread restart;
    any other ``reset`` cancels what was sent ahead and starts afresh.
    """

    YIELDED, EPOCH = ShardBatches.YIELDED, ShardBatches.EPOCH

    def __init__(self, source: CostTagger, submit, collect, cancel, prefetch_depth: int, on_batch=None,
                 next_epoch=lambda epoch: epoch + 1):
        super().__init__()
        self.source, self.submit, self.collect, self.cancel = source, submit, collect, cancel
        self.prefetch_depth, self.on_batch, self.next_epoch = prefetch_depth, on_batch, next_epoch
        self._run: _Run | None = None
        self._yielded, self._epoch = 0, 0
        self._seq = 0  # jobs yielded over this node's life
        self.last_seq = -1  # sequence number of the job ``next`` returned last

    @property
    def running(self) -> bool:
        """A run's threads are up (between ``reset`` and ``shutdown``)."""
        return self._run is not None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def reset(self, initial_state: dict | None = None):
        super().reset(initial_state)
        run = self._run
        if run is not None and run.ended and initial_state is not None and run.epochs \
                and int(initial_state.get(self.YIELDED, -1)) == 0 \
                and int(initial_state.get(self.EPOCH, -1)) == run.epochs[0]:
            with run.lock:  # adopt what was sent ahead: same threads, same queues
                self._epoch, self._yielded = run.epochs.popleft(), 0
                run.ended = False
            return
        self.shutdown()
        self.source.reset(initial_state)
        st = self.source.get_state()
        self._epoch, self._yielded = st[self.EPOCH], st[self.YIELDED]
        run = self._run = _Run(self.prefetch_depth, self._seq)
        run.threads = [threading.Thread(target=self._send, args=(run,), name="helix-sender", daemon=True),
                       threading.Thread(target=self._fetch, args=(run,), name="helix-fetcher", daemon=True)]
        for t in run.threads:
            t.start()

    def shutdown(self) -> None:
        """Stop both threads, cancel requests in flight (sent ahead too) and drop finished batches
        (their slabs are released when the dropped tensors are collected)."""
        run, self._run = self._run, None
        if run is None:
            return
        run.wake()
        for t in run.threads:
            if t is not threading.current_thread():  # the GC may close a dropped loader on one of its threads
                t.join(timeout=10.0)
        run.threads = []
        with run.lock:
            jobs, run.inflight = run.inflight, []
        for job in jobs:
            self.cancel(job)
        while not run.out.empty():
            run.out.get_nowait()

    # ---- threads -------------------------------------------------------------------------------------
    @staticmethod
    def _acquire(run: _Run) -> bool:
        while not run.stop.is_set():
            if run.slots.acquire(timeout=0.1):
                return not run.stop.is_set()
        return False

    def _send(self, run: _Run) -> None:
        while self._acquire(run):
            try:
                job = self.source.next()
            except StopIteration:
                run.slots.release()  # acquired for nothing
                run.order.put(_END)
                try:  # go on with the next epoch's jobs
                    epoch = self.next_epoch(self.source.get_state()[self.EPOCH])
                    if epoch is None:
                        return
                    self.source.reset({self.EPOCH: int(epoch), self.YIELDED: 0})
                except BaseException:
                    return
                with run.lock:
                    run.epochs.append(int(epoch))
                continue
            except BaseException as e:  # errors travel as values to the consumer
                run.order.put(e)
                return
            job.t_dispatch = time.perf_counter()
            job.seq, run.seq = run.seq, run.seq + 1
            with run.lock:
                if run.stop.is_set():
                    return
                run.inflight.append(job)
            try:
                self.submit(job)
            except BaseException as e:
                job.error = e
            run.order.put(job)

    def _fetch(self, run: _Run) -> None:
        while not run.stop.is_set():
            try:
                job = run.order.get(timeout=0.1)
            except queue.Empty:
                continue
            if job is _STOP:
                return
            if job is _END or isinstance(job, BaseException):
                run.out.put(job)
                if job is _END:
                    continue
                return
            try:
                item = job.error if job.error is not None else self.collect(job, run.stop)
            except BaseException as e:
                item = e
            if run.stop.is_set() or isinstance(item, BaseException):
                self.cancel(job)  # what it left unread (other parts of a failed batch, or a stop mid-collect)
            with run.lock:
                if job in run.inflight:
                    run.inflight.remove(job)
            if self.on_batch is not None and not isinstance(item, BaseException):
                self.on_batch(job)
            run.out.put(item)
            item = job = None  # an error's traceback holds this frame: don't let it hold the error back (a cycle)

    # ---- BaseNode contract --------------------------------------------------------------------------
    def next(self):
        run = self._run
        if run is None:
            raise RuntimeError("this iteration was stopped (the loader was closed or a new iteration began)")
        if run.ended:
            raise StopIteration
        while True:
            try:
                item = run.out.get(timeout=0.1)
                break
            except queue.Empty:
                if not any(t.is_alive() for t in run.threads) and run.out.empty():
                    raise RuntimeError("Helix dispatch threads stopped unexpectedly") from None
        if item is _END:
            run.ended = True
            raise StopIteration
        run.slots.release()
        self._yielded += 1
        self.last_seq = self._seq
        self._seq += 1
        if isinstance(item, BaseException):
            raise item
        return item

    def read_end(self, timeout: float = 2.0) -> bool:
        """After an epoch's last batch: take its end marker (it follows within moments), so a
        ``reset`` to the next epoch adopts what was sent ahead even when the consumer never asks
        for more. False when anything else comes next (it stays queued) or nothing within ``timeout``."""
        run = self._run
        if run is None:
            return False
        deadline = time.monotonic() + timeout
        while not run.ended:
            with run.out.mutex:
                head = run.out.queue[0] if run.out.queue else None
            if head is _END:
                run.out.get_nowait()
                run.ended = True
            elif head is not None or time.monotonic() > deadline or run.stop.is_set():
                return False
            else:
                time.sleep(0.0005)
        return True

    def get_state(self) -> dict:
        return {self.EPOCH: self._epoch, self.YIELDED: self._yielded}
