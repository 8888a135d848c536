"""The manifest: one sample per row — JSON lines (``.jsonl``), CSV (``.csv``, a header row) or
Parquet (``.parquet``). A path column is required (absolute, or relative to the manifest's
folder), caption and label columns optional, unknown columns kept and passed through. The column
names are the caller's (``path_key``, ``caption_key``, ``label_key``); a sample's record names
them ``path`` / ``caption`` / ``label`` whatever the file calls them.

CSV and Parquet are read columnar (pyarrow) and stay columnar: a million-row manifest is a few
arrays, not a million dicts; ``records[i]`` and ``paths[i]`` build one row on demand and
``hint(key)`` is one column as floats. JSON lines keep a dict per line (their values may nest).

Numeric columns may describe a row before its clip is opened (hints; NaN where a row lacks one):

- **Source geometry**, by Open-Sora's names: ``height`` and ``width`` (pixels of the coded
  picture), ``num_frames`` (frames in the clip), ``fps`` (frames per second), ``duration``
  (seconds), and ``bytes`` (the clip file's size in bytes). A manifest describes its clips when it
  has both a ``height`` and a ``width`` column (``source_hints``); a row's frame count is then its
  ``num_frames``, else ``duration x fps``, and its rate ``fps``, else ``num_frames / duration``.
- **Output hints**: ``size`` (the model's input size, pixels) and, in a manifest without
  ``height`` / ``width``, ``num_frames`` (frames the model samples): per-sample values of the
  dataset's ``size`` / ``num_frames`` where it leaves them ``None`` (``output_hints``; what the
  synthetic workloads write). In a manifest that describes its clips ``num_frames`` is the clip's
  length, never a number of frames to sample; ``size`` is never a number of bytes.

The manifest itself may be a URL (``s3://bucket/train.parquet``), read once through fsspec with the
caller's ``storage_options``; its relative paths are then relative to its folder on the store."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from helix_core.data.storage.config import Storage
from helix_core.data.storage.urls import is_url, join, local_path
from helix_core.errors import ManifestError

__all__ = ["Manifest", "SOURCE_COLUMNS", "SourceHints"]

#: The columns that describe a row's source clip (see the module's docstring); ``height`` and
#: ``width`` both present make a manifest one that describes its clips.
SOURCE_COLUMNS = ("height", "width", "num_frames", "fps", "duration", "bytes")


class SourceHints(NamedTuple):
    """Source facts of a run of rows as the manifest states them (float64 arrays, NaN where a row
    lacks one or states one that is not positive): ``frames`` (frames in the clip), ``fps``
    (frames per second), ``height`` / ``width`` (pixels), ``bytes`` (the file's size, bytes)."""

    frames: np.ndarray
    fps: np.ndarray
    height: np.ndarray
    width: np.ndarray
    bytes: np.ndarray


class Manifest:
    """Parsed manifest: ``records[i]`` is the i-th sample's dict, ``paths[i]`` its resolved path."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        path_key: str = "path",
        caption_key: str = "caption",
        label_key: str = "label",
        storage: Storage | None = None,
    ):
        self.storage = storage or Storage.of()
        if is_url(str(path)):
            self.path: str | Path = str(path)
            self.root = str(path).rsplit("/", 1)[0]
        else:  # clip paths are the same from any working directory
            self.path = Path(local_path(path))
            self.root = str(self.path.parent)
        self.keys = {"path": path_key, "caption": caption_key, "label": label_key}
        suffix = os.path.splitext(str(self.path))[1].lower()  # .csv / .parquet by name; else JSON lines
        if isinstance(self.path, Path) and not self.path.is_file():
            raise FileNotFoundError(f"manifest {self.path}: No such file or directory")
        self._renames = [(name, key) for name, key in self.keys.items() if key != name]
        self._columns: frozenset[str] | None = None
        if suffix not in (".csv", ".parquet"):
            self._table = None
            self.records: Sequence[dict] = self._read_jsonl()
        else:
            self._table = self._read_columnar(suffix)
            self.records = _Rows(self)
        self.paths: Sequence[str] = _Paths(self)  # resolved on access: a million joins take seconds
        if not len(self.records):
            raise ManifestError(str(self.path), 1, "manifest has no samples")

    # ---- JSON lines --------------------------------------------------------------------------
    def _open(self):
        """The manifest file for reading: local, or fetched whole from its URL (a missing object is
        ``FileNotFoundError`` naming it, a refused one ``PermissionError``, any other failure
        ``ManifestError``)."""
        if isinstance(self.path, Path):
            return open(self.path, "rb")
        import io

        from helix_core.data.storage.reader import StorageError, read_range, stat_size

        try:
            size = stat_size(self.path, self.storage.options, self.storage.remote)
            return io.BytesIO(read_range(self.path, 0, size, self.storage.options, self.storage.remote))
        except StorageError as e:
            if e.cause.startswith("stat: object not found"):
                raise FileNotFoundError(f"manifest {self.path}: {e.cause}") from None
            if "access refused" in e.cause:
                raise PermissionError(f"manifest {self.path}: {e.cause}") from None
            raise ManifestError(str(self.path), 1, f"cannot read it: {e.cause}") from None

    def _read_jsonl(self) -> list[dict]:
        records = []
        with self._open() as f:
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    records.append(self._parse(raw, lineno))
        return records

    def _parse(self, raw: bytes, lineno: int) -> dict:
        try:
            rec = json.loads(raw.decode("utf-8"))  # str: json skips guessing the encoding of bytes
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(str(self.path), lineno, f"not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ManifestError(str(self.path), lineno, f"expected a JSON object, got {type(rec).__name__}")
        rec = self._renamed(rec)
        path = rec.get("path")
        if not isinstance(path, str) or not path:
            raise ManifestError(
                str(self.path), lineno, f"missing required field {self.keys['path']!r} (a non-empty string)"
            )
        if "caption" in rec and not isinstance(rec["caption"], str):
            raise ManifestError(str(self.path), lineno, f"field {self.keys['caption']!r} must be a string")
        if "label" in rec and not isinstance(rec["label"], int):
            raise ManifestError(str(self.path), lineno, f"field {self.keys['label']!r} must be an integer")
        return rec

    def _renamed(self, rec: dict) -> dict:
        for name, key in self._renames:
            if key in rec:
                rec[name] = rec.pop(key)
        return rec

    # ---- CSV and Parquet (columnar) ------------------------------------------------------------
    def _read_columnar(self, suffix: str):
        import pyarrow as pa
        import pyarrow.compute as pc

        try:
            with self._open() as f:
                source = str(self.path) if isinstance(self.path, Path) else f  # a path: arrow reads it itself
                if suffix == ".csv":
                    from pyarrow import csv

                    # batch by batch, in memory from malloc: the parse buffers freed go to the cost arrays
                    table = csv.open_csv(source, memory_pool=pa.system_memory_pool()).read_all()
                else:
                    import pyarrow.parquet as pq

                    table = pq.ParquetFile(source).read()
        except (pa.ArrowInvalid, OSError) as e:  # a broken row names its line (CSV) or the file's fault
            line = self._broken_csv_line() if suffix == ".csv" and isinstance(e, pa.ArrowInvalid) else None
            raise ManifestError(str(self.path), line or 1, f"cannot read it as {suffix[1:]}: {e}") from None
        pa.default_memory_pool().release_unused()  # the parse's buffers, freed but kept by the allocator
        first = 2 if suffix == ".csv" else 1  # CSV: the header is line 1
        names = {v: k for k, v in self.keys.items() if v in table.column_names}
        if self.keys["path"] not in names:
            raise ManifestError(
                str(self.path),
                1,
                f"no column {self.keys['path']!r} for the clips' paths (columns: {table.column_names})",
            )
        table = table.rename_columns([names.get(c, c) for c in table.column_names])
        checks = {"path": pa.types.is_string, "caption": pa.types.is_string, "label": pa.types.is_integer}
        for name, ok in checks.items():
            if name in table.column_names:
                col = table.column(name)
                if not (ok(col.type) or pa.types.is_large_string(col.type) and name != "label"):
                    raise ManifestError(
                        str(self.path), first, f"column {self.keys[name]!r} must hold {ok.__name__[3:]}, not {col.type}"
                    )
        bad = pc.or_(pc.is_null(table.column("path")), pc.equal(pc.utf8_length(table.column("path")), 0))
        if pc.any(bad).as_py():
            row = int(np.flatnonzero(bad.to_numpy(zero_copy_only=False))[0])
            raise ManifestError(
                str(self.path), first + row, f"missing required field {self.keys['path']!r} (a non-empty string)"
            )
        return table  # in its chunks as read: combining them would copy every column

    def _broken_csv_line(self) -> int | None:
        """The line of the first row pyarrow cannot parse: read again on one thread, the only
        way its parser numbers rows (the error path only: a manifest that parses keeps its threads)."""
        from pyarrow import csv

        rows = []

        def handler(row) -> str:
            rows.append(row.number)
            return "error"

        try:
            with self._open() as f:
                csv.read_csv(
                    f,
                    read_options=csv.ReadOptions(use_threads=False),
                    parse_options=csv.ParseOptions(invalid_row_handler=handler),
                )
        except Exception:  # noqa: BLE001 - the first error is the one reported
            pass
        return rows[0] if rows else None

    def _row(self, i: int) -> dict:
        rec = {name: self._table.column(name)[i].as_py() for name in self._table.column_names}
        return {k: v for k, v in rec.items() if v is not None or k == "path"}

    # ---- shared --------------------------------------------------------------------------------
    def resolve(self, path: str) -> str:
        """A row's path: a URL or an absolute path as written, else relative to the manifest's folder."""
        return join(self.root, path)

    def __len__(self) -> int:
        return len(self.records)

    def raw_path(self, i: int) -> str:
        """Row ``i``'s path as written."""
        if self._table is not None:
            return self._table.column("path")[i].as_py()
        return self.records[i]["path"]

    def resolved_paths(self):
        """Every row's resolved path as one pyarrow string array (vectorised for a local manifest's
        relative and absolute paths: a million rows without a Python string each)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if self._table is None:
            from helix_core.errors import text_of

            return pa.array([text_of(p) for p in self.paths], type=pa.string())
        col = self._table.column("path")
        if is_url(self.root) or pc.any(pc.starts_with(col, "file://")).as_py():
            return pa.array(list(self.paths), type=pa.string())  # normalised joins: one by one
        kept = pc.or_(pc.starts_with(col, "/"), pc.match_substring_regex(col, r"^[A-Za-z][A-Za-z0-9+.-]*://"))
        prefix = self.root if self.root.endswith("/") else self.root + "/"
        return pc.if_else(kept, col, pc.binary_join_element_wise(prefix, col, ""))

    @property
    def columns(self) -> frozenset[str]:
        """The manifest's column names (JSON lines: every key of any line), with the path, caption
        and label columns named ``path`` / ``caption`` / ``label``."""
        if self._columns is None:
            if self._table is not None:
                self._columns = frozenset(self._table.column_names)
            else:
                keys: set[str] = set()
                for r in self.records:
                    keys.update(r)
                self._columns = frozenset(keys)
        return self._columns

    def hint(self, key: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Per-sample numeric hint ``key`` of rows ``start:stop`` (all by default) as float64,
        NaN where absent or not a number, e.g. ``num_frames`` / ``size``."""
        start, stop, _ = slice(start, stop).indices(len(self))
        n = max(stop - start, 0)
        if key not in self.columns:
            return np.full(n, np.nan)
        if self._table is not None:
            col = self._table.column(key).slice(start, n)
            try:
                return col.cast("float64").to_numpy(zero_copy_only=False)
            except Exception:  # noqa: BLE001 - a non-numeric column gives no hint
                return np.full(n, np.nan)
        return _numbers([r.get(key) for r in self.records[start:stop]])

    @property
    def describes_sources(self) -> bool:
        """Whether the manifest states its clips' geometry (it has ``height`` and ``width`` columns)."""
        return {"height", "width"} <= self.columns

    def source_hints(self, start: int = 0, stop: int | None = None) -> SourceHints | None:
        """The source geometry of rows ``start:stop`` as the manifest states it, or None when it
        does not describe its clips (see the module's docstring for the columns)."""
        if not self.describes_sources:
            return None
        frames, fps, duration = (_positive(self.hint(k, start, stop)) for k in ("num_frames", "fps", "duration"))
        with np.errstate(invalid="ignore"):
            frames = np.where(np.isnan(frames), np.round(duration * fps), frames)
            fps = np.where(np.isnan(fps), frames / duration, fps)
        return SourceHints(
            _positive(frames),
            _positive(fps),
            *(_positive(self.hint(k, start, stop)) for k in ("height", "width", "bytes")),
        )

    def output_hints(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Per-sample ``(num_frames, size)`` overrides (float64, NaN where a row has none), each
        None where the manifest has no such column; ``num_frames`` is None in a manifest that
        describes its clips (there it is the clip's length)."""
        frames = None if self.describes_sources or "num_frames" not in self.columns else self.hint("num_frames")
        size = self.hint("size") if "size" in self.columns else None
        return frames, size


def _numbers(values: list) -> np.ndarray:
    """JSON values as float64: NaN for anything but a number (a bool, a string, a list, null)."""
    if {type(v) for v in values} <= {int, float, type(None)}:
        return np.array(values, dtype=np.float64)  # None is NaN: one C loop for the common column
    return np.array(
        [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan for v in values],
        dtype=np.float64,
    )


def _positive(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(x) & (x > 0), x, np.nan)


class _Rows(Sequence):
    """A columnar manifest's records, one dict built per access."""

    def __init__(self, manifest: Manifest):
        self._m = manifest

    def __len__(self) -> int:
        return len(self._m._table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._m._row(_index(i, len(self)))


class _Paths(Sequence):
    """A manifest's resolved paths, one resolved per access."""

    def __init__(self, manifest: Manifest):
        self._m = manifest

    def __len__(self) -> int:
        return len(self._m)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._m.resolve(self._m.raw_path(_index(i, len(self))))


def _index(i: int, n: int) -> int:
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"sample {i} out of range for a manifest of {n}")
    return i
