"""`helix microbench`: decode frames/s per core per kinetics profile, probe ms per file, and the
time to load a million-row profile table. Prints a table; medians over repeats."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

__all__ = ["run_microbench"]

_PROFILES = ("kinetics-small", "kinetics-mid", "kinetics-large")


def _decode_rates(root: Path, model_frames: int, size: int, repeats: int = 3) -> tuple[float, float]:
    """(source frames decoded per CPU second, sampled frames per CPU second), medians."""
    from helix_core.data.video import VideoClipDataset

    ds = VideoClipDataset(root / "manifest.jsonl", model="videomae", num_frames=model_frames, size=size, profiles=False)
    src, out = [], []
    for _ in range(repeats):
        for i in range(len(ds)):
            _, r = ds.fetch(i)
            src.append(ds.descriptor(i).frames / r.cpu_s)
            out.append(model_frames / r.cpu_s)
    return statistics.median(src), statistics.median(out)


def _probe_ms(paths: list[Path], repeats: int = 5) -> float:
    from helix_core.data.media.probe import probe

    times = []
    for _ in range(repeats):
        for p in paths:
            t = time.perf_counter()
            probe(p)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _write_big_table(path: Path, rows: int) -> None:
    row = {
        "index": 0,
        "path": "",
        "bytes": 123456,
        "duration_s": 5.0,
        "fps": 30.0,
        "frames": 150,
        "width": 398,
        "height": 224,
        "caption_len": 40,
        "cost_scale": 1.0,
        "codec": "h264",
        "locality": "local",
        "frames_source": "header",
        "duration_source": "header",
        "bucket": "128f@224p",
        "error": None,
    }
    head, tail = json.dumps(row).split('"path": ""')
    with open(path, "w") as f:
        f.write(json.dumps({"helix_profiles": 1, "fit": {}}) + "\n")
        step = 100_000
        for start in range(0, rows, step):
            f.write(
                "".join(
                    head.replace('"index": 0', f'"index": {i}') + f'"path": "clips/{i:07d}.mp4"' + tail + "\n"
                    for i in range(start, min(rows, start + step))
                )
            )


def run_microbench(out: str, clips: int = 6, rows: int = 1_000_000, console=None) -> dict:
    from rich.console import Console
    from rich.table import Table

    from helix_core.data.media.synth import make_dataset
    from helix_core.data.profiles import ProfileTable

    console = console or Console()
    out = Path(out)
    results = {}
    table = Table(title="Helix media microbenchmark (one core, single-threaded decoder, medians)")
    for col in ("workload", "source", "sampled", "src frames/s", "sampled frames/s", "probe ms/file"):
        table.add_column(col, justify="right")
    for workload in _PROFILES:
        root = make_dataset(out / workload, workload, clips, seed=0, workers=2, progress=True)
        rec = json.loads((root / "manifest.jsonl").read_text().splitlines()[0])
        src_fps, out_fps = _decode_rates(root, rec["num_frames"], rec["size"])
        probe_ms = _probe_ms(sorted(root.glob("*.mp4")))
        spec = rec["spec"]
        results[workload] = {"src_frames_per_s": src_fps, "sampled_frames_per_s": out_fps, "probe_ms": probe_ms}
        table.add_row(
            workload,
            f"{spec['width']}x{spec['height']}",
            f"{rec['num_frames']}x{rec['size']}²",
            f"{src_fps:,.0f}",
            f"{out_fps:,.0f}",
            f"{probe_ms:.2f}",
        )
    console.print(table)
    big = out / f"profiles-{rows}.jsonl"
    if not big.exists():
        console.print(f"writing a {rows:,}-row profile table ...")
        _write_big_table(big, rows)
    loads = []
    for _ in range(3):
        t = time.perf_counter()
        ProfileTable.load(big)
        loads.append(time.perf_counter() - t)
    results["table_load_s"] = statistics.median(loads)
    console.print(
        f"load {rows:,}-row profile table ({big.stat().st_size / 1e6:.0f} MB): "
        f"median {results['table_load_s']:.2f} s over 3 loads"
    )
    return results
