"""Tier-2 rounds (pure; the clock is injected): which materialized samples are rebalanced together.

A group's DataServers buffer the samples they materialize for the group's ranks. A round closes
when it holds ``buffer_size`` samples or ``timeout_s`` after its first one, whichever comes first,
so no rank ever waits on another rank's requests beyond the timeout (ranks that ask at different
times, or a client that steps its loaders one after the other, never deadlock). A closed round
whose samples could not move — no global step with samples of two ranks in it — is kept as it is
without running the policy.

A rank's batch joins a round whole (``add_batch``): a round may then pass ``buffer_size`` by less
than one batch, and each rank's batch of a step is never cut across two rounds. A round also
closes when it is ``complete`` — every step in it has the batches of all the group's ranks — since
samples move only within a step, waiting longer could add nothing they may move to. And it
closes when a rank asks for a batch it holds (``ask``): the rank is waiting for it now, so
waiting longer would cost that rank the time it hoped to save.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Round", "RoundBuffer", "RoundItem"]


@dataclass(frozen=True)
class RoundItem:
    """One materialized sample: ``key`` (whatever names it to the runtime: a slab handle, a task
    and position), the ``rank`` it is going to, its global ``step`` and its ``features``."""

    key: object
    rank: int
    step: int
    features: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Round:
    """A closed round: its items in arrival order, and why it closed (``"full"``, ``"complete"``,
    ``"timeout"``, ``"asked"`` or ``"flush"``)."""

    items: tuple[RoundItem, ...]
    closed_by: str

    @property
    def movable(self) -> bool:
        """Whether some global step has samples of two or more ranks here (else nothing may move)."""
        ranks_of: dict[int, set[int]] = {}
        for it in self.items:
            ranks_of.setdefault(it.step, set()).add(it.rank)
        return any(len(r) > 1 for r in ranks_of.values())

    def features(self) -> list[dict]:
        """What the policy sees: each item's features plus ``"rank"`` and ``"step"``."""
        return [{**it.features, "rank": it.rank, "step": it.step} for it in self.items]


class RoundBuffer:
    """The open round of one group of ``ranks``. ``add`` returns the round it closed (full);
    ``expire`` the one whose timeout passed; ``due_in`` says how long the waiter may sleep."""

    def __init__(self, ranks, buffer_size: int, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if buffer_size < 2 or not timeout_s > 0:
            raise ValueError(f"RoundBuffer: buffer_size >= 2 and timeout_s > 0 (got {buffer_size}, {timeout_s})")
        self.ranks = frozenset(ranks)
        self.buffer_size, self.timeout_s, self.clock = buffer_size, timeout_s, clock
        self._items: list[RoundItem] = []
        self._opened: float | None = None
        self._due = 0.0  # when the open round times out: the earliest of its batches' limits
        self._limits: dict[tuple[int, int], float] = {}  # (rank, step): that batch's limit
        self._asked: set[tuple[int, int]] = set()  # (rank, step) of batches whose rank asked for them

    def add(self, item: RoundItem) -> Round | None:
        if item.rank not in self.ranks:
            raise ValueError(f"RoundBuffer: rank {item.rank} is not in this group {sorted(self.ranks)}")
        if not self._items or self._opened is None:
            self._opened = self.clock()
            self._due = self._opened + self.timeout_s
        self._limits.setdefault((item.rank, item.step), self._opened + self.timeout_s)
        self._items.append(item)
        return self._close("full") if len(self._items) >= self.buffer_size else None

    def add_batch(self, items, timeout_s: float | None = None) -> Round | None:
        """One rank's batch of one step (its samples), added whole; the round it closed (full or
        complete), if any. ``timeout_s``: how long this batch may wait (default the buffer's); the
        round times out at the earliest of its batches' limits."""
        items = list(items)
        for it in items:
            if it.rank not in self.ranks:
                raise ValueError(f"RoundBuffer: rank {it.rank} is not in this group {sorted(self.ranks)}")
        if not items:
            return None
        now = self.clock()
        limit = now + (self.timeout_s if timeout_s is None else timeout_s)
        if not self._items:
            self._opened, self._due = now, limit
        self._due = min(self._due, limit)
        for it in items:
            self._limits[(it.rank, it.step)] = min(limit, self._limits.get((it.rank, it.step), limit))
        self._items.extend(items)
        if len(self._items) >= self.buffer_size:
            return self._close("full")
        return self._close("complete") if self.complete else None

    def drop(self, rank: int, step: int) -> list[RoundItem]:
        """Take ``rank``'s batch of ``step`` out of the open round (a resumed run sends that step
        again: the newer batch replaces it, or its rank left); the items dropped. The round then
        times out at the earliest limit of the batches left in it."""
        gone = [it for it in self._items if it.rank == rank and it.step == step]
        if gone:
            self._items = [it for it in self._items if not (it.rank == rank and it.step == step)]
            self._limits.pop((rank, step), None)
            self._asked.discard((rank, step))
            if not self._items:
                self._opened, self._limits, self._asked = None, {}, set()
            elif self._limits:
                self._due = min(self._limits.values())
        return gone

    def ask(self, rank: int, step: int) -> bool:
        """``rank`` waits for its batch of ``step`` now: the open round is due now (``expire``
        closes it as ``"asked"``). False when that batch is not in the open round."""
        if (rank, step) not in self._limits:
            return False
        self._limits[(rank, step)] = self._due = min(self._due, self.clock())
        self._asked.add((rank, step))
        return True

    @property
    def complete(self) -> bool:
        """Every step in the open round has batches of all the group's ranks."""
        ranks_of: dict[int, set[int]] = {}
        for it in self._items:
            ranks_of.setdefault(it.step, set()).add(it.rank)
        return bool(ranks_of) and all(r == self.ranks for r in ranks_of.values())

    def due_in(self) -> float | None:
        """Seconds until the open round times out (0: now); None when no round is open."""
        if self._opened is None:
            return None
        return max(0.0, self._due - self.clock())

    def expire(self) -> Round | None:
        """The open round, if its timeout has passed."""
        left = self.due_in()
        return self._close("asked" if self._asked else "timeout") if left is not None and left <= 0 else None

    def flush(self) -> Round | None:
        """Whatever is open, closed now (an epoch's end, a shutdown)."""
        return self._close("flush") if self._items else None

    def __len__(self) -> int:
        return len(self._items)

    def _close(self, why: str) -> Round:
        out = Round(tuple(self._items), why)
        self._items, self._opened, self._limits, self._asked = [], None, {}, set()
        return out
