"""The Coordinator's record of Tier-2 rounds that moved samples: the one place a rank whose
round leader died can learn what its round gave it (metadata only: sample indices and slab
handles per rank).

A leader commits a moved round here before any rank sees an answer (``commit``). A rank whose
leader cannot answer asks for its round's fate (``fate``): the samples the committed round gave
it, or — when nothing was committed — a refusal is recorded first, so a leader that is only slow
(cut off, not dead) can no longer commit it and keeps every batch as it was. Either way every
rank of the round ends with the same answer, and each sample of the step is trained on once.

A round's name (group, run, step) recurs when a fresh run of the same spec meets the same
cluster. Each call says how old its round can be at most (``age_s``: since the round opened at
its leader, or since the rank sent its batch; durations, so no two hosts' clocks are compared),
and a record older than that belongs to an earlier run: it is forgotten, never served.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from collections import OrderedDict

from helix_core.memory.shm import SlabHandle

__all__ = ["RoundFates"]

KEPT_S = 600.0  # a round is remembered this long (a rank asks within about a minute of sending its batch)...
KEPT_ROUNDS = 1 << 20  # ...and, to bound the memory, at most this many are
SLACK_S = 1.0  # a call's transit, beside the age it states


class _Moved:
    """A committed round: each rank's samples and the slabs it releases; ``served`` once a rank
    learned it here (then the leader can no longer withdraw it)."""

    __slots__ = ("indices", "release", "served")

    def __init__(self, indices: dict[int, list[int]], release: dict[int, list[SlabHandle]]):
        self.indices = {int(r): array("q", v) for r, v in indices.items()}
        self.release = {int(r): list(v) for r, v in release.items() if v}
        self.served = False


class RoundFates:
    """Thread-safe. A round is named by ``(group, run, step)``; ``moved`` maps rank -> indices."""

    def __init__(self, capacity: int = KEPT_ROUNDS, clock=time.monotonic, kept_s: float = KEPT_S):
        self.capacity, self.clock, self.kept_s = capacity, clock, kept_s
        self._lock = threading.Lock()
        self._rounds: OrderedDict[tuple, tuple[float, _Moved | None]] = OrderedDict()  # key: (when, None: refused)

    def commit(
        self, key: tuple, moved: dict[int, list[int]], release: dict | None = None, age_s: float = math.inf
    ) -> bool:
        """The leader's moved round ``key`` (open ``age_s`` at the leader; ``release``: rank -> the
        ``SlabHandle``s of the slabs its answer has it release). False if a rank has already been told
        it kept (the leader must then keep every batch). An empty ``moved`` withdraws the leader's
        commit: False if a rank has already learned the committed round (it must then go ahead).
        A round open ``kept_s`` (less the slack) or longer (``age_s``; ``inf``: unknown) is never committed: a rank's refusal is
        remembered that long, so a leader slower than that could otherwise commit a round a rank
        was told it kept."""
        if moved and age_s != math.inf and not age_s + SLACK_S < self.kept_s:  # (a NaN too)
            return False  # a refusal of it may be forgotten already: too old to commit, it keeps
        with self._lock:
            got = self._get(key, age_s)
            if not moved:
                if isinstance(got, _Moved) and got.served:
                    return False
                self._put(key, None)
                return True
            if key in self._rounds and got is None:
                return False
            self._put(key, _Moved(moved, release or {}))
            return True

    def fate(self, key: tuple, rank: int, age_s: float = math.inf) -> tuple[list[int], list] | None:
        """What round ``key`` (at most ``age_s`` old) gave ``rank``: ``(indices, slabs it releases)``,
        or None: it kept its batch (and, if the round was not committed yet, it never will be)."""
        with self._lock:
            got = self._get(key, age_s)
            if key not in self._rounds:
                self._put(key, None)
            if got is None or rank not in got.indices:  # kept, or not in the round: its batch is its own
                return None
            got.served = True
            return list(got.indices[rank]), got.release.get(rank, [])

    def _get(self, key: tuple, age_s: float) -> _Moved | None:
        """(Under the lock.) ``key``'s record, forgotten if it is older than ``age_s`` (an earlier run's)."""
        at = self._rounds.get(key)
        if at is not None and self.clock() - at[0] > age_s + SLACK_S:
            del self._rounds[key]
            return None
        return None if at is None else at[1]

    def _put(self, key: tuple, value: _Moved | None) -> None:
        now = self._rounds[key] = (self.clock(), value)
        self._rounds.move_to_end(key)
        while len(self._rounds) > self.capacity or now[0] - next(iter(self._rounds.values()))[0] > self.kept_s:
            self._rounds.popitem(last=False)
