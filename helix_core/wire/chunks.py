"""A payload streamed in chunks (pure memoryviews, no torch): ``iter_chunks`` cuts one for a gRPC
stream, ``ChunkWriter`` puts one back together in a slab. A DataServer relays batches with these
alone: one on loopback never loads torch (only Tier-2 rows that cross hosts need it: ``crosshost``)."""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["ChunkWriter", "iter_chunks"]


def iter_chunks(payload: memoryview, nbytes: int, chunk_bytes: int = 4 << 20) -> Iterator[memoryview]:
    """The first `nbytes` of `payload` as chunks of at most `chunk_bytes`: views, no copies (for a
    gRPC stream, whose serializer makes the one copy)."""
    if not 0 <= nbytes <= len(payload):
        raise ValueError(f"iter_chunks: {nbytes} bytes asked, the payload has {len(payload)}")
    if chunk_bytes <= 0:
        raise ValueError(f"iter_chunks(chunk_bytes={chunk_bytes}): must be > 0")
    for start in range(0, nbytes, chunk_bytes):
        yield payload[start : min(nbytes, start + chunk_bytes)]


class ChunkWriter:
    """Appends stream chunks to `payload` until `total` bytes have arrived."""

    def __init__(self, payload: memoryview, total: int):
        if not 0 <= total <= len(payload):
            raise ValueError(f"ChunkWriter: {total} bytes announced, the payload has {len(payload)}")
        self._payload, self.total, self.written = payload, total, 0

    def write(self, chunk: bytes) -> None:
        end = self.written + len(chunk)
        if end > self.total:
            raise ValueError(f"stream overflow: {end} bytes received, {self.total} announced")
        self._payload[self.written : end] = chunk
        self.written = end

    @property
    def done(self) -> bool:
        return self.written == self.total
