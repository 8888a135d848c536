"""Work stealing inside a DataServer: a worker with nothing queued takes the unstarted tail of a
batch another worker is preparing.

A batch task runs on one worker, sample after sample, so the last batch a waiting rank needs
would decode on one core while the others idle (every other rank's prefetch window is full). The
supervisor gives an idle worker the second half of the samples a running batch has not started;
the running worker, which checks its ``Claim`` before each sample, stops short and collates what
it did. The pieces come back as one reply and the client merges them, which is exact for the
collates whose merge is exact (``default_collate``, ``pad_collate``: the request says
``splittable``), so the batch is the one a single worker would have made, sooner.
"""

from __future__ import annotations

import ctypes
import fcntl
import os

from helix_core.server.worker import TaskResult

__all__ = ["Claim", "Pieces"]


class Claim:
    """Which samples of its task a worker may start: ``[started, limit)``, in shared memory under a
    lock. The worker takes sample ``k`` (``take``) before preparing it; the supervisor lowers
    ``limit`` (``steal``), never below the first sample nor below one started.

    The lock is ``flock`` on a small file at ``path`` (in /dev/shm, named like the pool's
    segments, so the cluster's sweep removes it with them; ``unlink`` when the worker is gone): the
    kernel releases it when its holder dies, and it names nothing else — a multiprocessing lock is
    a named POSIX semaphore (``/dev/shm/sem.mp-*``) that a process tree killed whole leaves behind."""

    def __init__(self, ctx, path: str):
        self._v = ctx.RawArray(ctypes.c_int32, 2)  # started, limit
        self.path = path
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        self._fd: int | None = None

    def __getstate__(self):  # to the worker (spawn): the array and the path; it opens its own descriptor
        return {"_v": self._v, "path": self.path, "_fd": None}

    def _locked(self, blocking: bool = True) -> bool:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def reset(self, n: int) -> None:
        """A new task of ``n`` samples (the supervisor, before it hands the task over)."""
        self._locked()
        try:
            self._v[0], self._v[1] = 0, int(n)
        finally:
            self._unlock()

    def take(self, k: int) -> bool:
        """The worker may prepare its task's sample ``k`` (False: the rest was stolen; stop)."""
        self._locked()
        try:
            if k < self._v[1]:
                self._v[0] = max(self._v[0], k + 1)
                return True
            return False
        finally:
            self._unlock()

    def steal(self) -> tuple[int, int] | None:
        """``(start, end)``: positions of the task's samples given to another worker (the larger
        half of those not started), or None when none is left to take — or when the lock is held
        (a running worker holds it for microseconds, so after one yield of the CPU it is free; a
        SIGSTOPped worker inside ``take`` keeps it, and the supervisor, which calls this holding its
        pool's lock, must never wait on it; a dead one's the kernel frees at once). It never waits."""
        if not self._locked(blocking=False):
            os.sched_yield()  # let a holder on the other core finish its few instructions
            if not self._locked(blocking=False):
                return None
        try:
            started, limit = max(self._v[0], 1), self._v[1]
            left = limit - started
            if left < 1:
                return None
            start = limit - (left + 1) // 2
            self._v[1] = start
            return start, limit
        finally:
            self._unlock()

    def unlink(self) -> None:
        """Remove the lock's file and close this side's descriptor (the worker is gone)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Pieces:
    """The pieces of one split batch, by offset (the position of a piece's first sample in the
    batch), until every piece is in. Piece 0 is the original task."""

    def __init__(self):
        self.waiting: set[int] = {0}
        self.done: dict[int, TaskResult] = {}

    def add(self, offset: int) -> None:
        self.waiting.add(offset)

    def finish(self, offset: int, result: TaskResult) -> bool:
        """Record a piece's result; True when it was the last one out."""
        self.waiting.discard(offset)
        self.done[offset] = result
        return not self.waiting

    def combine(self) -> tuple[TaskResult, list[TaskResult]]:
        """``(result, unused)``: the batch's result — its pieces in order, or the first piece's
        error — and the piece results whose slabs nobody will read (on an error)."""
        ordered = [self.done[k] for k in sorted(self.done)]
        failed = [r for r in ordered if r.handle is None]
        if failed:
            return failed[0], [r for r in ordered if r.handle is not None]
        with_features = any(r.features is not None for r in ordered)
        return TaskResult(
            pieces=ordered,
            rows=sum(r.rows for r in ordered),
            features=[f for r in ordered for f in r.features or ()] if with_features else None,
            decoded=[i for r in ordered for i in r.decoded],
            decode_cpu_s=[c for r in ordered for c in r.decode_cpu_s],
            read_bytes=[b for r in ordered for b in r.read_bytes],
            read_s=[w for r in ordered for w in r.read_s],
            exec_s=max(r.exec_s for r in ordered),
            queue_s=ordered[0].queue_s,
        ), []
