"""Synthetic video workloads after the paper's Table 1: real H.264 (libx264, yuv420p) clips.

Every clip is deterministic per (seed, clip index): the frame content comes from a numpy generator
and libx264 runs single-threaded (its output depends on the thread count), so the same call makes
the same bytes on any machine with the same PyAV build. Content is a smooth random texture that
drifts, plus a bouncing block and light grain, so motion estimation and entropy coding do real work.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = ["ClipSpec", "MANIFEST_FORMATS", "WORKLOADS", "make_dataset", "plan_workload", "write_clip"]

#: Workload names accepted by ``make_dataset`` / ``helix synth``.
WORKLOADS = ("kinetics-small", "kinetics-mid", "kinetics-large", "kinetics-mixed", "openvid-mixed", "openvid-raw")
#: ``openvid-raw``: openvid-mixed's clips in containers with no frame count — Matroska (its count is
#: estimated as duration x fps) and raw Annex-B H.264 (no duration either: counted from packets).
_RAW_SUFFIXES = (".mkv", ".h264")
#: Manifest formats ``make_dataset`` writes (``manifest.<format>``). CSV and Parquet cannot nest: a
#: clip's ``spec`` is flattened into ``spec.<field>`` columns.
MANIFEST_FORMATS = ("jsonl", "csv", "parquet")

# Kinetics decode profiles (paper §5.1): sampled frames and source short side.
_KINETICS = {"S": (16, 224), "M": (32, 336), "L": (64, 448)}
_OPENVID_ASPECTS = ((16, 9), (9, 16), (4, 3), (1, 1))
_OPENVID_SHORT_SIDES = (240, 360, 480)
_OPENVID_FPS = (24.0, 25.0, 30.0)
_WORDS = (
    "a person slowly juggling three red balls in a sunny park while a dog watches from the grass "
    "two children ride bicycles down a narrow street lined with old stone houses at dusk "
    "the camera pans across a crowded market where vendors sell fruit and fresh bread "
    "close up of hands playing a wooden guitar near an open window on a rainy afternoon"
).split()


@dataclass(frozen=True)
class ClipSpec:
    """What one synthetic clip will be: geometry, length (frames at ``fps``) and its hints."""

    name: str
    width: int
    height: int
    frames: int
    fps: float
    seed: int
    profile: str
    num_frames: int  # frames a model samples from it (manifest hint)
    size: int  # model input size hint (short side / crop), pixels
    caption: str
    label: int


def _even(x: float, lo: int = 16) -> int:
    return max(lo, int(round(x / 2.0)) * 2)


def _caption(rng: np.random.Generator) -> str:
    n = int(rng.integers(5, 24))
    start = int(rng.integers(0, len(_WORDS) - n))
    return " ".join(_WORDS[start : start + n])


def plan_workload(workload: str, num_clips: int, seed: int = 0, scale: float = 1.0) -> list[ClipSpec]:
    """The clip specs of a workload (pure: no files). ``scale`` shrinks resolution and duration."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r}; valid: {', '.join(WORKLOADS)}")
    if num_clips < 1:
        raise ValueError(f"num_clips must be >= 1, got {num_clips}")
    if not 0.0 < scale <= 4.0:
        raise ValueError(f"scale must be in (0, 4], got {scale}")
    specs = []
    for i in range(num_clips):
        rng = np.random.default_rng([seed, i])
        if workload.startswith("kinetics"):
            key = {"small": "S", "mid": "M", "large": "L"}.get(workload.split("-")[1]) or "SML"[i % 3]
            num_frames, short = _KINETICS[key]
            fps, aspect = 30.0, (16, 9)
            duration = float(rng.uniform(3.0, 6.0))
            size = short
        else:
            aspect = _OPENVID_ASPECTS[int(rng.integers(len(_OPENVID_ASPECTS)))]
            short = _OPENVID_SHORT_SIDES[int(rng.integers(len(_OPENVID_SHORT_SIDES)))]
            fps = _OPENVID_FPS[int(rng.integers(len(_OPENVID_FPS)))]
            duration = float(rng.uniform(2.0, 16.0))
            num_frames, size = 33, short  # Wan-style 4k+1 frames
            key = f"{aspect[0]}:{aspect[1]}@{short}p"
        long = short * max(aspect) / min(aspect)
        w, h = (long, short) if aspect[0] >= aspect[1] else (short, long)
        frames = max(int(round(duration * scale * fps)), num_frames + 8)
        suffix = _RAW_SUFFIXES[i % 2] if workload == "openvid-raw" else ".mp4"
        specs.append(
            ClipSpec(
                name=f"clip_{i:06d}{suffix}",
                width=_even(w * scale),
                height=_even(h * scale),
                frames=frames,
                fps=fps,
                seed=int(rng.integers(2**31)),
                profile=key,
                num_frames=num_frames,
                size=max(16, int(round(size * scale))),
                caption=_caption(rng),
                label=int(rng.integers(400)),
            )
        )
    return specs


def _texture(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A smooth colour texture twice the frame size (so it can drift), uint8 [2h, 2w, 3]."""
    coarse = rng.integers(0, 256, size=(max(2, h // 16), max(2, w // 16), 3)).astype(np.float32)
    reps = (math.ceil(2 * h / coarse.shape[0]), math.ceil(2 * w / coarse.shape[1]))
    tex = np.repeat(np.repeat(coarse, reps[0], axis=0), reps[1], axis=1)[: 2 * h, : 2 * w]
    # cheap blur: average with shifted copies so edges are soft but detail remains
    tex = (tex + np.roll(tex, 3, 0) + np.roll(tex, 3, 1) + np.roll(tex, (5, 5), (0, 1))) / 4.0
    return tex.astype(np.uint8)


def _frames(spec: ClipSpec):
    rng = np.random.default_rng(spec.seed)
    h, w = spec.height, spec.width
    tex = _texture(rng, h, w)
    vy, vx = rng.uniform(-2.5, 2.5, size=2)
    by, bx = rng.uniform(0, h), rng.uniform(0, w)
    dy, dx = rng.uniform(-6, 6, size=2)
    bs = max(4, min(h, w) // 6)
    color = rng.integers(0, 256, size=3, dtype=np.uint8)
    grain = rng.integers(-6, 7, size=(h, w, 1), dtype=np.int16)
    for t in range(spec.frames):
        oy, ox = int(abs(vy * t)) % h, int(abs(vx * t)) % w
        frame = np.ascontiguousarray(tex[oy : oy + h, ox : ox + w])
        by, bx = by + dy, bx + dx
        if not 0 <= by <= h - bs:
            dy, by = -dy, min(max(by, 0), h - bs)
        if not 0 <= bx <= w - bs:
            dx, bx = -dx, min(max(bx, 0), w - bs)
        frame[int(by) : int(by) + bs, int(bx) : int(bx) + bs] = color
        g = np.roll(grain, t * 7, axis=1)
        yield np.clip(frame.astype(np.int16) + g, 0, 255).astype(np.uint8)


def write_clip(
    path: str | os.PathLike, spec: ClipSpec, container: str | None = None, options: dict[str, str] | None = None
) -> Path:
    """Encode ``spec`` as H.264 (libx264, yuv420p, one thread) into ``path``.

    ``container`` is a PyAV/FFmpeg format name ("mp4", "matroska", "h264" for a raw Annex-B
    stream, ...; by default it follows the file suffix; The file appears atomically (written to a
    temporary name, then renamed), so an interrupted run never leaves a half-written clip.
    """
    from fractions import Fraction

    import av

    path = Path(path)
    tmp = path.with_name(f".{path.name}.part")
    fmt = container or {".mkv": "matroska", ".h264": "h264", ".ts": "mpegts"}.get(path.suffix, "mp4")
    rate = Fraction(spec.fps).limit_denominator(1001)
    with av.open(str(tmp), mode="w", format=fmt, options=options or {}) as out:
        stream = out.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        stream.codec_context.thread_count = 1
        # mbtree off: its float propagation made the same spec give different bytes now and then (1 encode
        # in ~20 under CPU load, one thread, identical input frames; never in 100 without it)
        stream.options = {
            "preset": "veryfast",
            "crf": "26",
            "g": str(int(2 * spec.fps)),
            "threads": "1",
            "x264-params": "mbtree=0",
        }
        for rgb in _frames(spec):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    os.replace(tmp, path)
    return path


def _write_one(args):
    path, spec = args
    write_clip(path, spec)
    return path


def make_dataset(
    out: str | os.PathLike,
    workload: str = "kinetics-mixed",
    num_clips: int = 48,
    seed: int = 0,
    scale: float = 1.0,
    workers: int = 1,
    progress: bool = False,
    manifest_format: str = "jsonl",
    shards: int | None = None,
) -> Path:
    """Write ``num_clips`` clips of ``workload`` and ``OUT/manifest.<manifest_format>`` (``jsonl``,
    ``csv`` or ``parquet``); return the folder. ``shards``: also pack them as WebDataset shards of
    that many samples, ``OUT/shards/train-000000.tar``, ... (indexed: ``hx.WebDatasetClips``
    reads them as the same samples).

    Every row has ``path``, ``caption``, ``label``, the output hints ``num_frames`` / ``size``,
    ``profile``, ``workload`` and the clip's ``spec`` (nested in JSON lines; ``spec.<field>``
    columns in CSV and Parquet). Clips that already exist with the same spec in any manifest of the
    folder are kept, so a second call is cheap, in any format. ``workers`` > 1 encodes in that many
    spawned processes.
    """
    if manifest_format not in MANIFEST_FORMATS:
        raise ValueError(f"manifest_format={manifest_format!r}; valid: {', '.join(MANIFEST_FORMATS)}")
    out = Path(out)
    specs = plan_workload(workload, num_clips, seed, scale)
    out.mkdir(parents=True, exist_ok=True)
    old: dict[str, dict | None] = {}
    for fmt in MANIFEST_FORMATS:
        old.update(_old_specs(out / f"manifest.{fmt}"))
    todo = [(out / s.name, s) for s in specs if not ((out / s.name).exists() and old.get(s.name) == asdict(s))]
    _run(todo, workers, progress, f"synth {workload}")
    rows = [
        {
            "path": s.name,
            "caption": s.caption,
            "label": s.label,
            "num_frames": s.num_frames,
            "size": s.size,
            "profile": s.profile,
            "workload": workload,
            "spec": asdict(s),
        }
        for s in specs
    ]
    _write_manifest(out / f"manifest.{manifest_format}", rows)
    if shards is not None:
        from helix_core.data.shards.write import write_shards

        write_shards(out / f"manifest.{manifest_format}", out / "shards" / "train-%06d.tar", shards, progress=progress)
    return out


def _write_manifest(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines, CSV or Parquet by ``path``'s suffix, written atomically."""
    tmp = path.with_name(f".{path.name}.part")
    if path.suffix == ".jsonl":
        with open(tmp, "w") as f:
            for rec in rows:
                f.write(json.dumps(rec) + "\n")
    else:
        import pyarrow as pa

        flat = [
            {**{k: v for k, v in r.items() if k != "spec"}, **{f"spec.{k}": v for k, v in r["spec"].items()}}
            for r in rows
        ]
        table = pa.Table.from_pylist(flat)
        if path.suffix == ".csv":
            import pyarrow.csv as pacsv

            pacsv.write_csv(table, tmp)
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, tmp)
    os.replace(tmp, path)


def _old_specs(manifest: Path) -> dict[str, dict | None]:
    """Clip name -> the spec an earlier manifest of the folder recorded for it (none: {})."""
    if not manifest.exists():
        return {}
    if manifest.suffix == ".jsonl":
        recs = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
        return {r["path"]: r.get("spec") for r in recs}
    if manifest.suffix == ".csv":
        import pyarrow.csv as pacsv

        table = pacsv.read_csv(manifest)
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(manifest)
    fields = [c for c in table.column_names if c.startswith("spec.")]
    return {r["path"]: {c[len("spec.") :]: r[c] for c in fields} if fields else None for r in table.to_pylist()}


def _run(todo, workers: int, progress: bool, title: str) -> None:
    from rich.progress import Progress

    with Progress(disable=not progress, transient=False) as bar:
        task = bar.add_task(title, total=len(todo))
        if workers <= 1 or len(todo) <= 1:
            for item in todo:
                _write_one(item)
                bar.advance(task)
            return
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
            for _ in pool.map(_write_one, todo):
                bar.advance(task)
