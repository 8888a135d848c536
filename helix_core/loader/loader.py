"""``DistributedDataLoader``: the DataLoader programming model on a Helix cluster.

With ``balance=None`` (the default) and torch ``default_collate`` it yields exactly the batches of
a torch ``DataLoader`` with ``DistributedSampler(shuffle, seed)`` and that ``collate_fn`` — while
decoding runs in a shared pool of DataServer workers, requests run ahead of the training loop with
the rank's deadline attached, and batches arrive through shared memory. Placement (``scheduler``)
never changes what a batch holds; ``balance="tokens"`` (Tier 1) recomposes each window of global
steps so that ranks carry equal GPU cost.

The path of a batch: ``plan`` (which samples, what they cost) -> ``dispatch`` (send ahead, fetch
in order) -> ``requests`` (route, execute, resubmit, merge) -> ``transport`` (gRPC, shared memory).
This module is the torch surface and the sole owner of the epoch and the position in it.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import warnings

import torch

from helix_core.config import ClusterConfig
from helix_core.data.collate import pad_collate
from helix_core.data.specs import make_spec
from helix_core.launch.embedded import acquire_embedded, release_embedded
from helix_core.loader.cluster_client import ClusterClient
from helix_core.loader.costing import PlanCosts, gpu_units
from helix_core.loader.deadline import DeadlineEstimator
from helix_core.loader.dispatch import Dispatch
from helix_core.loader.iterator import EpochSampler, LoaderIter
from helix_core.loader.options import LoaderOptions
from helix_core.loader.plan import CostTagger, PlannedBatches, ShardBatches
from helix_core.loader.requests import Requests
from helix_core.planning.batching import TokenPlanner
from helix_core.telemetry import LoaderStats
from helix_core.tier2.rank import Tier2, rebalance_group
from helix_core.tier2.rebalance import Rebalance

__all__ = ["DistributedDataLoader"]

_EXACT_MERGE = (None, torch.utils.data.default_collate, pad_collate)  # collates whose microbatch merge is exact


def _option(name: str) -> property:
    """A read-only loader attribute that is its ``LoaderOptions`` field ``name``."""
    return property(lambda self: getattr(self.options, name), doc=f"``options.{name}``")


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class DistributedDataLoader:
    """Iterate ``dataset`` in batches prepared by a Helix cluster.

    Arguments follow torch's ``DataLoader`` / ``DistributedSampler`` where they overlap
    (``batch_size``, ``shuffle``, ``seed``, ``drop_last``, ``collate_fn``, ``pin_memory``), plus:
    ``coordinator`` ("host:port"; default ``HELIX_COORDINATOR``, else an embedded LocalCluster),
    ``token`` (default ``HELIX_TOKEN``, else the one its Coordinator left for this user),
    ``prefetch_depth`` (batches requested ahead), ``microbatch_size`` (split each batch into requests
    of this many samples, merged — padded — before it is yielded), ``on_error`` ("raise":
    ``SampleError`` at the batch; "skip": replaced from this rank's shard, counted in ``stats()["skipped"]``), ``device`` (copy batches there, non-blocking), ``num_workers`` (worker
    processes of an embedded cluster), ``tls`` (a ``hx.Tls`` for every channel; default
    ``HELIX_TLS_CERT`` / ``_KEY`` / ``_CA``, else none).

    Co-scheduling: ``scheduler`` names the placement policy of every request ("deadline": paper
    Eq. 1 against this rank's deadline; "least-request"); ``balance="tokens"`` plans each
    ``window`` of global steps so that every rank carries the same predicted GPU cost
    (``gpu_cost``: a model family, a ``GpuCost`` or a callable of token counts; default the
    dataset's family). Deadlines come from the time between ``next()`` calls, or from
    ``report_step_time(seconds)``. ``rebalance`` (an ``hx.Rebalance`` or a dict of its keys, the
    paper's ``load_balance_config``): Tier 2 — once a batch is decoded, the ranks of its group trade
    samples of the same global step by their measured features (each keeps its batch size).

    ``options``: the plain options above, checked and frozen (a ``LoaderOptions``; each is also an
    attribute by its own name); ``rank`` / ``world_size``: as resolved.
    """

    def __init__(
        self,
        dataset,
        batch_size: int = 1,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        coordinator: str | None = None,
        token: str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn=None,
        prefetch_depth: int = 4,
        scheduler: str = "deadline",
        balance: str | None = None,
        window: int = 8,
        gpu_cost=None,
        microbatch_size: int | None = None,
        on_error: str = "raise",
        pin_memory: bool = False,
        device=None,
        num_workers: int | None = None,
        config: ClusterConfig | None = None,
        ddl_tolerance_s: float = 0.010,
        tls=None,
        rebalance=None,
    ):
        self.options = opts = LoaderOptions(
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            coordinator=coordinator,
            token=token,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            prefetch_depth=prefetch_depth,
            scheduler=scheduler,
            balance=balance,
            window=window,
            microbatch_size=microbatch_size,
            on_error=on_error,
            pin_memory=pin_memory,
            num_workers=num_workers,
            ddl_tolerance_s=ddl_tolerance_s,
        )
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {type(collate_fn).__name__}")
        if config is not None and not isinstance(config, ClusterConfig):
            raise TypeError(f"config must be a hx.ClusterConfig or None, got {type(config).__name__}")
        rebalance = Rebalance.of(rebalance)
        if rebalance is not None and collate_fn not in _EXACT_MERGE:
            raise ValueError(
                f"rebalance= needs collate_fn=None (default_collate) or hx.pad_collate: the rows of "
                f"{collate_fn!r}'s batches cannot be told apart to move samples between ranks"
            )
        r, w = _default_rank_world()
        self.rank = r if opts.rank is None else opts.rank  # the options as given; these as resolved
        self.world_size = w if opts.world_size is None else opts.world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.dataset, self.collate_fn = dataset, collate_fn
        self.device = torch.device(device) if device is not None else None
        self.config = config or ClusterConfig()
        self.deadlines = DeadlineEstimator()
        group = rebalance_group(rebalance, self.rank, self.world_size)
        self._stats = LoaderStats(opts.ddl_tolerance_s)
        units, step_units = gpu_units(dataset, gpu_cost)
        shard = (len(dataset), opts.batch_size, self.rank, self.world_size, opts.shuffle, opts.seed, opts.drop_last)
        if opts.balance == "tokens":  # built before any cluster: a dataset it can't cost fails here, holding nothing
            self._batches = PlannedBatches(
                *shard, TokenPlanner(self.world_size, opts.window), PlanCosts(dataset, units)
            )
        else:
            self._batches = ShardBatches(*shard)
        self._embedded, self.cluster = False, None  # cluster: the LocalCluster this process started for it
        address = opts.coordinator or os.environ.get("HELIX_COORDINATOR")
        if address is None:  # shared by this process's loaders (train and val); one per job
            self.cluster, address, token, job_tls = acquire_embedded(self.world_size, opts.num_workers, self.config)
            tls = tls if job_tls is None else job_tls
            self._embedded = True
        self._closed = True  # until construction succeeded (close() must not touch what isn't there)
        try:
            self.client = ClusterClient(address, token, self.config, self.rank, self.world_size, tls=tls)
            try:
                spec = make_spec(
                    dataset, collate_fn, self.client.pickle_allowed, feature_fn=rebalance.feature_fn if group else None
                )
                pad = opts.microbatch_size is not None or collate_fn is pad_collate
                tier2 = (
                    Tier2(self.client, rebalance, group, spec[0], units, self.deadlines, self._stats, pad, step_units)
                    if group
                    else None
                )
            except BaseException:
                self.client.close()
                raise
        except BaseException:
            if self._embedded:
                release_embedded()
            raise
        self.coordinator = address  # the "host:port" of the Coordinator this loader uses
        self.cluster_id = self.client.cluster_id  # names the cluster's shared-memory segments: helix-<id>-*
        # the request path holds no reference back to the loader: one dropped without close()
        # closes at once, not at some later cyclic collection
        self._requests = Requests(
            client=self.client,
            spec=spec,
            config=self.config,
            stats=self._stats,
            deadlines=self.deadlines,
            units=units,
            step_units=step_units,
            scheduler=opts.scheduler,
            on_error=opts.on_error,
            fanout=opts.microbatch_size is None and collate_fn in _EXACT_MERGE,
            dataset=dataset,
            copy=opts.pin_memory or self.device is not None,
            task_ids=itertools.count(self.client.task_id_base + 1),
            pad=pad,
            tier2=tier2,
        )
        self._tier2 = tier2
        self._root = Dispatch(
            CostTagger(self._batches, dataset, opts.seed, opts.microbatch_size),
            self._requests,
            opts.prefetch_depth,
            self.config.execute_timeout_s + 2 * self.config.rpc_timeout_s,
        )
        self._epoch, self._position, self._resume = 0, 0, 0  # position: batches of the epoch yielded
        self._iteration, self._started = 0, 0
        self._closed = False

    # the options by their own names, as torch's DataLoader has them (trainers and tests read them)
    batch_size = _option("batch_size")
    shuffle = _option("shuffle")
    seed = _option("seed")
    drop_last = _option("drop_last")
    prefetch_depth = _option("prefetch_depth")
    scheduler = _option("scheduler")
    balance = _option("balance")
    window = _option("window")
    microbatch_size = _option("microbatch_size")
    on_error = _option("on_error")
    pin_memory = _option("pin_memory")

    # ---- the torch DataLoader surface ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._batches)

    def set_epoch(self, epoch: int) -> None:
        """Like ``DistributedSampler.set_epoch``: the shuffle order of the next iteration. Setting
        the epoch a loaded state is in keeps its resume point (the usual resume loop does that).
        A loader whose epochs are set runs ahead into the next epoch (a validation loader, whose
        epoch never moves, does not)."""
        self._root.run_ahead = True
        if int(epoch) != self._epoch:
            self._epoch, self._resume, self._position = int(epoch), 0, 0

    def __iter__(self) -> LoaderIter:
        if self._closed:
            raise RuntimeError("this DistributedDataLoader is closed")
        self._iteration += 1  # starts no work: the epoch and resume point are read at the first next()
        return LoaderIter(self, self._iteration)

    def _begin(self, iteration: int) -> None:
        """The first ``next()`` of an iteration: request its epoch's batches (adopting requests
        already running ahead for exactly that epoch and position)."""
        self._position, self._resume = self._resume, 0  # a resume point applies to one iteration
        self._root.reset({ShardBatches.EPOCH: self._epoch, ShardBatches.YIELDED: self._position})
        self._started = iteration

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) pass iterates."""
        return self._epoch

    batch_sampler = None  # batches are planned by the loader itself (trainers probe this attribute)

    @property
    def sampler(self) -> EpochSampler:
        """A sampler-like view (``set_epoch``, ``len``) for trainers that call
        ``loader.sampler.set_epoch(e)`` at each epoch's start, as Lightning does."""
        return EpochSampler(self)

    @property
    def running(self) -> bool:
        """Requests are in flight or running ahead (an iteration started and was not stopped)."""
        return not self._closed and self._root.running

    def state_dict(self) -> dict:
        """Rank-independent resume point: batches yielded to the user (not requests in flight)."""
        return {
            "epoch": self._epoch,
            "seed": self.seed,
            "batches_yielded": int(self._resume or self._position),
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "num_samples": len(self.dataset),
            "balance": self.balance,
            "window": self.window if self.balance else None,
        }

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
        if self._tier2 is not None:  # a round of the run before (a rank not yet resumed) is not ours
            self._tier2.resume(self._epoch, self._position)

    def report_step_time(self, seconds: float) -> None:
        """The trainer's measured GPU window of the batch being computed (seconds; e.g. CUDA-event
        timing from ``on_train_batch_start`` to ``on_train_batch_end``). Without it the loader
        measures the time between a ``next()`` returning and the next ``next()`` call."""
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not seconds >= 0
            or seconds == float("inf")
        ):
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
        out["dispatch_runs"] = self._root.runs  # send/fetch threads started: an adopting epoch starts none
        out["step_times_reported"] = self.deadlines.reported  # report_step_time calls (a trainer's windows)
        return out

    def batch_ready_s(self) -> list[float]:
        """Batch-ready latency of each batch so far, in order (seconds from dispatch to complete)."""
        return list(self._stats.batch_ready)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._root.shutdown()
        self._requests.drain(self.config.rpc_timeout_s)  # running tasks finish within a batch; their slabs return
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

    def _deliver(self, batch):
        if self.pin_memory:
            batch = _map_tensors(batch, _pin)
        if self.device is not None:
            batch = _map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
        return batch


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
