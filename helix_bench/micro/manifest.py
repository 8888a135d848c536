"""``helix bench --manifest [ROWS]``: what building a dataset on a ROWS-row manifest costs, per format.

A manifest of ROWS rows (``path``, ``caption`` of ~60 characters, ``label``, and the source
geometry ``num_frames``, ``height``, ``width``, ``fps``, ``bytes``) is written once per format
(Parquet, CSV, JSON lines) under the data folder; its clips do not exist, so every cost comes from
the manifest's columns (a probe would fail). Each format is measured in a fresh interpreter: the
seconds to build ``VideoClipDataset`` on it, the process's peak resident memory (MB), absolute and
over what the imports alone take, then ``len``, ``estimate_cost(i)`` (microseconds, median over
random rows) and ``cost_arrays()`` (seconds). Prints a table; with ``out``, writes ``manifest.json``.

``shards``: a WebDataset shard set of ``shard_members`` tar members (a small real clip and its
``.json`` per sample, 1,000 samples a shard) instead of a manifest: the first build scans the
shards and writes their index (every member's header walked, every video probed), the second
reads the index back; each in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["FORMATS", "measure_build", "run_manifest_bench", "write_manifest"]

FORMATS = ("parquet", "csv", "jsonl", "shards")
_HEIGHTS = (224, 240, 360, 448, 480, 720, 1080)
_FPS = (24.0, 25.0, 30.0)
_WORDS = (
    "a person slowly juggling three red balls in a sunny park while a dog watches from the grass "
    "two children ride bicycles down a narrow street lined with old stone houses at dusk"
).split()


def write_manifest(path: str | os.PathLike, rows: int, seed: int = 0) -> Path:
    """A ``rows``-row manifest at ``path`` (format by suffix), deterministic per ``seed``; clips
    ``clips/NNNNNNN.mp4`` beside it (not written). Built columnar: no Python object per row, except
    for JSON lines, written a block of rows at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    path = Path(path)
    rng = np.random.default_rng(seed)
    numbers = pc.cast(pa.array(np.arange(rows)), pa.string())
    paths = pc.binary_join_element_wise("clips/", pc.utf8_lpad(numbers, 7, "0"), ".mp4", "")
    starts = rng.integers(0, len(_WORDS) - 12, size=64)
    captions = pa.array([" ".join(_WORDS[s : s + 12])[:60] for s in starts])
    height = rng.choice(_HEIGHTS, rows)
    frames = rng.integers(48, 600, rows)
    width = (np.round(height * 16 / 9 / 2) * 2).astype(np.int64)
    table = pa.table(
        {
            "path": paths,
            "caption": pa.DictionaryArray.from_arrays(rng.integers(0, 64, rows), captions).cast(pa.string()),
            "label": rng.integers(0, 400, rows),
            "num_frames": frames,
            "height": height,
            "width": width,
            "fps": rng.choice(_FPS, rows),
            "bytes": np.round(frames * height * width * rng.uniform(0.05, 0.2, rows) / 8).astype(np.int64),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, tmp)
    elif path.suffix == ".csv":
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, tmp)
    else:
        with open(tmp, "w") as f:
            for start in range(0, rows, 65_536):
                f.writelines(json.dumps(r) + "\n" for r in table.slice(start, 65_536).to_pylist())
    os.replace(tmp, path)
    return path


def write_shard_set(folder: str | os.PathLike, members: int) -> str:
    """``members`` tar members in shards of 1,000 samples under ``folder`` (once): each sample a
    small real H.264 clip (``key.mp4``) and its ``key.json``; returns the set's brace pattern."""
    import io
    import tarfile

    from helix_core.data.media.synth import ClipSpec, write_clip

    folder = Path(folder)
    samples = max(1, members // 2)
    shards = -(-samples // 1000)
    pattern = str(folder / f"train-{{000000..{shards - 1:06d}}}.tar")
    if (folder / f"train-{shards - 1:06d}.tar").exists():
        return pattern
    folder.mkdir(parents=True, exist_ok=True)
    clip = write_clip(folder / "clip.mp4", ClipSpec("clip.mp4", 64, 36, 24, 24.0, 1, "S", 16, 32, "", 0)).read_bytes()
    for k in range(shards):
        tmp = folder / f".train-{k:06d}.tar.part"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(k * 1000, min((k + 1) * 1000, samples)):
                for ext, data in (
                    ("mp4", clip),
                    ("json", json.dumps({"caption": f"clip {i}", "label": i % 400}).encode()),
                ):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, folder / f"train-{k:06d}.tar")
    return pattern


def measure_build(manifest: str | os.PathLike, model: str = "videomae", samples: int = 1000) -> dict:
    """In this process (a fresh one: peak memory is the process's): build the dataset and cost it.
    Seconds, MB (peak resident, absolute and over the imports'), microseconds per estimate."""
    import resource

    import numpy as np

    def peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux

    import pyarrow.csv  # noqa: F401 - the readers' modules count as imports, not as the manifest's cost
    import pyarrow.parquet  # noqa: F401

    from helix_core.data.shards.dataset import WebDatasetClips
    from helix_core.data.video import VideoClipDataset

    imports = peak_mb()
    t = time.perf_counter()
    if str(manifest).endswith(".tar"):
        ds = WebDatasetClips(str(manifest), model=model)
    else:
        ds = VideoClipDataset(manifest, model=model, profiles=False)
    build_s = time.perf_counter() - t
    n = len(ds)
    picks = np.random.default_rng(0).integers(0, n, size=min(samples, n))
    times = []
    for i in picks.tolist():
        t = time.perf_counter()
        ds.estimate_cost(i)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    arrays = ds.cost_arrays()
    cost_arrays_s = time.perf_counter() - t
    peak = peak_mb()
    return {
        "rows": n,
        "build_s": build_s,
        "peak_rss_mb": peak,
        "imports_rss_mb": imports,
        "over_imports_mb": peak - imports,
        "estimate_cost_us": float(np.median(times)) * 1e6,
        "cost_arrays_s": cost_arrays_s,
        "costed_from_manifest": arrays is not None,
        "tokens_sum": int(arrays["tokens"].sum()) if arrays is not None else None,
    }


def run_manifest_bench(
    rows: int = 1_000_000,
    formats: tuple[str, ...] = FORMATS,
    model: str = "videomae",
    data_dir: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    console=None,
    timeout_s: float = 600.0,
    shard_members: int = 10_000,
) -> dict:
    """Write (once) and measure a ``rows``-row manifest per format, each in a fresh interpreter;
    print a table and return ``{format: figures}`` (``out``: also ``OUT/manifest.json``)."""
    from rich.console import Console
    from rich.table import Table

    from helix_core.config import cache_dir

    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats or rows < 1 or shard_members < 2:
        raise ValueError(f"--manifest needs rows >= 1 and formats among {', '.join(FORMATS)} (got {rows}, {formats})")
    console = console or Console()
    folder = Path(data_dir) if data_dir else cache_dir() / "bench-data"
    results = {}

    def measure(source: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-m", "helix_bench.micro.manifest", source, model],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(f"measuring {source} failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    for fmt in formats:
        if fmt == "shards":
            where = folder / f"shards-{shard_members}"
            console.print(f"a shard set of {shard_members:,} members in {where} ...")
            pattern = write_shard_set(where, shard_members)
            for index in where.glob("*.idx.json"):  # the first build scans
                index.unlink()
            size = sum(p.stat().st_size for p in where.glob("train-*.tar")) / 1e6
            results["shards (scan)"] = {"file_mb": size, "members": shard_members, **measure(pattern)}
            results["shards (index)"] = {"file_mb": size, "members": shard_members, **measure(pattern)}
            continue
        path = folder / f"manifest-{rows}" / f"manifest.{fmt}"
        if not path.exists():
            console.print(f"writing a {rows:,}-row {fmt} manifest in {path.parent} ...")
            write_manifest(path, rows)
        results[fmt] = {"file_mb": path.stat().st_size / 1e6, **measure(str(path))}
    table = Table(title=f"building a dataset on a {rows:,}-row manifest ({model}; fresh process per format)")
    if any(f.startswith("shards") for f in results):
        table.caption = f"shards: {shard_members:,} tar members ({shard_members // 2:,} samples); scan: the first build, index: the next"
    for col in ("format", "rows", "build s", "peak RSS MB", "over imports MB", "est. µs", "arrays s", "no probe"):
        table.add_column(col, justify="left" if col == "format" else "right", no_wrap=col in ("format", "rows"))
    for fmt, r in results.items():
        table.add_row(
            fmt,
            f"{r['rows']:,}",
            f"{r['build_s']:.2f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['over_imports_mb']:.0f}",
            f"{r['estimate_cost_us']:.1f}",
            f"{r['cost_arrays_s']:.3f}",
            "yes" if r["costed_from_manifest"] else "no",
        )
    console.print(table)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "manifest.json").write_text(
            json.dumps({"rows": rows, "model": model, "formats": results}, indent=1)
        )
    return results


if __name__ == "__main__":  # one measurement, in the fresh interpreter run_manifest_bench starts
    print(json.dumps(measure_build(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "videomae")))
