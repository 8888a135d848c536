"""A remote object as a seekable file: PyAV reads it through range reads of whole ``block_bytes``
blocks, so a sampled decode fetches the container's header and the packets it decodes, not the
whole object. After a few requests in a row that each start where the last ended, each request
fetches twice as many blocks as the last, up to ``max_blocks // 2`` (a sequential decode makes few
large requests; the reads after a seek, small ones).

Every range read is retried on transient errors with a doubling backoff, all within the sample's
``timeout_s``; what was fetched is counted (bytes, requests, seconds waited) for the cost model and
for placement. Blocks are kept in a small LRU per open object and, when configured, in a local
cache bounded in bytes (``cache.py``)."""

from __future__ import annotations

import io
import threading
import time
from collections import OrderedDict

from helix_core.data.storage.cache import BlockCache
from helix_core.data.storage.config import RemoteConfig
from helix_core.data.storage.errors import describe, is_transient

__all__ = ["RangeFile", "StorageError", "filesystem", "read_range", "stat_size"]

_FS: dict = {}
_FS_LOCK = threading.Lock()


class StorageError(OSError):
    """A read that failed for good (after its retries): ``url``, ``cause``, ``transient`` (whether
    it was still failing transiently when the tries or the time ran out)."""

    def __init__(self, url: str, cause: str, transient: bool = False):
        self.url, self.cause, self.transient = url, cause, transient
        super().__init__(f"{url}: {cause}")

    def __reduce__(self):
        return (StorageError, (self.url, self.cause, self.transient))


def filesystem(url: str, options: dict | None = None):
    """The fsspec filesystem for ``url``'s protocol with ``options`` (one per process and options;
    rebuilt after a fork, whose event loop threads do not survive)."""
    import json
    import os

    import fsspec

    protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
    key = (os.getpid(), protocol, json.dumps(options or {}, sort_keys=True))
    with _FS_LOCK:
        fs = _FS.get(key)
        if fs is None:
            opts = dict(options or {})
            if protocol in ("s3", "s3a"):  # Helix retries; botocore's own retries would hide the backoff
                cfg = dict(opts.get("config_kwargs") or {})
                cfg.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
                opts["config_kwargs"] = cfg
            fs = _FS[key] = fsspec.filesystem(protocol, skip_instance_cache=True, **opts)
        return fs


class _Deadline:
    def __init__(self, url: str, remote: RemoteConfig):
        self.url, self.remote = url, remote
        self.end = time.monotonic() + remote.timeout_s

    def call(self, what: str, fs, method: str, *args, **kwargs):
        """``fs.method(*args)`` with retries on transient errors until the tries or the time run out;
        an async filesystem's call is cut at the time left (its sync methods take ``timeout``)."""
        import fsspec.asyn

        fn, timed = getattr(fs, method), isinstance(fs, fsspec.asyn.AsyncFileSystem)
        delay, tries = self.remote.backoff_s, 0
        timed_out = f"{what}: timed out after {self.remote.timeout_s:g} s"
        while True:
            left = self.end - time.monotonic()
            if left <= 0:
                raise StorageError(self.url, timed_out, transient=True)
            try:
                if timed:
                    return fn(*args, timeout=left, **kwargs)
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - classified below
                if not is_transient(e):
                    raise StorageError(self.url, f"{what}: {describe(e)}") from None
                if time.monotonic() >= self.end:  # (cut at the time left: say so, not "FSTimeoutError")
                    raise StorageError(self.url, timed_out, transient=True) from None
                tries += 1
                if tries > self.remote.retries:
                    raise StorageError(
                        self.url, f"{what}: {describe(e)} (still failing after {self.remote.retries} retries)", True
                    ) from None
                time.sleep(min(delay, max(self.end - time.monotonic(), 0)))
                delay *= 2


def stat_size(url: str, options: dict | None, remote: RemoteConfig) -> int:
    fs = filesystem(url, options)
    info = _Deadline(url, remote).call("stat", fs, "info", url)
    if info.get("type") == "directory":
        raise StorageError(url, "is a folder, not an object")
    return int(info.get("size") or 0)


def read_range(
    url: str, start: int, end: int, options: dict | None = None, remote: RemoteConfig | None = None
) -> bytes:
    """Bytes ``[start, end)`` of ``url`` in one range read (retried); ``StorageError`` on failure."""
    remote = remote or RemoteConfig()
    fs = filesystem(url, options)
    data = _Deadline(url, remote).call("read", fs, "cat_file", url, start=start, end=end)
    if len(data) != end - start:
        raise StorageError(url, f"truncated: asked bytes {start}-{end}, got {len(data)}")
    return data


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote object (``size`` bytes) by ranged reads."""

    def __init__(self, url: str, options: dict | None = None, remote: RemoteConfig | None = None, *, size=None):
        super().__init__()
        self.url, self.remote = url, remote or RemoteConfig()
        self._fs = filesystem(url, options)
        self._deadline = _Deadline(url, self.remote)
        self.fetched_bytes, self.requests, self.wait_s = 0, 0, 0.0
        t0 = time.perf_counter()
        self.size = int(size) if size is not None else stat_size(url, options, self.remote)
        self.wait_s += time.perf_counter() - t0
        self._pos = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._next, self._ahead = -1, 1  # the block after the last request; blocks the next one fetches
        self._jumped = False  # a seek moved the position since the last request
        self._run = 0  # requests in a row, each starting where the last ended
        self._cache = BlockCache.of(self.remote, url, self.size)
        self._failed: StorageError | None = None  # a read that failed for good: every later fetch fails with it

    # io.RawIOBase
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        pos = base + int(offset)
        if pos < 0:
            raise OSError(f"{self.url}: seek to {pos}")
        self._jumped |= pos != self._pos
        self._pos = pos
        return pos

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n, done = min(len(view), max(self.size - self._pos, 0)), 0
        bs = self.remote.block_bytes
        while done < n:
            b, off = divmod(self._pos + done, bs)
            block = self._block(b)
            take = min(n - done, len(block) - off)
            if take <= 0:
                raise StorageError(
                    self.url, f"truncated: the object ended at byte {b * bs + len(block)} of {self.size}"
                )
            view[done : done + take] = block[off : off + take]
            done += take
        self._pos += done
        return done

    def _block(self, b: int) -> bytes:
        block = self._blocks.get(b)
        if block is not None:
            self._blocks.move_to_end(b)
            return block
        block = self._cache.get(b) if self._cache is not None else None
        if block is not None:
            self._keep(b, block)
            return block
        if self._failed is not None:  # the demuxer reads on after an error: fail at once, not retry again
            raise StorageError(self._failed.url, self._failed.cause, self._failed.transient)
        bs = self.remote.block_bytes
        last = -(-self.size // bs)  # blocks in the object
        self._run = self._run + 1 if b == self._next and not self._jumped else 0
        self._jumped = False
        # a few reads after a seek fetch what they touch (a keyframe and its GOP); a longer run is a
        # sequential read: 2, 4, 8, ... blocks per request
        self._ahead = min(1 << max(self._run - 2, 0), max(1, self.remote.max_blocks // 2))
        n = 1
        while n < self._ahead and b + n < last and b + n not in self._blocks:
            n += 1
        start, end = b * bs, min((b + n) * bs, self.size)
        t0 = time.perf_counter()
        try:
            data = self._deadline.call("read", self._fs, "cat_file", self.url, start=start, end=end)
        except StorageError as e:
            self._failed = e
            raise
        finally:
            self.wait_s += time.perf_counter() - t0
        self.requests += 1
        self.fetched_bytes += len(data)
        if len(data) != end - start:
            self._failed = StorageError(self.url, f"truncated: bytes {start}-{end} of {self.size} gave {len(data)}")
            raise self._failed
        self._next = b + n
        for k in range(n):
            piece = data[k * bs : (k + 1) * bs]
            if self._cache is not None:
                self._cache.put(b + k, piece)
            self._keep(b + k, piece)
        return data[:bs]

    def _keep(self, b: int, block: bytes) -> None:
        self._blocks[b] = block
        while len(self._blocks) > self.remote.max_blocks:
            self._blocks.popitem(last=False)
