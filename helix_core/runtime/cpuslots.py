"""A host-wide cap on concurrent decodes: one single-threaded decoder per core is the fastest
layout (DESIGN.md, "Facts"), and a CPU budget of more worker processes than cores — several
DataServers on one host, each with its workers — would otherwise run them all at once and lose
a tenth or more of every core to context switches and cold caches.

The slots are ``n`` files in /dev/shm named for the cluster, locked with ``flock``: every worker
of the cluster on this host takes one before it prepares a batch and gives it back after. The
kernel drops the lock of a process that dies, so a killed worker never strands a slot. A worker
that finds every slot taken tries again every ``poll_s`` (a few syscalls per millisecond of
waiting; a batch takes tens to hundreds of milliseconds).
"""
from __future__ import annotations

import fcntl
import os
import time

__all__ = ["CpuSlots"]


class CpuSlots:
    """``n`` decode slots shared by every process that opens the same ``prefix`` on this host."""

    def __init__(self, prefix: str, n: int, shm_dir: str = "/dev/shm"):
        if n < 1:
            raise ValueError(f"CpuSlots(n={n}): need at least one slot")
        self._fds = [os.open(os.path.join(shm_dir, f"{prefix}{k}"), os.O_RDWR | os.O_CREAT, 0o600) for k in range(n)]
        self._held: int | None = None
        self._next = os.getpid() % n  # processes start their search at different slots

    def __len__(self) -> int:
        return len(self._fds)

    def acquire(self, stop=lambda: False, poll_s: float = 0.002) -> bool:
        """Take a slot (blocking); False if ``stop()`` turned true first."""
        if self._held is not None:
            return True
        n = len(self._fds)
        while True:
            for j in range(n):
                k = (self._next + j) % n
                try:
                    fcntl.flock(self._fds[k], fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                self._held, self._next = k, (k + 1) % n
                return True
            if stop():
                return False
            time.sleep(poll_s)

    def release(self) -> None:
        if self._held is not None:
            fcntl.flock(self._fds[self._held], fcntl.LOCK_UN)
            self._held = None

    def close(self) -> None:
        self.release()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
