"""Where a sample lives: a local path or a URL that fsspec opens (``s3://``, ``gs://``,
``http(s)://``, ...). ``file://`` URLs and plain paths are local and read as files."""

from __future__ import annotations

import os
import posixpath
import re

__all__ = ["is_url", "join", "local_path", "protocol_of"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def protocol_of(location: str) -> str | None:
    """The URL's scheme (``"s3"``, ``"https"``), or None for a local path (``file://`` included)."""
    m = _SCHEME.match(str(location))
    if m is None or m.group(1).lower() == "file":
        return None
    return m.group(1).lower()


def is_url(location) -> bool:
    """True when ``location`` is a remote URL (not a local path, not ``file://``)."""
    return isinstance(location, str) and protocol_of(location) is not None


def local_path(location) -> str:
    """A local location as a plain absolute path (``file:///x`` -> ``/x``)."""
    s = os.fspath(location)
    if s.startswith("file://"):
        s = s[len("file://") :]
    return os.path.abspath(s)


def join(base_dir: str, rel: str) -> str:
    """``rel`` resolved against the folder ``base_dir`` (a URL or a local path); an absolute path
    or a URL in ``rel`` is kept as it is."""
    if is_url(rel) or rel.startswith("file://"):
        return rel if is_url(rel) else local_path(rel)
    if os.path.isabs(rel):
        return rel
    if is_url(base_dir):
        scheme, rest = base_dir.split("://", 1)
        return f"{scheme}://{posixpath.normpath(posixpath.join(rest, rel))}"
    return os.path.join(base_dir, rel)
