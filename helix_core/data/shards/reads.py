"""How a shard's bytes are read: a local shard by ``pread`` (no file position shared between
threads, no temporary file), a shard at a URL by range reads (``read_range``: one request,
retried on transient errors within the sample's timeout).

A sample is one read of exactly its video member's bytes. An index build walks a shard front to
back through ``Chunked``, which fetches ``chunk`` bytes at a time: the headers and small members
that follow each other come with one request, a member larger than a chunk is one read of its own,
and a member the index does not need is hopped over unread.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from helix_core.data.storage.config import Storage
from helix_core.data.storage.reader import StorageError, read_range, stat_size
from helix_core.data.storage.urls import is_url

__all__ = ["CHUNK_BYTES", "Chunked", "read_bytes", "shard_size"]

#: Bytes one request of an index build fetches from a shard at a URL: large enough that the
#: request's latency (tens of ms on an object store) is a small part of its transfer.
CHUNK_BYTES = 8 << 20


def _pread(path: str, start: int, end: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StorageError(path, "shard not found") from None
    except OSError as e:
        raise StorageError(path, f"cannot open the shard: {e.strerror or e}") from None
    try:
        parts, pos = [], start
        while pos < end:
            got = os.pread(fd, min(end - pos, 1 << 30), pos)
            if not got:
                raise StorageError(path, f"truncated: asked bytes {start}-{end}, the shard ends at byte {pos}")
            parts.append(got)
            pos += len(got)
        return b"".join(parts)
    finally:
        os.close(fd)


def read_bytes(shard: str, start: int, end: int, storage: Storage) -> bytes:
    """Bytes ``[start, end)`` of ``shard`` (a local path or a URL) in one read; ``StorageError``
    naming the shard and the cause (not found, truncated, a failed request) otherwise."""
    if not is_url(shard):
        return _pread(shard, start, end)
    try:
        return read_range(shard, start, end, storage.options, storage.remote)
    except StorageError as e:
        if e.cause.startswith("read: object not found"):
            raise StorageError(shard, "shard not found") from None
        raise


def shard_size(shard: str, storage: Storage) -> int | None:
    """``shard``'s size in bytes, or None when it does not exist (``StorageError`` for any other
    failure)."""
    if not is_url(shard):
        try:
            return os.stat(shard).st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(shard, f"cannot stat the shard: {e.strerror or e}") from None
    try:
        return stat_size(shard, storage.options, storage.remote)
    except StorageError as e:
        if "object not found" in e.cause:
            return None
        raise


class Chunked:
    """``shard`` read front to back: ``read(offset, n)`` answers from the chunk last fetched when it
    holds those bytes, else fetches from ``offset`` on (``chunk`` bytes, or ``n`` when more).
    ``fetched``: bytes read from storage; ``on_fetch(n)``: called after each fetch (progress)."""

    def __init__(
        self,
        shard: str,
        size: int,
        storage: Storage,
        chunk: int = CHUNK_BYTES,
        on_fetch: Callable[[int], None] | None = None,
    ):
        self.shard, self.size, self.storage, self.chunk = shard, int(size), storage, int(chunk)
        self.on_fetch = on_fetch
        self.fetched = 0
        self._start, self._data = 0, b""

    def read(self, offset: int, n: int) -> bytes:
        end = min(offset + n, self.size)
        if self._start <= offset and end <= self._start + len(self._data):
            return self._data[offset - self._start : end - self._start]
        data = read_bytes(self.shard, offset, min(offset + max(n, self.chunk), self.size), self.storage)
        self.fetched += len(data)
        if self.on_fetch is not None:
            self.on_fetch(len(data))
        self._start, self._data = offset, data
        return data[: end - offset]
