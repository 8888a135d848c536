"""The index of a shard set: every sample's shard, key, video member (offset and size of its data),
container facts and small text members, built once by scanning the shards and kept beside them.

``ShardIndex.open`` reads the set's index file — beside the first shard (``names.index_name``), or
in the local cache folder (``<cache_dir>/shard-index/``, keyed by the shards' URLs) when the
shards' folder cannot be written (an HTTP server, a read-only bucket) — and scans only the shards
it lacks or whose size changed since (a rewritten shard), then writes the file back. The shards'
sizes come from one listing per folder on an object store (s3, gs, azure), else one stat per
shard. The file is JSON lines, as the profile table: a header (the shards, their sizes and sample
counts, names relative to the file's own folder, so a set built locally and uploaded beside its
index is not scanned again) and one line per sample, read columnar by pyarrow.

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
from functools import cache
from typing import Any, NamedTuple

import numpy as np

from helix_core.data.shards.names import INDEX_VERSION, cache_name, index_name, relative_name
from helix_core.data.shards.reads import shard_size
from helix_core.data.shards.scan import scan_shard, video_exts
from helix_core.data.storage.config import Storage
from helix_core.data.storage.reader import StorageError, filesystem, read_range, stat_size
from helix_core.data.storage.urls import is_url, join, protocol_of

__all__ = ["SCAN_THREADS", "ShardIndex"]

#: Shards scanned at once while building (reads and probes release the GIL).
SCAN_THREADS = 8
_LISTED = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}  # stores whose listing carries sizes
_INT = ("offset", "bytes", "frames", "width", "height")
_FLOAT = ("fps", "duration_s")
_STR = ("key", "video", "codec", "frames_source", "duration_source", "error")


@cache
def _schema():
    import pyarrow as pa

    return pa.schema(
        [(k, pa.int64()) for k in _INT]
        + [(k, pa.float64()) for k in _FLOAT]
        + [(k, pa.string()) for k in (*_STR, "text", "members")]
    )


class ShardIndex:
    """Columns over every sample of a shard set, in shard order then tar order (numpy arrays):
    ``shard`` (its position in ``shards``), ``key``, ``video`` (the video member's extension),
    ``offset`` / ``bytes`` (its data in the shard, bytes), ``frames``, ``width``, ``height``,
    ``fps``, ``duration_s``, ``codec``, ``frames_source``, ``duration_source``, ``error`` (None, or
    why the sample cannot be used). ``text`` / ``members``: per sample, the JSON text of its small
    text members (``{"json": {...}, "txt": "..."}``) and of where each member lies
    (``{extension: [offset, size]}``), as an Arrow string array (``text_of(i)``, ``members_of(i)``).

    ``shards`` / ``sizes``: the set, in order, and the size (bytes) each had when indexed;
    ``shard_errors``: shards whose walk stopped early, and why; ``location``: where the index was
    read or written; ``scanned``: the shards this ``open`` scanned (empty when all were indexed)."""

    def __init__(self, shards, header: list[dict], table, location: str, scanned: list[str]):
        self.shards, self.sizes = list(shards), [int(e["size"]) for e in header]
        self.location, self.scanned = location, scanned
        self.shard_errors = {u: e["error"] for u, e in zip(self.shards, header) if e.get("error")}
        counts = [int(e["samples"]) for e in header]
        self.columns: dict[str, np.ndarray] = {"shard": np.repeat(np.arange(len(counts)), counts).astype(np.int64)}
        for k in _INT + _FLOAT:
            self.columns[k] = table.column(k).to_numpy()
        for k in _STR:
            self.columns[k] = np.asarray(table.column(k).to_numpy(zero_copy_only=False), dtype=object)
        self.text = table.column("text").combine_chunks()
        self.members = table.column("members").combine_chunks()

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

    def text_of(self, i: int) -> dict:
        """Sample ``i``'s small text members: ``{extension: parsed JSON (.json) or text}``."""
        return json.loads(self.text[i].as_py())

    def members_of(self, i: int) -> dict[str, list[int]]:
        """Where each member of sample ``i`` lies: ``{extension: [offset, size]}`` (bytes)."""
        return json.loads(self.members[i].as_py())

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
        places = [location] if location is not None else [join(root, name), str(_cache_path(shards, video_key))]
        old = next((f for f in (_read(p, storage, video_key) for p in places) if f is not None), None)
        known = {e["name"]: k for k, e in enumerate(old.shards)} if old else {}
        sizes = _sizes(shards, storage)
        header: list[dict] = []
        todo = []
        for i, (url, size) in enumerate(zip(shards, sizes)):
            k = known.get(relative_name(url, root))
            entry = old.shards[k] if old is not None and k is not None else None
            if size is None:
                if entry is None:
                    raise FileNotFoundError(f"shard {url} does not exist (nor is it in an index)")
                warnings.warn(f"shard {url} is missing: its {entry['samples']} samples fail when read", stacklevel=3)
            elif entry is None or entry["size"] != size:
                todo.append(i)
            header.append(entry)  # replaced below for the shards in todo
        if old is not None and not todo and old.shards == header:
            return cls(shards, header, old.table, old.place, [])
        rescan = set(todo)
        kept = old.lines() if old is not None else []
        lines = [[] if i in rescan else kept[known[relative_name(u, root)]] for i, u in enumerate(shards)]
        for i, (rows, error) in _scan_all(todo, shards, sizes, storage, video_key, progress):
            header[i] = {"name": relative_name(shards[i], root), "size": sizes[i], "samples": len(rows), "error": error}
            lines[i] = [json.dumps(r, separators=(",", ":")).encode() for r in rows]
        head = json.dumps({"helix_shard_index": INDEX_VERSION, "video_key": video_key, "shards": header}).encode()
        body = b"".join(line + b"\n" for part in lines for line in part)
        where = _write(head + b"\n" + body, places, storage)
        return cls(shards, header, _table(body), where, [shards[i] for i in todo])


class _Found(NamedTuple):
    """An index file read: where, its header's shard entries, its rows (Arrow) and its body."""

    place: str
    shards: list[dict]
    table: Any
    body: bytes

    def lines(self) -> list[list[bytes]]:
        """Each shard's raw lines (kept as they are when the file is rewritten)."""
        cut, start, out = self.body.split(b"\n"), 0, []
        for e in self.shards:
            out.append(cut[start : start + int(e["samples"])])
            start += int(e["samples"])
        return out


def _cache_path(shards: list[str], video_key: str):
    from helix_core.config import cache_dir

    return cache_dir() / "shard-index" / cache_name(shards, video_key)


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
    """``(i, (rows, error))`` for each shard ``shards[i]`` of ``todo`` (``scan_shard``), scanned in
    threads under a progress bar of bytes read."""
    if not todo:
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TimeRemainingColumn(), console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task(f"index {len(todo)} shards", total=sum(sizes[i] for i in todo))

        def one(i: int) -> tuple[int, tuple[list[dict], str | None]]:
            try:
                return i, scan_shard(shards[i], sizes[i], storage, video_key, on_fetch=lambda n: bar.advance(task, n))
            except StorageError as e:
                raise OSError(f"cannot index shard {shards[i]}: {e.cause}") from None

        with ThreadPoolExecutor(min(SCAN_THREADS, len(todo))) as pool:
            yield from pool.map(one, todo)


def _read(place: str, storage: Storage, video_key: str) -> _Found | None:
    """The index at ``place``, its rows parsed by pyarrow (a million rows without a Python loop
    per row); None when there is none, or one of another version or ``video_key`` (then it is
    rebuilt)."""
    try:
        if is_url(place):
            size = stat_size(place, storage.options, storage.remote)
            raw = read_range(place, 0, size, storage.options, storage.remote)
        else:
            with open(place, "rb") as f:
                raw = f.read()
    except (OSError, StorageError):
        return None
    first, _, body = raw.partition(b"\n")
    try:
        head = json.loads(first)
        if head.get("helix_shard_index") != INDEX_VERSION or head.get("video_key") != video_key:
            return None
        table = _table(body)
        if table.num_rows != sum(int(e["samples"]) for e in head["shards"]):
            raise ValueError(f"{table.num_rows} rows for the header's {sum(e['samples'] for e in head['shards'])}")
    except Exception as e:  # noqa: BLE001 - a damaged index is rebuilt, never trusted
        warnings.warn(f"shard index {place} cannot be read ({type(e).__name__}: {e}): it is rebuilt", stacklevel=4)
        return None
    return _Found(place, head["shards"], table, body)


def _table(body: bytes):
    """The rows of an index's body (JSON lines) as an Arrow table."""
    import pyarrow as pa
    import pyarrow.json as pj

    if not body or body.isspace():  # (isspace stops at the first other byte: no copy of the body)
        return _schema().empty_table()
    options = pj.ParseOptions(explicit_schema=_schema(), unexpected_field_behavior="ignore")
    return pj.read_json(pa.BufferReader(body), read_options=pj.ReadOptions(block_size=16 << 20), parse_options=options)


def _write(data: bytes, places: list[str], storage: Storage) -> str:
    """Write the index ``data`` at the first of ``places`` that takes it (atomically: a temporary
    file renamed, or one object written whole); the place written. ``OSError`` when none does."""
    failures = []
    for place in places:
        try:
            if is_url(place):
                filesystem(place, storage.options).pipe_file(place, data)
            else:
                os.makedirs(os.path.dirname(place), exist_ok=True)
                tmp = f"{place}.{os.getpid()}.part"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                    os.replace(tmp, place)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            return place
        except Exception as e:  # noqa: BLE001 - a read-only place: the next one
            failures.append(f"{place}: {type(e).__name__}: {e}")
    raise OSError("cannot write the shard index anywhere: " + "; ".join(failures))
