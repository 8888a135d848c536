"""``helix storagebench``: bytes a sampled decode fetches from an object store, against the
object's size and against what the decode needs.

For each Kinetics profile (short side 224 / 336 / 448, 16:9, 30 fps) a clip of ``seconds`` and a
long one of ``long_seconds`` (written once, cached in ``out``) are put on moto's S3 server on
loopback; each is decoded as a model samples it (``model``, e.g. VideoMAE's 16 frames) through
``VideoClipDataset`` by URL, with range reads of each ``blocks`` size. Per clip and block size:
the bytes fetched opening it (the header a probe reads) and decoding it, the range requests, the
strategy (sequential or seek), and ``needed``: the packet bytes the decode cannot avoid (from the
keyframe before each sampled frame up to it, by the container's index). Prints a table; writes
``results.json`` and ``fig_storage.png`` in ``out``."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["run_storage_bench"]

_PROFILES = {"S": 224, "M": 336, "L": 448}


def _clips(out: Path, seconds: float, long_seconds: float) -> list[tuple[str, Path]]:
    from helix_core.data.media.synth import ClipSpec, write_clip

    made = []
    for key, short in _PROFILES.items():
        for tag, secs in (("", seconds), ("long", long_seconds)):
            frames = int(round(secs * 30))
            name = f"kinetics-{key}{'-' + tag if tag else ''}-{secs:g}s.mp4"
            path = out / name
            if not path.exists():
                w = int(round(short * 16 / 9 / 2)) * 2
                write_clip(path, ClipSpec(name, w, short, frames, 30.0, 7, key, 16, short, "", 0))
            made.append((name, path))
    return made


def _needed(path: Path, indices) -> int:
    """Packet bytes from the keyframe before each sampled frame up to it (decode order), summed
    over distinct packets: what any decoder of these frames must read."""
    import av
    import numpy as np

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        e = s.index_entries
        ts = np.array([x.timestamp for x in e])
        size = np.array([x.size for x in e])
        key = np.array([x.is_keyframe for x in e])
    order = np.argsort(ts, kind="stable")
    ts, size, key = ts[order], size[order], key[order]
    need = np.zeros(len(ts), dtype=bool)
    for i in indices:  # frame i in presentation order ~ entry i in decode order (CFR): close enough
        i = min(int(i), len(ts) - 1)
        k = i
        while k > 0 and not key[k]:
            k -= 1
        need[k : i + 1] = True
    return int(size[need].sum())


def run_storage_bench(
    out,
    *,
    seconds: float = 10.0,
    long_seconds: float = 60.0,
    blocks_kib: tuple[int, ...] = (32, 64, 256),
    model: str = "videomae",
    console=None,
) -> dict:
    from rich.progress import Progress
    from rich.table import Table

    from helix_core.data.media.decode import uniform_indices
    from helix_core.data.media.probe import open_video
    from helix_core.data.storage.config import RemoteConfig, Storage
    from helix_core.data.video import VideoClipDataset
    from helix_core.testing.objectstore import S3_TEST_ENV, S3Server

    out = Path(out)
    (out / "clips").mkdir(parents=True, exist_ok=True)
    with Progress(disable=console is None, console=console, transient=True) as bar:
        bar.add_task("writing clips (once)", total=None)
        clips = _clips(out / "clips", seconds, long_seconds)
    os.environ.update({k: os.environ.get(k, v) for k, v in S3_TEST_ENV.items()})
    (out / "clips" / "manifest.jsonl").write_text("".join(json.dumps({"path": n}) + "\n" for n, _ in clips))
    rows = []
    with S3Server() as s3, Progress(disable=console is None, console=console, transient=True) as bar:
        base = s3.put_tree(out / "clips", "storagebench")
        task = bar.add_task("decoding by range reads", total=len(blocks_kib) * len(clips))
        for kib in blocks_kib:
            remote = RemoteConfig(block_bytes=kib << 10)
            ds = VideoClipDataset(
                f"{base}/manifest.jsonl", model=model, profiles=False, storage_options=s3.options, remote=remote
            )
            for i, (name, path) in enumerate(clips):
                opened = open_video(ds.sample_path(i), i, Storage.of(s3.options, remote))
                opened.container.close()
                d = ds.descriptor(i)
                _, r = ds.fetch(i)
                idx = uniform_indices(d.frames, ds.video_shape(i)[0])
                rows.append(
                    {
                        "clip": name,
                        "seconds": d.duration_s,
                        "block_kib": kib,
                        "object_bytes": d.bytes,
                        "open_bytes": opened.reader.fetched_bytes,
                        "decode_bytes": r.read_bytes,
                        "strategy": r.strategy,
                        "needed_bytes": _needed(path, idx),
                        "read_s": r.read_s,
                    }
                )
                rows[-1]["fetched_fraction"] = rows[-1]["decode_bytes"] / d.bytes
                bar.advance(task)
    result = {"model": model, "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    _figure(rows, out / "fig_storage.png")
    if console is not None:
        t = Table(title=f"bytes fetched per sampled decode from S3 ({model}: {ds.video_shape(0)[0]} frames)")
        for col in ("clip", "block", "object", "open", "decode", "fetched", "needed", "strategy"):
            t.add_column(col, justify="left" if col in ("clip", "strategy") else "right")
        for r in rows:
            t.add_row(
                r["clip"].removeprefix("kinetics-").removesuffix(".mp4").replace("-long", ""),
                f"{r['block_kib']} KiB",
                f"{r['object_bytes'] / 1e6:.2f} MB",
                f"{r['open_bytes'] / 1e3:.0f} kB",
                f"{r['decode_bytes'] / 1e6:.2f} MB",
                f"{r['fetched_fraction']:.0%}",
                f"{r['needed_bytes'] / r['object_bytes']:.0%}",
                r["strategy"],
            )
        console.print(t)
        console.print(
            "open: bytes fetched opening the clip (its header); decode: bytes the sampled decode fetched; fetched: "
            "decode / object; needed: the packets from the keyframe before each sampled frame up to it / object"
        )
        console.print(f"saved {out / 'results.json'} and {out / 'fig_storage.png'}")
    return result


def _figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    clips = list(dict.fromkeys(r["clip"] for r in rows))
    blocks = sorted({r["block_kib"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / (len(blocks) + 1)
    x = np.arange(len(clips))
    for k, b in enumerate(blocks):
        v = [next(r["fetched_fraction"] for r in rows if r["clip"] == c and r["block_kib"] == b) for c in clips]
        ax.bar(x + k * width, v, width, label=f"fetched, {b} KiB range reads")
    need = [next(r["needed_bytes"] / r["object_bytes"] for r in rows if r["clip"] == c) for c in clips]
    ax.bar(x + len(blocks) * width, need, width, color="grey", label="needed (keyframe to sampled frame)")
    ax.set_xticks(x + width * len(blocks) / 2, clips, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("bytes / object size")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8)
    ax.set_title("Bytes one sampled decode fetches from S3")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
