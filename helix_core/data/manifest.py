"""The manifest: one sample per row — JSON lines (``.jsonl``), CSV (``.csv``, a header row) or
Parquet (``.parquet``). A path column is required (absolute, or relative to the manifest's
folder), caption and label columns optional, unknown columns kept and passed through. The column
names are the caller's (``path_key``, ``caption_key``, ``label_key``); a sample's record names
them ``path`` / ``caption`` / ``label`` whatever the file calls them.

CSV and Parquet are read columnar (pyarrow) and stay columnar: a million-row manifest is a few
arrays, not a million dicts; ``records[i]`` and ``paths[i]`` build one row on demand and
``hint(key)`` is one column as floats. JSON lines keep a dict per line (their values may nest).

The manifest itself may be a URL (``s3://bucket/train.parquet``), read once through fsspec with the
caller's ``storage_options``; its relative paths are then relative to its folder on the store."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from helix_core.data.storage.config import Storage
from helix_core.data.storage.urls import is_url, join, local_path
from helix_core.errors import ManifestError

__all__ = ["Manifest"]


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
        if suffix not in (".csv", ".parquet"):
            self.records: Sequence[dict] = self._read_jsonl()
            self.paths: Sequence[str] = [self.resolve(r["path"]) for r in self.records]
            self._table = None
        else:
            self._table = self._read_columnar(suffix)
            self.records = _Rows(self)
            self.paths = _Paths(self)
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
            rec = json.loads(raw)
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
        for name, key in self.keys.items():
            if key != name and key in rec:
                rec[name] = rec.pop(key)
        return rec

    # ---- CSV and Parquet (columnar) ------------------------------------------------------------
    def _read_columnar(self, suffix: str):
        import pyarrow as pa
        import pyarrow.compute as pc

        try:
            with self._open() as f:
                if suffix == ".csv":
                    from pyarrow import csv

                    table = csv.read_csv(f)
                else:
                    import pyarrow.parquet as pq

                    table = pq.read_table(f)
        except (pa.ArrowInvalid, OSError) as e:  # a broken row names its line (CSV) or the file's fault
            line = self._broken_csv_line() if suffix == ".csv" and isinstance(e, pa.ArrowInvalid) else None
            raise ManifestError(str(self.path), line or 1, f"cannot read it as {suffix[1:]}: {e}") from None
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
        return table.combine_chunks()

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

    def hint(self, key: str) -> list[float] | np.ndarray:
        """Per-sample numeric hint ``key`` (NaN where absent), e.g. ``num_frames`` / ``size``."""
        if self._table is not None:
            if key not in self._table.column_names:
                return np.full(len(self._table), np.nan)
            col = self._table.column(key)
            try:
                return col.cast("float64").to_numpy(zero_copy_only=False)
            except Exception:  # noqa: BLE001 - a non-numeric column gives no hint
                return np.full(len(self._table), np.nan)
        out = []
        for r in self.records:
            v = r.get(key)
            out.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan"))
        return out


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
    """A columnar manifest's resolved paths, one per access."""

    def __init__(self, manifest: Manifest):
        self._m, self._col = manifest, manifest._table.column("path")

    def __len__(self) -> int:
        return len(self._col)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._m.resolve(self._col[_index(i, len(self))].as_py())


def _index(i: int, n: int) -> int:
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"sample {i} out of range for a manifest of {n}")
    return i
