"""The offline profile table (paper §4.5): ``profiles.jsonl`` beside the manifest (a manifest at a
URL: wherever the caller says, a local file).

Line 1 is a header ``{"helix_profiles": 1, "fit": {...}, "calibration": [...]}``; every other line
is one sample's source facts (``SampleDescriptor`` fields), its ``bucket``, its calibrated
``cost_scale`` and an ``error`` (null, or why probing failed). Loading is columnar (pyarrow), so a
million rows load without a Python loop per row. Tokens and output bytes are not stored: they
depend on the dataset's model / frames / size and are computed by the dataset, vectorised.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

from helix_core.data.costs import CostFit, calibrate, profile_bucket
from helix_core.data.descriptors import SampleDescriptor
from helix_core.data.manifest import Manifest
from helix_core.data.storage.config import RemoteConfig, Storage
from helix_core.data.storage.urls import is_url, protocol_of
from helix_core.errors import SampleError, text_of

__all__ = [
    "PROBE_BLOCK_BYTES",
    "PROFILE_VERSION",
    "ProfileTable",
    "URL_PROBE_WORKERS",
    "default_out",
    "profile_dataset",
]

PROFILE_VERSION = 1
#: The range-read size of a probe of a clip at a URL. A probe needs the container's header, its
#: index (an MP4's moov, often at the end) and the first keyframe, not a decode's read-ahead: a
#: quarter of the decode's megabyte fetches about half the bytes for one read more, while smaller
#: blocks save few bytes more and cost many reads, each paying the store's first-byte latency.
PROBE_BLOCK_BYTES = 256 << 10
#: Probes in flight at once when clips live at URLs (network waits and PyAV release the GIL).
URL_PROBE_WORKERS = 32
_INT = ("index", "bytes", "frames", "width", "height", "caption_len")
_FLOAT = ("duration_s", "fps", "cost_scale")
_STR = ("path", "codec", "locality", "frames_source", "duration_source", "bucket", "error")


class ProfileTable:
    """Columns of per-sample facts as numpy arrays, plus the cost ``fit`` and calibration points."""

    def __init__(self, columns: dict[str, np.ndarray], fit: CostFit, calibration: list | None = None):
        n = {len(v) for v in columns.values()}
        if len(n) != 1:
            raise ValueError(f"profile columns differ in length: { {k: len(v) for k, v in columns.items()} }")
        missing = [k for k in _INT + _FLOAT + _STR if k not in columns]
        if missing:
            raise ValueError(f"profile table lacks columns {missing}")
        self.columns = columns
        self.fit = fit
        self.calibration = calibration or []

    def __len__(self) -> int:
        return len(self.columns["index"])

    def __getattr__(self, name):
        cols = self.__dict__.get("columns", {})
        if name in cols:
            return cols[name]
        raise AttributeError(name)

    def ok(self) -> np.ndarray:
        """Boolean mask of rows that probed cleanly."""
        errors = self.columns["error"]
        return np.fromiter((not e for e in errors), dtype=bool, count=len(errors))

    def descriptor(self, i: int) -> SampleDescriptor:
        """Row ``i`` as a ``SampleDescriptor``; raises ``SampleError`` for a row that failed."""
        err = self.columns["error"][i]
        if err:
            raise SampleError(int(self.columns["index"][i]), str(self.columns["path"][i]), str(err))
        kw = {f.name: self.columns[f.name][i] for f in fields(SampleDescriptor)}
        for k in _INT:
            kw[k] = int(kw[k])
        for k in ("duration_s", "fps"):
            kw[k] = float(kw[k])
        return SampleDescriptor(**{k: (str(v) if isinstance(v, np.str_) else v) for k, v in kw.items()})

    def summary(self) -> list[dict]:
        """One dict per bucket: clips, mean frames / size / MB, fitted cost scale, failures."""
        rows = []
        buckets = self.columns["bucket"]
        ok = self.ok()
        for b in sorted(set(buckets[ok].tolist())):
            m = (buckets == b) & ok
            rows.append(
                {
                    "bucket": b,
                    "clips": int(m.sum()),
                    "frames": float(self.frames[m].mean()),
                    "width": float(self.width[m].mean()),
                    "height": float(self.height[m].mean()),
                    "mb": float(self.columns["bytes"][m].sum() / 1e6),
                    "cost_scale": float(self.cost_scale[m].mean()),
                }
            )
        if (~ok).any():
            rows.append({"bucket": "(failed)", "clips": int((~ok).sum())})
        return rows

    # ---- persistence -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSONL table atomically (temporary file, then rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.part")
        header = {"helix_profiles": PROFILE_VERSION, "fit": asdict(self.fit), "calibration": self.calibration}
        cols = {k: self.columns[k].tolist() for k in _INT + _FLOAT + _STR}
        for k in _STR:  # a non-UTF-8 file name: its bytes as \xNN escapes (JSON readers refuse lone surrogates)
            cols[k] = [text_of(v) if isinstance(v, str) else v for v in cols[k]]
        keys = list(cols)
        with open(tmp, "w") as f:
            f.write(json.dumps(header) + "\n")
            for row in zip(*(cols[k] for k in keys)):
                f.write(json.dumps(dict(zip(keys, row))) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProfileTable:
        """Read a table written by ``save`` (columnar; no per-row Python work)."""
        import pyarrow as pa
        import pyarrow.json as pj

        path = Path(path)
        with open(path, "rb") as f:
            first = f.readline()
        try:
            header = json.loads(first)
            version = header["helix_profiles"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}, line 1: not a Helix profile table header") from None
        if version != PROFILE_VERSION:
            raise ValueError(f"{path}: profile table version {version}, this Helix reads {PROFILE_VERSION}")
        schema = pa.schema(
            [(k, pa.int64()) for k in _INT] + [(k, pa.float64()) for k in _FLOAT] + [(k, pa.string()) for k in _STR]
        )
        with pa.OSFile(str(path)) as body:  # read block by block: a memory map's pages would count as ours
            body.seek(len(first))
            if body.read(4096).strip():
                body.seek(len(first))
                try:
                    table = pj.read_json(body, parse_options=pj.ParseOptions(explicit_schema=schema))
                except pa.ArrowInvalid as e:
                    raise ValueError(f"{path}: malformed profile rows ({e}); re-run `helix profile`") from None
            else:
                table = schema.empty_table()
        cols = {}
        for k in _INT + _FLOAT:
            cols[k] = table.column(k).to_numpy(zero_copy_only=False)
        for k in _STR:  # paths stay arrow (a str per row is a million objects); the rest repeat a few values
            cols[k] = _Strings(table.column(k)) if k == "path" else _shared_objects(table.column(k))
        del table
        pa.default_memory_pool().release_unused()  # the parse's buffers, freed but kept by the allocator
        return cls(cols, CostFit(**header["fit"]), header.get("calibration", []))


def _shared_objects(column) -> np.ndarray:
    """An arrow string column as an object array in which equal values are one str."""
    encoded = column.combine_chunks().dictionary_encode()
    values = np.array([*encoded.dictionary.to_pylist(), None], dtype=object)
    return values[encoded.indices.fill_null(len(encoded.dictionary)).to_numpy()]


class _Strings(Sequence):
    """A column of distinct strings kept as arrow (``arrow``): a str is made per access."""

    def __init__(self, arrow):
        self.arrow = arrow

    def __len__(self) -> int:
        return len(self.arrow)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.arrow[i].as_py()

    def tolist(self) -> list:
        return self.arrow.to_pylist()


def _probe_row(args):
    from helix_core.data.media.probe import probe

    i, path, caption_len, locality, storage = args
    row = {"index": i, "path": path, "caption_len": caption_len, "locality": locality}
    try:
        return probe(path, index=i, caption_len=caption_len, locality=locality, storage=storage).to_dict(), None
    except SampleError as e:
        return row, e.cause
    except Exception as e:  # noqa: BLE001 - one clip's surprise is its row's error, not the table's end
        return row, f"{type(e).__name__}: {e}"


def default_out(manifest: str | os.PathLike) -> Path:
    """Where ``profile_dataset`` saves the table when not told: ``profiles.jsonl`` beside a local
    manifest (where ``VideoClipDataset`` looks for it). A manifest at a URL has no local folder, and
    its bucket may not be writable: ``ValueError`` asking for ``out``."""
    if is_url(str(manifest)):
        raise ValueError(
            f"manifest {manifest} is at a URL: say where to save its profile table, a local file "
            f"(profile_dataset(..., out='profiles.jsonl'); helix profile --out profiles.jsonl), and give the "
            "same path to the dataset (VideoClipDataset(..., profiles='profiles.jsonl'))"
        )
    return Path(manifest).parent / "profiles.jsonl"


def _probe_storage(storage: Storage) -> Storage:
    """``storage`` for probes: range reads of at least ``PROBE_BLOCK_BYTES`` (a header is read in a
    few requests: a store's latency is paid per request), no local block cache (decodes fill it)."""
    remote = storage.remote
    return Storage(
        storage.options,
        RemoteConfig(
            **{**remote.to_dict(), "block_bytes": max(remote.block_bytes, PROBE_BLOCK_BYTES), "cache_bytes": 0}
        ),
    )


def profile_dataset(
    manifest: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    calibrate_per_bucket: int = 2,
    workers: int | None = None,
    progress: bool = False,
    storage_options: dict | None = None,
    remote: RemoteConfig | dict | None = None,
) -> ProfileTable:
    """Probe every clip of ``manifest`` (metadata only), calibrate the CPU-cost fit on a few clips
    per bucket, and save the table at ``out`` — by default ``profiles.jsonl`` beside a local
    manifest; a manifest at a URL needs ``out`` (a local file; ``default_out``).

    The manifest and its clips may be URLs (``s3://``, ``https://``, ...), read through fsspec with
    ``storage_options`` (endpoints, regions; never credentials) and ``remote`` (a ``RemoteConfig``):
    a probe reads the container's header by range reads of ``PROBE_BLOCK_BYTES``, ``workers``
    probes in flight (default ``URL_PROBE_WORKERS`` when clips are URLs, else 1); a calibration
    decode fetches its clip once. The table is keyed by the manifest's resolved paths — the URLs
    themselves — so ``VideoClipDataset(manifest, profiles=out, storage_options=...)`` takes it.

    A clip that fails to probe (missing, unreadable, not a video) gets a row with its ``error``;
    profiling never stops for one bad file.
    """
    from rich.progress import Progress

    if out is None:
        out = default_out(manifest)  # before any work: a URL manifest says where first
    storage = Storage.of(storage_options, remote)
    man = Manifest(manifest, storage=storage)
    urls = any(is_url(p) for p in man.paths)
    if workers is None:
        workers = URL_PROBE_WORKERS if urls else 1
    if workers < 1:
        raise ValueError(f"profile_dataset(workers={workers!r}): must be >= 1")
    probing = _probe_storage(_with_connections(storage, man.paths, workers)) if urls else storage
    jobs = [
        (i, p, len(r.get("caption", "") or ""), str(r.get("locality", "local")), probing)
        for i, (p, r) in enumerate(zip(man.paths, man.records))
    ]
    with Progress(disable=not progress) as bar:
        task = bar.add_task("probe", total=len(jobs))
        results: list = [None] * len(jobs)

        def keep(row) -> None:
            results[row[0]["index"]] = row
            bar.advance(task)

        if workers > 1:  # PyAV and network waits release the GIL
            from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

            with ThreadPoolExecutor(workers, thread_name_prefix="helix-probe") as pool:
                running: set = set()
                for job in jobs:  # a bounded window of futures, not one per clip of a million-row manifest
                    if len(running) >= 4 * workers:
                        done, running = wait(running, return_when=FIRST_COMPLETED)
                        for f in done:
                            keep(f.result())
                    running.add(pool.submit(_probe_row, job))
                for f in wait(running).done:
                    keep(f.result())
        else:
            for job in jobs:
                keep(_probe_row(job))
        descs = [SampleDescriptor.from_dict(d) for d, err in results if err is None]
        cal = bar.add_task("calibrate", total=None)
        fit, scale, points = calibrate(
            descs, per_bucket=calibrate_per_bucket, progress=lambda: bar.advance(cal), storage=storage
        )
    cols = _columns(results)
    cols["cost_scale"] = np.array([scale.get(b, 1.0) for b in cols["bucket"]], dtype=np.float64)
    table = ProfileTable(cols, fit, points)
    table.save(out)
    return table


def _with_connections(storage: Storage, paths, workers: int) -> Storage:
    """``storage`` with enough connections for ``workers`` probes at once where the clips are on
    S3 (s3fs holds 10 unless told; the option means nothing to other stores, so it goes to S3 only)."""
    if not all(protocol_of(p) in ("s3", "s3a") for p in paths):
        return storage
    options = dict(storage.options)
    cfg = dict(options.get("config_kwargs") or {})
    cfg.setdefault("max_pool_connections", max(workers, 10))
    options["config_kwargs"] = cfg
    return Storage(options, storage.remote)


def _columns(results) -> dict[str, np.ndarray]:
    defaults = {
        "bytes": 0,
        "duration_s": 0.0,
        "fps": 0.0,
        "frames": 0,
        "width": 0,
        "height": 0,
        "codec": "",
        "frames_source": "header",
        "duration_source": "header",
    }
    cols: dict[str, list] = {k: [] for k in _INT + _FLOAT + _STR if k not in ("bucket", "cost_scale")}
    for d, err in results:
        for k in cols:
            cols[k].append(err if k == "error" else d.get(k, defaults.get(k)))
    arrays = {
        k: np.asarray(v, dtype=object if k in _STR else (np.int64 if k in _INT else np.float64))
        for k, v in cols.items()
    }
    arrays["bucket"] = np.asarray(profile_bucket(arrays["frames"], arrays["width"], arrays["height"]), dtype=object)
    return arrays
