"""What a rank asks for, as ``torchdata.nodes``: ShardBatches (or PlannedBatches) -> CostTagger.

``ShardBatches`` yields this rank's index batches exactly as a torch DataLoader with
``DistributedSampler`` would (``planning.sampling``); ``PlannedBatches`` recomposes each window of
global steps with the Tier-1 token planner (every rank plans the same window identically, no
communication); ``CostTagger`` turns each batch into a ``Task`` with its samples' ``CostProfile``s
(never decoding) and deterministic substitutes. State is what means something to a user: the
epoch and the batches yielded.
"""

from __future__ import annotations

import numpy as np
from torchdata.nodes import BaseNode

from helix_core.data.contract import Costed
from helix_core.planning.balance import fill_unknown_costs
from helix_core.planning.sampling import rank_batches, rank_indices, steps
from helix_core.wire.messages import Task

__all__ = ["CostTagger", "PlannedBatches", "ShardBatches"]


class ShardBatches(BaseNode):
    """This rank's batches of sample indices for one epoch (``DistributedSampler`` + batching)."""

    EPOCH, YIELDED = "epoch", "batches_yielded"

    def __init__(
        self, num_samples: int, batch_size: int, rank: int, world_size: int, shuffle: bool, seed: int, drop_last: bool
    ):
        super().__init__()
        self.num_samples, self.batch_size, self.rank, self.world_size = num_samples, batch_size, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self._batches, self._pos = 0, [], 0

    @property
    def samples_per_epoch(self) -> int:
        """This rank's samples per epoch (``len`` of its ``DistributedSampler``)."""
        n, w = self.num_samples, self.world_size
        return n // w if self.drop_last and n % w else -(-n // w)

    def __len__(self) -> int:
        n = self.samples_per_epoch
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def shard(self, epoch: int) -> list[int]:
        return rank_indices(
            self.num_samples, self.rank, self.world_size, self.shuffle, self.seed, epoch, self.drop_last
        )

    def reset(self, initial_state: dict | None = None):
        super().reset(initial_state)
        if initial_state is not None:
            self.epoch = int(initial_state[self.EPOCH])
        self._batches = rank_batches(
            self.num_samples,
            self.batch_size,
            self.rank,
            self.world_size,
            self.shuffle,
            self.seed,
            self.epoch,
            self.drop_last,
        )
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

    The epoch's global steps are the sampler's (rank r's batch s is what ``DistributedSampler``
    gives rank r at step s); each window of ``planner.window`` steps (counted from the start of the
    epoch; the last may be shorter) is recomposed by ``planner.plan_window`` from the samples' GPU
    costs. ``costs(indices) -> (units, buckets)``: GPU cost units per sample (NaN when unknown)
    and profile buckets (unknown costs are planned at their bucket's median), identical on every
    rank. A window is planned when this rank first reaches it, so resuming mid-window lands on
    exactly the batch the uninterrupted run would have yielded.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        planner,
        costs,
    ):
        super().__init__(num_samples, batch_size, rank, world_size, shuffle, seed, drop_last)
        self.planner, self.costs = planner, costs
        self._steps: list | None = None
        self._plan: tuple[int, list] | None = None  # (window index, plan) of the window last planned

    def reset(self, initial_state: dict | None = None):
        super().reset(initial_state)
        self._steps, self._plan = None, None

    def window_plan(self, w: int) -> list:
        """``plan[step in window][rank] -> indices`` of window ``w`` of this epoch."""
        if self._plan is None or self._plan[0] != w:
            if self._steps is None:
                self._steps = steps(
                    self.num_samples,
                    self.batch_size,
                    self.world_size,
                    self.shuffle,
                    self.seed,
                    self.epoch,
                    self.drop_last,
                )
            window = [self._steps[s] for s in self.planner.windows(len(self))[w]]
            flat = np.fromiter((i for step in window for batch in step for i in batch), dtype=np.int64)
            units, buckets = self.costs(flat)
            by_index = dict(zip(flat.tolist(), fill_unknown_costs(units, buckets).tolist()))
            self._plan = (w, self.planner.plan_window(window, by_index.__getitem__))
        return self._plan[1]

    def next(self) -> tuple[int, list[int]]:
        if self._pos >= len(self._batches):
            raise StopIteration
        w = self._pos // self.planner.window
        batch = self.window_plan(w)[self._pos - w * self.planner.window][self.rank]
        self._pos += 1
        return self._pos - 1, list(batch)


class CostTagger(BaseNode):
    """Makes each batch a ``Task``: ``CostProfile``s from the dataset (``estimate_cost``: its
    table, vectorised, else a metadata probe) and deterministic substitutes from the same rank's
    shard (for ``on_error="skip"``)."""

    def __init__(self, source: ShardBatches, dataset, seed: int, microbatch_size: int | None, substitutes: int = 8):
        super().__init__()
        self.source, self.dataset, self.seed = source, dataset, seed
        self.microbatch_size, self.n_subs = microbatch_size, substitutes
        self._costed = isinstance(dataset, Costed)  # once: a Protocol check is slow per sample
        self._shard: list[int] = []

    def reset(self, initial_state: dict | None = None):
        super().reset(initial_state)
        self.source.reset(initial_state)
        self._shard = self.source.shard(self.source.epoch)

    def _cost(self, i: int):
        if not self._costed:
            return None
        try:
            return self.dataset.estimate_cost(i)
        except Exception:  # a bad sample fails when fetched, where skip mode can replace it
            return None

    def next(self) -> Task:
        position, indices = self.source.next()
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.source.epoch, position])
        subs = [self._shard[int(k)] for k in rng.integers(0, len(self._shard), size=self.n_subs)] if self._shard else []
        return Task(
            position,
            list(indices),
            [self._cost(i) for i in indices],
            subs,
            epoch=self.source.epoch,
            microbatch_size=self.microbatch_size,
        )

    def get_state(self) -> dict:
        return self.source.get_state()
