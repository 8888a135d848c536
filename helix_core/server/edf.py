"""A DataServer's queue of tasks waiting for a worker, earliest deadline first."""

from __future__ import annotations

import heapq
import itertools

__all__ = ["EdfQueue"]


class EdfQueue:
    """Tasks waiting for a worker, earliest deadline first (ties: arrival order).

    ``key`` is an absolute ``time.monotonic`` value. Cancelled tasks are dropped lazily."""

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()
        self._ids: dict[int, dict] = {}  # entry number -> task (or piece of one), for those still queued
        self.cpu_s = 0.0  # predicted CPU seconds of the queued tasks

    def __len__(self) -> int:
        return len(self._ids)

    def push(self, task: dict) -> None:
        seq = next(self._seq)
        heapq.heappush(self._heap, (task["_key"], seq, task))
        self._ids[seq] = task
        self.cpu_s += task.get("predicted_cpu_s", 0.0)

    def pop(self) -> dict | None:
        while self._heap:
            _, seq, task = heapq.heappop(self._heap)
            if self._ids.pop(seq, None) is not None:
                self.cpu_s = max(0.0, self.cpu_s - task.get("predicted_cpu_s", 0.0))
                return task
        return None

    def remove(self, task_ids: set[int], client_id: str = "") -> list[dict]:
        """Drop the queued tasks (and pieces) of ``task_ids`` of client ``client_id``; the dropped ones."""
        gone = [
            (seq, t) for seq, t in self._ids.items() if t["task_id"] in task_ids and t.get("client_id", "") == client_id
        ]
        for seq, task in gone:
            del self._ids[seq]
            self.cpu_s = max(0.0, self.cpu_s - task.get("predicted_cpu_s", 0.0))
        if not self._ids:
            self._heap.clear()
        return [t for _, t in gone]
