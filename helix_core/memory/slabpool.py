"""The owner of a process's slabs: a ``SlabPool`` creates segments (``shm``), hands them out,
reuses the ones clients released, takes back orphaned ones and unlinks them at close or exit."""

from __future__ import annotations

import os
import secrets
import threading
import time
import weakref

from helix_core.memory.shm import HEADER_BYTES, SHM_DIR, Slab, create_segment, segment_path

__all__ = ["SlabPool"]

_MIB = 1 << 20
OVERFLOW_RESERVE = 0.25  # segments past a pool's max_segments never eat into the last quarter of /dev/shm


def _unlink_all(names: list, owner_pid: int) -> None:
    # A forked child inherits the finalizer; only the creating process owns the files.
    if os.getpid() != owner_pid:
        return
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass  # swept already
    names.clear()


class SlabPool:
    """The owner of the segments it creates; thread-safe.

    Segments are named `f"{prefix}{pid}-{counter}-{random}"`, so names never repeat and a client's
    cached mapping of a name is never stale. `max_segments` is how many segments the pool keeps for
    reuse: while every one of them is held (a user keeping many batches, as a torch DataLoader
    allows), more are made — /dev/shm's capacity is the limit, checked per segment — and segments
    beyond `max_segments` are unlinked as soon as they are free again.
    """

    def __init__(self, prefix: str, max_segments: int = 64, orphan_s: float = 900.0, idle_s: float = 60.0):
        if max_segments < 1:
            raise ValueError(f"SlabPool(max_segments={max_segments}): need at least 1")
        segment_path(prefix + "x")  # the prefix must make valid file names
        self.prefix = prefix
        self.max_segments = max_segments
        self.orphan_s, self.idle_s = orphan_s, idle_s
        self.reclaimed = 0
        self._slabs: list[Slab] = []
        self._names: list[str] = []  # shared with the finalizer, which must not reference self
        self._lock = threading.Lock()
        self._counter = 0
        self._created = 0
        self._reused = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _unlink_all, self._names, os.getpid())

    def acquire(self, nbytes: int) -> Slab:
        """A BUSY slab with at least `nbytes` payload bytes: the smallest FREE one that fits, or a
        new one (capacity rounded up to whole MiB). Raises ShmCapacityError when /dev/shm is full."""
        if nbytes < 0:
            raise ValueError(f"acquire({nbytes}): bytes must be >= 0")
        with self._lock:
            if self._closed:
                raise RuntimeError("SlabPool is closed")
            fits = [s for s in self._slabs if s.capacity >= nbytes and s.free]
            if not fits and self._reclaim():  # slabs of clients that died count as free
                fits = [s for s in self._slabs if s.capacity >= nbytes and s.free]
            if fits:
                slab = min(fits, key=lambda s: s.capacity)
                self._reused += 1
            else:
                if len(self._slabs) >= self.max_segments:
                    self._drop([s for s in self._slabs if s.capacity < nbytes and s.free])
                # past max_segments only while every kept slab is held, and never into the last quarter of
                # /dev/shm (NCCL and other processes need it too)
                slab = self._create(nbytes, reserve=OVERFLOW_RESERVE if len(self._slabs) >= self.max_segments else 0.0)
            slab.mark_busy()
            if len(self._slabs) > self.max_segments:  # the overflow of kept batches, once they are free
                self._drop([s for s in self._slabs if s.free][: len(self._slabs) - self.max_segments])
            return slab

    def reclaim(self) -> int:
        """Take back slabs whose holder died or that nobody mapped within ``orphan_s``, and unlink
        free ones unused for ``idle_s`` (a long-lived server gives /dev/shm back); how many were
        taken back. Cheap: call it when idle."""
        with self._lock:
            if self._closed:
                return 0
            got = self._reclaim()
            now = time.monotonic()
            self._drop([s for s in self._slabs if s.free and now - s.last_used > self.idle_s])
            return got

    def _reclaim(self) -> int:
        now = time.monotonic()
        stale = [s for s in self._slabs if s.orphaned(self.orphan_s, now)]
        for slab in stale:
            slab.release()
        self.reclaimed += len(stale)
        return len(stale)

    def _drop(self, slabs: list[Slab]) -> None:
        for slab in slabs:
            self._slabs.remove(slab)
            _unlink_all([slab.name], os.getpid())
            self._names.remove(slab.name)
            slab.unmap()

    def _create(self, nbytes: int, reserve: float = 0.0) -> Slab:
        capacity = max(_MIB, -(-nbytes // _MIB) * _MIB)
        self._counter += 1
        name = f"{self.prefix}{os.getpid()}-{self._counter}-{secrets.token_hex(4)}"
        slab = create_segment(name, capacity, reserve)
        self._slabs.append(slab)
        self._names.append(name)
        self._created += 1
        return slab

    def stats(self) -> dict:
        """segments (count), bytes (of /dev/shm held, headers included), busy (count),
        created and reused (acquires since the pool started)."""
        with self._lock:
            return {
                "segments": len(self._slabs),
                "bytes": sum(HEADER_BYTES + s.capacity for s in self._slabs),
                "busy": sum(not s.free for s in self._slabs),
                "created": self._created,
                "reused": self._reused,
            }

    def close(self) -> None:
        """Unmap and unlink every segment (idempotent). Clients that still map a slab keep
        reading it: tmpfs frees the pages when the last mapping goes."""
        with self._lock:
            self._closed = True
            slabs, self._slabs = self._slabs, []
            self._finalizer()
            for slab in slabs:
                slab.unmap()

    def __enter__(self) -> SlabPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
