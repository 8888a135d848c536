"""Who holds a shared-memory slab: a process named by its pid and start time (a reused pid is
not the holder). ``shm`` writes and reads these in a slab's lease."""

from __future__ import annotations

import os

__all__ = ["holder_alive", "holder_stamp", "process_start"]


def process_start(pid: int) -> int:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22); 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


_SELF: list = []  # (pid, start) of this process, once known (a fork gets its own)


def holder_stamp() -> tuple[int, int]:
    """This process as a slab holder: (pid, start time)."""
    pid = os.getpid()
    if not _SELF or _SELF[0][0] != pid:
        _SELF[:] = [(pid, process_start(pid))]
    return _SELF[0]


def holder_alive(pid: int, start: int) -> bool:
    """Whether the process that holds a slab still runs (the same one: its start time matches)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return not start or process_start(pid) in (0, start)
