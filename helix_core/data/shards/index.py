"""The index of a shard set: every sample's shard, key, video member (offset and size of its data),
container facts and small text members, built once by scanning the shards and kept beside them.

``ShardIndex.open`` reads the set's index file — beside the first shard (``names.index_name``), or
in the local cache folder (``<cache_dir>/shard-index/``, keyed by the shards' URLs) when the
shards' folder cannot be written (an HTTP server, a read-only bucket) — and scans only the shards
it lacks or whose size changed since (a rewritten shard), then writes the file back. The shards'
sizes come from one listing per folder on an object store (s3, gs, azure), else one stat per
shard. The file is JSON, columnar per shard, its shard names relative to its own folder, so a
set built locally and uploaded beside its index is not scanned again.

A shard at a URL is scanned by reading it front to back in large range reads (``reads.Chunked``):
an object store answers a request after tens of milliseconds whatever its size, and the index needs
every video member's bytes anyway (an MP4's header may sit at its end), so hopping header to header
would pay that latency three times per sample for nothing.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from helix_core.data.shards.names import INDEX_VERSION, cache_name, index_name, relative_name
from helix_core.data.shards.reads import shard_size
from helix_core.data.shards.scan import COLUMNS, scan_shard, video_exts
from helix_core.data.storage.config import Storage
from helix_core.data.storage.reader import StorageError, filesystem, read_range, stat_size
from helix_core.data.storage.urls import is_url, join, protocol_of

__all__ = ["SCAN_THREADS", "ShardIndex"]

#: Shards scanned at once while building (reads and probes release the GIL).
SCAN_THREADS = 8
_LISTED = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}  # stores whose listing carries sizes
_INT = ("shard", "offset", "bytes", "frames", "width", "height")
_FLOAT = ("fps", "duration_s")
_STR = ("key", "video", "codec", "frames_source", "duration_source", "error")


class ShardIndex:
    """Columns over every sample of a shard set, in shard order then tar order: ``shard`` (its
    position in ``shards``), ``key``, ``video`` (the video member's extension), ``offset`` /
    ``bytes`` (its data in the shard, bytes), ``frames``, ``width``, ``height``, ``fps``,
    ``duration_s``, ``codec``, ``frames_source``, ``duration_source``, ``error`` (None, or why the
    sample cannot be used); ``text[i]``: its small text members (``{"json": {...}, "txt": "..."}``);
    ``members[i]``: ``{extension: [offset, size]}`` of all its members.

    ``shards`` / ``sizes``: the set, in order, and the size (bytes) each had when indexed;
    ``shard_errors``: shards whose walk stopped early, and why; ``location``: where the index was
    read or written; ``scanned``: the shards this ``open`` scanned (empty when all were indexed)."""

    def __init__(self, shards, sizes, entries, location: str, scanned: list[str]):
        self.shards, self.sizes = list(shards), [int(s) for s in sizes]
        self.location, self.scanned = location, scanned
        self.shard_errors = {u: e["error"] for u, e in zip(self.shards, entries) if e.get("error")}
        rows = {k: [] for k in COLUMNS}
        counts = []
        for e in entries:
            n = len(e["rows"]["key"])
            counts.append(n)
            for k in COLUMNS:
                rows[k].extend(e["rows"][k])
        self.columns: dict[str, np.ndarray] = {"shard": np.repeat(np.arange(len(entries)), counts).astype(np.int64)}
        for k in _INT[1:]:
            self.columns[k] = np.asarray(rows[k], dtype=np.int64)
        for k in _FLOAT:
            self.columns[k] = np.asarray(rows[k], dtype=np.float64)
        for k in _STR:
            self.columns[k] = np.asarray(rows[k], dtype=object)
        self.text: list[dict] = rows["text"]
        self.members: list[dict] = rows["members"]

    def __len__(self) -> int:
        return len(self.columns["key"])

    def __getattr__(self, name):
        cols = self.__dict__.get("columns", {})
        if name in cols:
            return cols[name]
        raise AttributeError(name)

    def path(self, i: int) -> str:
        """Sample ``i`` named in messages: ``<shard>#<key>.<video extension>``."""
        c = self.columns
        video = c["video"][i]
        return f"{self.shards[c['shard'][i]]}#{c['key'][i]}" + (f".{video}" if video else "")

    # ---- opening: read, scan what is missing, write back ----------------------------------------
    @classmethod
    def open(
        cls,
        shards: list[str],
        storage: Storage,
        video_key: str,
        *,
        location: str | None = None,
        progress: bool = True,
    ) -> ShardIndex:
        """The index of ``shards`` (URLs or absolute paths, in order): read from ``location``
        (default: beside the first shard, else the local cache folder), with the shards it lacks or
        whose size changed scanned and the file written back. A shard missing now but indexed
        before keeps its rows (its samples fail when read, as ``SampleError``); a shard never
        indexed that does not exist is ``FileNotFoundError``."""
        video_key = ";".join(video_exts(video_key))
        root, name = index_name(shards, video_key)
        beside = join(root, name)
        cached = str(_cache_folder() / cache_name(shards, video_key))
        places = [location] if location is not None else [beside, cached]
        known, read_from = {}, None
        for place in places:
            doc = _read(place, storage)
            if doc is not None and doc.get("video_key") == video_key:
                known = {e["name"]: e for e in doc["shards"]}
                read_from = place
                break
        sizes = _sizes(shards, storage)
        entries: list[dict | None] = []
        todo = []
        for i, (url, size) in enumerate(zip(shards, sizes)):
            entry = known.get(relative_name(url, root))
            if size is None:
                if entry is None:
                    raise FileNotFoundError(f"shard {url} does not exist (nor is it in an index)")
                warnings.warn(
                    f"shard {url} is missing: its {len(entry['rows']['key'])} samples fail when read",
                    stacklevel=3,
                )
            elif entry is None or entry["size"] != size:
                todo.append(i)
                entry = None
            entries.append(entry)
        scanned = [shards[i] for i in todo]
        for i, entry in _scan_all(todo, shards, sizes, storage, video_key, progress):
            entries[i] = dict(entry, name=relative_name(shards[i], root))
        done = [e for e in entries if e is not None]
        where = read_from or places[0]
        if todo or read_from is None:
            doc = {"helix_shard_index": INDEX_VERSION, "video_key": video_key, "shards": done}
            where = _write(doc, places if location is None else [location], storage)
        return cls(shards, [e["size"] for e in done], done, where, scanned)


def _cache_folder():
    from helix_core.config import cache_dir

    return cache_dir() / "shard-index"


def _sizes(shards: list[str], storage: Storage) -> list[int | None]:
    """Each shard's size in bytes (None: it does not exist): one listing per folder on an object
    store that lists sizes, else one stat per shard (in threads, for URLs)."""
    sizes: dict[str, int | None] = {}
    by_folder = defaultdict(list)
    for u in shards:
        if protocol_of(u) in _LISTED:
            by_folder[u.rsplit("/", 1)[0]].append(u)
    for folder, urls in by_folder.items():
        if len(urls) < 4:
            continue
        try:
            fs = filesystem(folder, storage.options)
            fs.invalidate_cache(folder)
            listed = {fs._strip_protocol(e["name"]): int(e.get("size") or 0) for e in fs.ls(folder, detail=True)}
        except Exception:  # noqa: BLE001 - no listing (no permission, ...): stat each shard instead
            continue
        for u in urls:
            if fs._strip_protocol(u) in listed:
                sizes[u] = listed[fs._strip_protocol(u)]
    rest = [u for u in shards if u not in sizes]
    if any(is_url(u) for u in rest):
        with ThreadPoolExecutor(16) as pool:
            sizes.update(zip(rest, pool.map(lambda u: shard_size(u, storage), rest)))
    else:
        sizes.update((u, shard_size(u, storage)) for u in rest)
    return [sizes[u] for u in shards]


def _scan_all(todo: list[int], shards, sizes, storage: Storage, video_key: str, progress: bool):
    """``(i, entry)`` for each shard ``shards[i]`` of ``todo``, scanned in threads under a progress
    bar of bytes read."""
    if not todo:
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TimeRemainingColumn(), console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task(f"index {len(todo)} shards", total=sum(sizes[i] for i in todo))

        def one(i: int) -> tuple[int, dict]:
            try:
                rows, error = scan_shard(
                    shards[i], sizes[i], storage, video_key, on_fetch=lambda n: bar.advance(task, n)
                )
            except StorageError as e:
                raise OSError(f"cannot index shard {shards[i]}: {e.cause}") from None
            return i, {"size": sizes[i], "error": error, "rows": rows}

        with ThreadPoolExecutor(min(SCAN_THREADS, len(todo))) as pool:
            yield from pool.map(one, todo)


def _read(place: str, storage: Storage) -> dict | None:
    """The index document at ``place``, or None when there is none (or it is not one we read)."""
    try:
        if is_url(place):
            size = stat_size(place, storage.options, storage.remote)
            raw = read_range(place, 0, size, storage.options, storage.remote)
        else:
            with open(place, "rb") as f:
                raw = f.read()
    except (OSError, StorageError):
        return None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        warnings.warn(f"shard index {place} is not valid JSON: it is rebuilt", stacklevel=4)
        return None
    if not isinstance(doc, dict) or doc.get("helix_shard_index") != INDEX_VERSION:
        return None
    return doc


def _write(doc: dict, places: list[str], storage: Storage) -> str:
    """Write ``doc`` at the first of ``places`` that takes it (atomically: a temporary file
    renamed, or one object written whole); the place written. ``OSError`` when none does."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    failures = []
    for place in places:
        try:
            if is_url(place):
                filesystem(place, storage.options).pipe_file(place, data)
            else:
                os.makedirs(os.path.dirname(place), exist_ok=True)
                tmp = f"{place}.{os.getpid()}.part"
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, place)
            return place
        except Exception as e:  # noqa: BLE001 - a read-only place: the next one
            failures.append(f"{place}: {type(e).__name__}: {e}")
    raise OSError("cannot write the shard index anywhere: " + "; ".join(failures))
