"""The Coordinator's record of Tier-2 rounds that moved samples: the one place a rank whose
round leader died can learn what its round gave it (metadata only: sample indices per rank).

A leader commits a moved round here before any rank sees an answer (``commit``). A rank whose
leader cannot answer asks for its round's fate (``fate``): the samples the committed round gave
it, or — when nothing was committed — a refusal is recorded first, so a leader that is only slow
(cut off, not dead) can no longer commit it and keeps every batch as it was. Either way every
rank of the round ends with the same answer, and each sample of the step is trained on once.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["RoundFates"]

KEPT_ROUNDS = 16_384  # rounds remembered (a rank asks about its round seconds after it closed)
_REFUSED = None


class RoundFates:
    """Thread-safe. A round is named by ``(group, run, step)``; ``moved`` maps rank -> indices."""

    def __init__(self, capacity: int = KEPT_ROUNDS):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._rounds: OrderedDict[tuple, dict[int, list[int]] | None] = OrderedDict()

    def commit(self, key: tuple, moved: dict[int, list[int]]) -> bool:
        """The leader's moved round ``key``; False if a rank has already been told it kept (the
        leader must then keep every batch). An empty ``moved`` withdraws the leader's commit."""
        with self._lock:
            if key in self._rounds and self._rounds[key] is _REFUSED:
                return False
            self._put(key, {int(r): [int(i) for i in v] for r, v in moved.items()} if moved else _REFUSED)
            return True

    def fate(self, key: tuple, rank: int) -> list[int] | None:
        """The samples round ``key`` gave ``rank``, or None: it kept its batch (and, if the round
        was not committed yet, it never will be)."""
        with self._lock:
            if key not in self._rounds:
                self._put(key, _REFUSED)
            got = self._rounds[key]
            return None if got is _REFUSED else got.get(rank)

    def _put(self, key: tuple, value) -> None:
        self._rounds[key] = value
        self._rounds.move_to_end(key)
        while len(self._rounds) > self.capacity:
            self._rounds.popitem(last=False)
