"""A manifest's clips packed as WebDataset tar shards, with the set's index beside them.

Each sample is ``<key>.<ext>`` (the clip's bytes as they are, ``ext`` its suffix) followed by
``<key>.json`` (its manifest record without the path: caption, label, hints such as
``num_frames`` / ``size``, and any other column). Keys are the clips' file names up to the first
dot, or their row numbers when two clips would share one. The tar headers
carry no time, owner or mode of the machine that wrote them, so the same manifest and clips give
the same bytes anywhere.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import tarfile
from pathlib import Path

from helix_core.data.manifest import Manifest
from helix_core.data.storage.config import Storage
from helix_core.data.storage.reader import StorageError, read_range, stat_size
from helix_core.data.storage.urls import is_url
from helix_core.errors import SampleError

__all__ = ["write_shards"]


def write_shards(
    source,
    pattern: str | os.PathLike,
    samples_per_shard: int = 100,
    *,
    storage_options: dict | None = None,
    progress: bool = False,
) -> list[Path]:
    """Write the clips of ``source`` — a manifest (a path or URL, ``.jsonl`` / ``.csv`` /
    ``.parquet``), a ``Manifest``, or a ``VideoClipDataset`` (its manifest) — as tar shards of
    ``samples_per_shard`` samples at ``pattern`` (a local path with a printf field, as WebDataset's
    ``ShardWriter`` takes it: ``"out/train-%06d.tar"``), index them, and return the shards' paths
    (pass them, or the brace pattern they make, to ``WebDatasetClips``). A clip that cannot be
    read raises ``SampleError`` naming it. ``storage_options``: fsspec's options for clips at URLs."""
    if isinstance(samples_per_shard, bool) or not isinstance(samples_per_shard, int) or samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be an int >= 1, got {samples_per_shard!r}")
    pattern = os.fspath(pattern)
    try:
        first, second = pattern % 0, pattern % 1
    except (TypeError, ValueError):
        first = second = pattern
    if first == second or is_url(pattern):
        raise ValueError(f"pattern {pattern!r} must be a local path with one printf field, e.g. 'out/train-%06d.tar'")
    manifest, storage = _manifest(source, storage_options)
    keys = _keys(manifest.paths)
    n = len(manifest)
    paths = []
    from rich.progress import Progress

    with Progress(disable=not progress) as bar:
        task = bar.add_task("write shards", total=n)
        for s, start in enumerate(range(0, n, samples_per_shard)):
            path = Path(pattern % s).absolute()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.part")
            with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
                for i in range(start, min(start + samples_per_shard, n)):
                    clip = manifest.paths[i]
                    ext = posixpath.splitext(clip)[1].lower().lstrip(".") or "mp4"
                    record = {k: v for k, v in manifest.records[i].items() if k != "path"}
                    _add(tar, f"{keys[i]}.{ext}", _read(clip, i, storage))
                    _add(tar, f"{keys[i]}.json", json.dumps(record, sort_keys=True).encode())
                    bar.advance(task)
            os.replace(tmp, path)
            paths.append(path)
    from helix_core.data.shards.dataset import VIDEO_KEY
    from helix_core.data.shards.index import ShardIndex

    ShardIndex.open([str(p) for p in paths], Storage.of(), VIDEO_KEY, progress=progress)
    return paths


def _manifest(source, storage_options) -> tuple[Manifest, Storage]:
    if isinstance(source, Manifest):
        return source, source.storage
    manifest = getattr(source, "manifest", None)
    if isinstance(manifest, Manifest):  # a VideoClipDataset
        return manifest, manifest.storage
    storage = Storage.of(storage_options)
    return Manifest(source, storage=storage), storage


def _keys(paths) -> list[str]:
    """Sample keys: the file names up to their first dot, unless two clips would share one."""
    stems = [posixpath.basename(p.replace(os.sep, "/")).split(".", 1)[0] or f"{i:08d}" for i, p in enumerate(paths)]
    if len(set(stems)) == len(stems):
        return stems
    return [f"{i:08d}" for i in range(len(stems))]


def _read(clip: str, index: int, storage: Storage) -> bytes:
    try:
        if is_url(clip):
            size = stat_size(clip, storage.options, storage.remote)
            return read_range(clip, 0, size, storage.options, storage.remote)
        with open(clip, "rb") as f:
            return f.read()
    except StorageError as e:
        raise SampleError(index, clip, e.cause) from None
    except OSError as e:
        raise SampleError(index, clip, f"cannot read the clip: {e.strerror or e}") from None


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))
