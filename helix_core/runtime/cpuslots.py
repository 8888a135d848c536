"""A host-wide cap on concurrent decodes, granted earliest deadline first.

One single-threaded decoder per core is the fastest layout (DESIGN.md, "Facts"): a CPU budget
of more worker processes than cores — several DataServers on one host, each with its workers —
would otherwise run them all at once and lose a tenth or more of every core to context switches
and cold caches. And which batch a free core prepares next matters: each DataServer orders its
own queue by deadline, but the ranks wait for the slowest of them, so the host must run the
batch needed soonest across all its servers, or a rank's batch for the next step waits while
another rank's batch for three steps later decodes.

Slots are ``n`` files in /dev/shm named for the cluster, locked with ``flock`` (the kernel drops
the lock of a process that dies, so a killed worker never strands a slot). Workers that wait for
a slot list themselves in a small shared table with their task's deadline key (an absolute
``time.monotonic`` value: CLOCK_MONOTONIC is the same clock in every process of a host); only
the ``n`` earliest waiters may take a slot. Those try for one every ``poll_s`` (two
non-blocking ``flock`` calls, a few microseconds) and re-read the table every ``rank_s``; a
waiter further back only re-reads the table, every ``rank_s``. (Blocking in ``flock`` would cost
no CPU at all, but the kernel then wakes waiters in arrival order, not by deadline.)
"""
from __future__ import annotations

import fcntl
import mmap
import os
import time

import numpy as np

__all__ = ["CpuSlots"]

_ENTRIES = 128  # waiters a host can list (more wait unranked, after the listed ones)
_ENTRY = np.dtype([("pid", "<i8"), ("key", "<f8"), ("eligible", "<i8")])  # eligible: among the n earliest


class CpuSlots:
    """``n`` decode slots shared by every process that opens the same ``prefix`` on this host."""

    def __init__(self, prefix: str, n: int, shm_dir: str = "/dev/shm"):
        if n < 1:
            raise ValueError(f"CpuSlots(n={n}): need at least one slot")
        self._fds = [os.open(os.path.join(shm_dir, f"{prefix}{k}"), os.O_RDWR | os.O_CREAT, 0o600) for k in range(n)]
        self._qfd = os.open(os.path.join(shm_dir, f"{prefix}q"), os.O_RDWR | os.O_CREAT, 0o600)
        size = _ENTRIES * _ENTRY.itemsize
        if os.fstat(self._qfd).st_size < size:
            os.posix_fallocate(self._qfd, 0, size)  # zero-filled: every entry empty (pid 0)
        self._map = mmap.mmap(self._qfd, size)
        self._table = np.frombuffer(self._map, dtype=_ENTRY, count=_ENTRIES)
        self._pid = os.getpid()
        self._held: int | None = None
        self._entry: int | None = None
        self._next = self._pid % n  # processes start their search at different slots

    def __len__(self) -> int:
        return len(self._fds)

    # ---- the waiting table ------------------------------------------------------------------------
    def _enlist(self, key: float) -> None:
        fcntl.flock(self._qfd, fcntl.LOCK_EX)
        try:
            free = np.flatnonzero(self._table["pid"] == 0)
            if len(free):
                k = int(free[0])
                self._table["key"][k] = key
                self._table["eligible"][k] = 0
                self._table["pid"][k] = self._pid
                self._entry = k
        finally:
            fcntl.flock(self._qfd, fcntl.LOCK_UN)

    def _delist(self) -> None:
        if self._entry is not None:
            self._table["pid"][self._entry] = 0
            self._entry = None

    def _ahead(self, key: float) -> int:
        """How many live waiters are ahead of this one (earlier key, ties by pid), counting up to
        ``n``."""
        pids, keys = self._table["pid"], self._table["key"]
        ahead = np.flatnonzero((pids != 0) & (pids != self._pid) &
                               ((keys < key) | ((keys == key) & (pids < self._pid))))
        live = 0
        for k in ahead:
            pid = int(pids[k])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:  # a waiter that died: its entry goes
                if pids[k] == pid:
                    pids[k] = 0
                continue
            except PermissionError:
                pass
            live += 1
            if live >= len(self._fds):
                break
        return live

    # ---- slots ------------------------------------------------------------------------------------------
    def _try(self) -> bool:
        n = len(self._fds)
        for j in range(n):
            k = (self._next + j) % n
            try:
                fcntl.flock(self._fds[k], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            self._held, self._next = k, (k + 1) % n
            return True
        return False

    def acquire(self, key: float | None = None, stop=lambda: False, poll_s: float = 0.002,
                rank_s: float = 0.02) -> bool:
        """Take a slot for a task whose deadline key is ``key`` (None: now), blocking; False if
        ``stop()`` turned true first."""
        if self._held is not None:
            return True
        key = time.monotonic() if key is None else float(key)
        self._enlist(key)
        try:
            while True:
                eligible = self._ahead(key) < len(self._fds)
                if self._entry is not None:
                    self._table["eligible"][self._entry] = int(eligible)
                if eligible:  # among the n earliest: try until the next re-read
                    until = time.monotonic() + rank_s
                    while True:
                        if self._try():
                            return True
                        if time.monotonic() >= until:
                            break
                        time.sleep(poll_s)
                elif stop():
                    return False
                else:
                    time.sleep(rank_s)
                if stop():
                    return False
        finally:
            self._delist()

    def release(self) -> None:
        if self._held is not None:
            fcntl.flock(self._fds[self._held], fcntl.LOCK_UN)
            self._held = None

    def close(self) -> None:
        self.release()
        self._delist()
        del self._table
        self._map.close()
        for fd in (*self._fds, self._qfd):
            os.close(fd)
        self._fds = []
