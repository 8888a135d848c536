"""The client side of shared-memory delivery: ``SlabReader`` maps segments by name (cached) and
releases slabs by handle. The file format, and the functions through which both sides read and
write a slab's header, are ``shm``'s; the owner's side is ``slabpool``."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time

from helix_core.memory.lease import holder_stamp
from helix_core.memory.shm import (
    FREE,
    HEADER_BYTES,
    MAGIC,
    SHM_DIR,
    SlabHandle,
    close_map,
    read_generation,
    read_lease,
    read_readers,
    read_state,
    segment_path,
    write_lease,
    write_readers,
    write_state,
)

__all__ = ["SlabReader"]


def _open_own(segment: str) -> int:
    """A read-write descriptor of ``segment``'s file: never through a symbolic link, and only a file
    of this user's (``/dev/shm`` is every user's: a name freed by its DataServer may be taken)."""
    try:
        fd = os.open(segment_path(segment), os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"shared-memory segment {segment} does not exist (its DataServer closed or was swept)",
            segment_path(segment),
        ) from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise PermissionError(
            errno.EPERM, f"shared-memory segment {segment} is a symbolic link: not followed", segment_path(segment)
        ) from None
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        os.close(fd)
        raise PermissionError(
            errno.EPERM,
            f"shared-memory segment {segment} belongs to uid {st.st_uid}, not this user ({os.getuid()}): not read",
            segment_path(segment),
        )
    return fd


class SlabReader:
    """Client side: maps segments by name (cached) and releases slabs by handle. Thread-safe."""

    def __init__(self):
        self._maps: dict[str, mmap.mmap] = {}
        # re-entrant: a batch's on_release finalizer may call release() from a GC pass that
        # happens to run while this thread is inside attach() or close()
        self._lock = threading.RLock()

    def attach(self, segment: str) -> mmap.mmap:
        """A writable mapping of the whole segment file (header included), cached by name."""
        with self._lock:
            mm = self._maps.get(segment)
            if mm is not None:
                return mm
            # A new name means the pool may have unlinked others; unmapping those frees their pages.
            self._prune_unlinked()
            fd = _open_own(segment)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            if len(mm) < HEADER_BYTES or mm[:8] != MAGIC:
                mm.close()
                raise ValueError(f"{segment_path(segment)} is not a Helix slab (bad header)")
            self._maps[segment] = mm
            return mm

    def _prune_unlinked(self) -> None:
        for name in [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
            if close_map(self._maps[name]):
                del self._maps[name]

    def release(self, handle: SlabHandle) -> bool:
        """Mark the slab FREE if it is still at `handle.generation`; returns whether it did.
        A stale handle (the slab was handed out again) or a vanished segment is ignored. A slab
        shared by several readers (``share``) counts down instead: the last one frees it."""
        try:
            mm = self.attach(handle.segment)
        except FileNotFoundError:
            return False
        if read_generation(mm) != handle.generation:
            return False
        if read_readers(mm):  # set before any of its readers got the handle
            with self._locked(handle.segment):
                if read_generation(mm) != handle.generation:
                    return False
                left = read_readers(mm)
                if left > 1:
                    write_readers(mm, left - 1)
                    return False
                write_readers(mm, 0)
        write_state(mm, FREE)
        return True

    def share(self, handle: SlabHandle, readers: int) -> bool:
        """Tier 2: ``readers`` ranks will each release this slab once (it is FREE after the last);
        False if the handle is stale (the round keeps the batch then).

        A shared slab's lease names no process (no one reader may stand for the others, nor a dead
        one free it under a live one): it is the time of the share, so its producer takes it back
        once every reader released it or, if one died first, ``orphan_s`` after the share. Readers
        copy its rows at once and check its generation after (``crosshost.read_rows``)."""
        mm = self.attach(handle.segment)
        with self._locked(handle.segment):
            if read_generation(mm) != handle.generation or read_state(mm) == FREE:
                return False
            if readers > 1:
                write_lease(mm, 0, 0, time.monotonic())  # the producer's clock (one host)
            write_readers(mm, readers if readers > 1 else 0)
        return True

    def held(self, handle: SlabHandle) -> bool:
        """Whether the slab is still handed out at ``handle``'s generation (nobody released it)."""
        try:
            mm = self.attach(handle.segment)
        except FileNotFoundError:
            return False
        return read_generation(mm) == handle.generation and read_state(mm) != FREE

    @staticmethod
    @contextlib.contextmanager
    def _locked(segment: str):
        fd = _open_own(segment)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the kernel drops it if this process dies
            yield
        finally:
            os.close(fd)

    def view(self, handle: SlabHandle, lease: bool = True) -> memoryview:
        """The used payload bytes, [HEADER_BYTES, HEADER_BYTES + nbytes) of the file. ``lease``: this
        process becomes the slab's holder (its producer takes it back if this process dies) —
        unless the slab is shared (``share``); a DataServer reading a rank's slab passes False."""
        mm = self.attach(handle.segment)
        if lease and read_generation(mm) == handle.generation and not read_readers(mm):
            pid, start = holder_stamp()  # the lease: its producer takes it back if this process dies
            write_lease(mm, pid, start, read_lease(mm)[2])
        end = HEADER_BYTES + handle.nbytes
        if end > len(mm):
            raise ValueError(
                f"handle asks for {handle.nbytes} bytes; segment {handle.segment} holds {len(mm) - HEADER_BYTES}"
            )
        return memoryview(mm)[HEADER_BYTES:end]

    def close(self) -> None:
        """Unmap what nobody uses; mappings still exported by live tensors stay (GC unmaps them)."""
        with self._lock:
            for name in list(self._maps):
                if close_map(self._maps[name]):
                    del self._maps[name]
