"""Shared-memory slabs: files under /dev/shm that a DataServer writes batches into and clients map.

A slab is one file: a 64-byte header, then the payload. The producer (a `SlabPool`, owned by one
DataServer) marks a slab BUSY and bumps its generation when it hands it out; the client marks it
FREE again (`SlabReader.release`) once the user dropped the batch. The header is the only shared
state, so a client never talks back to the server to give memory back.

Plain `os.open` + `mmap` rather than `multiprocessing.shared_memory`: the latter's
resource_tracker unlinks segments a process merely attached to, which would pull slabs away
from under the server. Every segment has one owner that unlinks it: the pool that created it
(`close()`, or a finalizer at interpreter exit), or `sweep(prefix)` after a killed process.

Header (little-endian, byte 0): magic b"HELIXSLB", generation u64, state u64 (FREE/BUSY),
capacity u64 (payload bytes), then the lease: the holder's pid u64 and process start time u64
(clock ticks, /proc: a reused pid is not the holder), and when the producer handed it out (f64,
CLOCK_MONOTONIC); then the number of readers u64 (0: the one holder; Tier 2 sets it when a round
hands a slab's rows to several ranks, and each release counts down under ``flock``); zero padding
up to HEADER_BYTES. A client that maps a slab writes itself in as
holder; a producer takes back a BUSY slab whose holder died, or that nobody mapped within
``orphan_s`` (``SlabPool.reclaim``), and unlinks free slabs unused for ``idle_s``.

This module holds the format (the header's fields, read and written only through the functions
here), one ``Slab``, the ``SlabHandle`` that names one hand-out of it (the one in-process form of a
handle; ``wire/messages.py`` converts it to and from protobuf) and what is done to segments by name (create, release, list, sweep, unlink a
dead producer's); the pool that owns them is ``slabpool.py``, the client's side ``reader.py``.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass

from helix_core.memory.lease import holder_alive

__all__ = [
    "ALIGN",
    "BUSY",
    "FREE",
    "HEADER_BYTES",
    "MAGIC",
    "NO_ROOM",
    "SHM_DIR",
    "ShmCapacityError",
    "Slab",
    "SlabHandle",
    "close_map",
    "create_segment",
    "list_segments",
    "owned",
    "read_generation",
    "read_lease",
    "read_readers",
    "read_state",
    "release_segment",
    "segment_path",
    "sweep",
    "unlink_if_free",
    "write_lease",
    "write_readers",
    "write_state",
]

log = logging.getLogger("helix.shm")

SHM_DIR = "/dev/shm"
HEADER_BYTES = 64
ALIGN = 64
MAGIC = b"HELIXSLB"
FREE = 0
BUSY = 1

_HEADER = struct.Struct("<8sQQQ")  # magic, generation, state, capacity
_U64 = struct.Struct("<Q")
_GEN_AT, _STATE_AT = 8, 16
_LEASE = struct.Struct("<QQd")  # holder pid, holder start time, handed out at
_LEASE_AT = 32
_READERS_AT = 56  # u64: ranks that read a shared slab (Tier 2); 0: its one holder


class ShmCapacityError(RuntimeError):
    """/dev/shm cannot hold a new segment."""


# The header's fields, in a mapped segment or its header's bytes (``buf``).
def read_generation(buf) -> int:
    return _U64.unpack_from(buf, _GEN_AT)[0]


def read_state(buf) -> int:
    """FREE or BUSY."""
    return _U64.unpack_from(buf, _STATE_AT)[0]


def write_state(buf, state: int) -> None:
    _U64.pack_into(buf, _STATE_AT, state)


def read_readers(buf) -> int:
    """The ranks that still have to release a shared slab (Tier 2); 0: its one holder."""
    return _U64.unpack_from(buf, _READERS_AT)[0]


def write_readers(buf, readers: int) -> None:
    _U64.pack_into(buf, _READERS_AT, readers)


def read_lease(buf) -> tuple[int, int, float]:
    """``(pid, start time, handed out at)``: the holder (``lease.holder_stamp``; pid 0: none yet)
    and when the producer handed the slab out (seconds, CLOCK_MONOTONIC)."""
    return _LEASE.unpack_from(buf, _LEASE_AT)


def write_lease(buf, pid: int, start: int, handed: float) -> None:
    _LEASE.pack_into(buf, _LEASE_AT, pid, start, handed)


def segment_path(name: str) -> str:
    """The file of segment ``name``; ``ValueError`` for a name that is not one file of /dev/shm."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"not a /dev/shm segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def owned(path: str) -> bool:
    """Whether ``path`` is a file of this user (a symlink is nobody's: never followed). /dev/shm is
    every user's: a name with a cluster's prefix may be another user's file, which cleanup leaves."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return st.st_uid == os.geteuid() and not stat.S_ISLNK(st.st_mode)


def _space() -> tuple[int, int]:
    """(free, total) bytes of /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


NO_ROOM = "/dev/shm has no room for"  # how a peer's full /dev/shm reads in an RPC's details (final, not transient)


@dataclass(frozen=True)
class SlabHandle:
    """What a client needs to map one hand-out of a slab: its segment's name, the generation it was
    handed out at (a release at another generation is stale and ignored) and ``nbytes``, the used
    payload length in bytes (0 where only the slab is named, as a release names it)."""

    segment: str
    generation: int
    nbytes: int = 0

    def unsized(self) -> SlabHandle:
        """The slab alone, as a release names it (``nbytes`` 0)."""
        return SlabHandle(self.segment, self.generation)


def close_map(mm: mmap.mmap) -> bool:
    """Unmap unless numpy/torch objects still export it (they keep it alive; GC unmaps later)."""
    try:
        mm.close()
        return True
    except BufferError:
        return False


class Slab:
    """One segment as its producer sees it.

    `capacity` is the payload size in bytes; `payload` is a writable memoryview of exactly those
    bytes (file offset HEADER_BYTES onwards); `generation` counts how often the pool handed it out.
    """

    def __init__(self, name: str, mm: mmap.mmap, capacity: int, generation: int = 0):
        self.name = name
        self.capacity = capacity
        self.generation = generation
        self._mm = mm
        self.payload = memoryview(mm)[HEADER_BYTES : HEADER_BYTES + capacity]
        self.last_used = time.monotonic()

    @property
    def free(self) -> bool:
        """Whether the header says FREE (a client released it, or nobody acquired it yet)."""
        return read_state(self._mm) == FREE

    def handle(self, nbytes: int) -> SlabHandle:
        """What a client needs to map this slab: `nbytes` is the used payload length in bytes."""
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"slab {self.name} holds {self.capacity} payload bytes, not {nbytes}")
        return SlabHandle(self.name, self.generation, nbytes)

    def release(self) -> None:
        """Producer side: give the slab back without a client (e.g. the delivery failed)."""
        write_state(self._mm, FREE)

    def orphaned(self, orphan_s: float, now: float) -> bool:
        """BUSY, and its holder died — or nobody mapped it within ``orphan_s`` of the hand-out."""
        if self.free:
            return False
        pid, start, handed = read_lease(self._mm)
        return not holder_alive(pid, start) if pid else now - handed > orphan_s

    def mark_busy(self) -> None:
        """Producer side: hand the slab out anew (the next generation, no holder yet)."""
        # generation first: a client releasing a stale handle compares against it
        self.generation += 1
        self.last_used = time.monotonic()
        _U64.pack_into(self._mm, _GEN_AT, self.generation)
        write_lease(self._mm, 0, 0, self.last_used)
        write_readers(self._mm, 0)
        write_state(self._mm, BUSY)

    def unmap(self) -> None:
        """Producer side: unmap the segment (the pool unlinks its file)."""
        try:
            self.payload.release()
        except BufferError:
            return  # still exported (a live torch.frombuffer view): GC unmaps it later
        close_map(self._mm)

    def __repr__(self) -> str:
        return f"Slab({self.name!r}, capacity={self.capacity}, generation={self.generation}, free={self.free})"


def create_segment(name: str, capacity: int, reserve: float = 0.0) -> Slab:
    """Create, reserve and map a new segment of `capacity` payload bytes; ShmCapacityError if
    /dev/shm cannot hold it while keeping `reserve` (a fraction of its size) free (no file is left
    behind then)."""
    size = HEADER_BYTES + capacity
    free, total = _space()
    keep = int(reserve * total)
    if size + keep > free:
        why = (
            f" while keeping {keep} bytes free for others: every slab this pool keeps for reuse is held "
            "(are kept batches piling up?)"
            if keep
            else ""
        )
        raise ShmCapacityError(
            f"/dev/shm cannot hold segment {name}: it needs {size} bytes and "
            f"{free} bytes are free{why} (raise the tmpfs size or lower the prefetch depth)"
        )
    path = segment_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Reserve the tmpfs pages now: a sparse file would SIGBUS on first write when full.
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
    except OSError as e:
        os.unlink(path)
        if e.errno == errno.ENOSPC:
            raise ShmCapacityError(
                f"/dev/shm cannot hold segment {name}: it needs {size} bytes and {_space()[0]} bytes are free"
            ) from e
        raise
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)  # the mapping keeps the file alive
    _HEADER.pack_into(mm, 0, MAGIC, 0, FREE, capacity)
    return Slab(name, mm, capacity)


def release_segment(handle: SlabHandle) -> bool:
    """Mark the slab FREE if it is still at ``handle.generation`` (``SlabReader.release``
    without mapping it: the header is read and the state written through the file); returns
    whether it did. A stale handle or a vanished segment is ignored."""
    try:
        fd = os.open(segment_path(handle.segment), os.O_RDWR | os.O_NOFOLLOW)
    except (FileNotFoundError, PermissionError):
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink planted in its place: not followed
            return False
        raise
    try:
        head = os.pread(fd, HEADER_BYTES, 0)
        if len(head) < HEADER_BYTES or head[:8] != MAGIC or read_generation(head) != handle.generation:
            return False
        os.pwrite(fd, _U64.pack(FREE), _STATE_AT)
        return True
    finally:
        os.close(fd)


def list_segments(prefix: str) -> list[str]:
    """Names of the files in /dev/shm that start with `prefix`, sorted."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def sweep(prefix: str) -> int:
    """Unlink every /dev/shm file of this user whose name starts with `prefix` (e.g.
    "helix-<cluster>-"); returns how many. Used after killed processes, whose pools never ran
    close(). Another user's files (or symlinks) under the prefix are left and logged, never an error."""
    if len(prefix) < 8 or not prefix.startswith("helix-"):
        raise ValueError(
            f"sweep({prefix!r}): the prefix must start with 'helix-' and have at least "
            f"8 characters, so it can only match one cluster's segments"
        )
    count, foreign = 0, []
    for name in list_segments(prefix):
        path = os.path.join(SHM_DIR, name)
        if not owned(path):
            foreign.append(name)
            continue
        try:
            os.unlink(path)
            count += 1
        except FileNotFoundError:
            pass
        except PermissionError:  # (owned a moment ago: replaced meanwhile)
            foreign.append(name)
    if foreign:
        log.warning(
            "sweep(%r): left %d file(s) that are not this user's: %s",
            prefix,
            len(foreign),
            ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else ""),
        )
    return count


def unlink_if_free(name: str, orphan_s: float | None = None) -> bool:
    """Unlink segment ``name`` unless a client still holds it (header state BUSY, its holder alive)
    or may still map it (BUSY and not mapped yet, handed out less than ``orphan_s`` ago; None: for
    ever). True when the segment is gone afterwards. Used for the slabs of a dead producer: those
    already handed to a client must survive until it has mapped and released them; one it was
    writing when it died is never mapped, and goes after ``orphan_s``."""
    path = os.path.join(SHM_DIR, name)
    if not owned(path):  # gone, or another user's file under the prefix: nothing of ours to wait for
        if os.path.lexists(path):
            log.warning("a /dev/shm file %s that is not this user's is left in place", name)
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    try:
        head = os.pread(fd, HEADER_BYTES, 0)
    finally:
        os.close(fd)
    if len(head) == HEADER_BYTES and head[:8] == MAGIC and read_state(head) != FREE:
        pid, start, handed = read_lease(head)
        if holder_alive(pid, start) if pid else (orphan_s is None or time.monotonic() - handed <= orphan_s):
            return False  # held, or not mapped yet: it must stay readable
    try:
        os.unlink(path)
    except (FileNotFoundError, PermissionError):
        pass
    return True
