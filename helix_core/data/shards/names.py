"""What things in a shard set are called: the shards a pattern names, the sample key and extension
of a tar member (WebDataset's rules), and where a set's index is kept.

Patterns are expanded as WebDataset expands them: brace expansion (the ``braceexpand`` package,
``train-{000000..000099}.tar``, ``{a,b}``), several patterns joined by ``::``, or a list of
shards as given. A member ``dir/clip_07.seg.mp4`` belongs to the sample ``dir/clip_07`` (the name
up to the first dot of its last part) with extension ``seg.mp4`` (lower-cased); names with no dot
and top-level ``__name__`` entries are not sample members.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re

from helix_core.data.storage.urls import is_url, local_path

__all__ = ["INDEX_VERSION", "cache_name", "index_name", "relative_name", "shard_urls", "split_member"]

_MEMBER = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: not a sample's member
INDEX_VERSION = 1


def shard_urls(source: str | os.PathLike | list | tuple) -> list[str]:
    """The shards ``source`` names, in order: a pattern (``::`` joins several) brace-expanded, or a
    list of shards as given. Local ones come back as absolute paths, URLs as written."""
    if isinstance(source, (str, os.PathLike)):
        from braceexpand import braceexpand

        names = [u for part in os.fspath(source).split("::") if part for u in braceexpand(part)]
    elif isinstance(source, (list, tuple)) and all(isinstance(u, (str, os.PathLike)) for u in source):
        names = [os.fspath(u) for u in source]
    else:
        raise TypeError(f"shards must be a pattern or a list of paths / URLs, got {type(source).__name__}")
    if not names:
        raise ValueError(f"{source!r} names no shard")
    return [u if is_url(u) else local_path(u) for u in names]


def split_member(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a tar member by WebDataset's rule, or None for a member that is not
    part of a sample (no dot in its last part; a ``__meta__`` entry)."""
    if _META.match(name) or ("/" not in name and name.startswith("__") and name.endswith("__")):
        return None
    m = _MEMBER.match(name)
    if m is None:
        return None
    return m.group(1), m.group(2).lower()


def _folder(url: str) -> str:
    return url.rsplit("/", 1)[0] if is_url(url) else os.path.dirname(url)


def relative_name(url: str, root: str) -> str:
    """``url`` as the index stores it: relative to the index's folder ``root`` when it lies
    under it (so a set copied elsewhere — a local folder uploaded to a bucket — keeps its index),
    else as it is."""
    prefix = root.rstrip("/") + "/"
    return url[len(prefix) :] if url.startswith(prefix) else url


def index_name(urls: list[str], video_key: str) -> tuple[str, str]:
    """``(root, file name)`` of the index of the set ``urls`` beside its shards: in the first shard's
    folder, named by a hash of the shards' names relative to that folder and of ``video_key``, so
    one folder holds the indexes of several sets and a moved set keeps its own."""
    root = _folder(urls[0])
    names = "\n".join(relative_name(u, root) for u in urls)
    digest = hashlib.sha256(f"{INDEX_VERSION}\0{video_key}\0{names}".encode()).hexdigest()[:16]
    stem = posixpath.basename(urls[0]).split(".", 1)[0] or "shards"
    return root, f"{stem}.{len(urls)}-shards.{digest}.idx.json"


def cache_name(urls: list[str], video_key: str) -> str:
    """The file name of the set's index in the local cache folder: keyed by the full URLs (sizes
    are checked inside, per shard)."""
    digest = hashlib.sha256((f"{INDEX_VERSION}\0{video_key}\0" + "\n".join(urls)).encode()).hexdigest()[:32]
    return f"{digest}.idx.json"
