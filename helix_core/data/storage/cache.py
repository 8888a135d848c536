"""A local cache of fetched blocks, shared by the processes of a host and bounded in bytes.

A block is a file ``<cache_dir>/<object>/<block>`` (the object keyed by URL, size and block size:
a replaced object of another size is not served stale, and readers with other block sizes share
the folder without reading each other's blocks), written to a temporary name and renamed,
so a reader never sees half a block. A process counts what the folder holds (its last sum plus
what it wrote since); before a write would take that count past the bound, it sums the folder
again and removes the least recently used blocks down to seven eighths of the bound, less the
block: so the folder never holds more than the bound after a write of this process, and is summed
once per eighth of the bound written. Processes sharing the folder see each other's writes when
they next sum it."""

from __future__ import annotations

import hashlib
import os
import tempfile

from helix_core.data.storage.config import RemoteConfig

__all__ = ["BlockCache"]

_held: dict[str, int] = {}  # cache root -> bytes this process counts in it


class BlockCache:
    def __init__(self, root: str, bound: int, url: str, size: int, block_bytes: int):
        self.root, self.bound = root, bound
        key = hashlib.sha256(f"{url}\0{size}\0{block_bytes}".encode()).hexdigest()[:32]
        self.folder = os.path.join(root, key)

    @classmethod
    def of(cls, remote: RemoteConfig, url: str, size: int) -> BlockCache | None:
        if not remote.cache_bytes or not remote.cache_dir:
            return None
        return cls(remote.cache_dir, remote.cache_bytes, url, size, remote.block_bytes)

    def get(self, block: int) -> bytes | None:
        path = os.path.join(self.folder, str(block))
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # recently used
            return data
        except OSError:
            return None

    def put(self, block: int, data: bytes) -> None:
        if len(data) > self.bound:
            return  # it would never fit
        held = _held.get(self.root)
        if held is None or held + len(data) > self.bound:
            held = self.trim(max(self.bound - self.bound // 8 - len(data), 0))
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(self.folder, str(block)))
        except OSError:
            return  # a full or read-only disk only costs the cache
        _held[self.root] = held + len(data)

    def trim(self, bound: int | None = None) -> int:
        """Remove least recently used blocks until the folder holds at most ``bound`` bytes (the
        cache's bound by default); the bytes it holds then."""
        bound = self.bound if bound is None else bound
        files = []
        for dirpath, _dirs, names in os.walk(self.root):
            for name in names:
                if name.startswith(".tmp-"):
                    continue
                p = os.path.join(dirpath, name)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, s, p in sorted(files):
            if total <= bound:
                break
            try:
                os.unlink(p)
                total -= s
            except OSError:
                pass
        return total
