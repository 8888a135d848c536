"""Sampled decode with PyAV: N chosen frames of a clip, resized inside swscale, as uint8 [T, 3, H, W].

Two strategies, chosen by sampling density: ``sequential`` decodes from the start and keeps the
chosen frames (cheapest when they are dense); ``seek`` jumps to the keyframe before each chosen
frame (cheapest when they are far apart). The decoder and swscale run single-threaded: one
single-threaded decoder per core is the fastest layout (and ``to_ndarray``'s default of 0 threads
halves throughput on a 2-core machine).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from helix_core.data.media.probe import open_video
from helix_core.data.storage.config import Storage
from helix_core.data.storage.reader import StorageError
from helix_core.errors import SampleError

__all__ = ["Decoded", "SEEK_STRIDE", "choose_strategy", "decode_frames", "uniform_indices"]

#: Seek instead of decoding sequentially when chosen frames are on average more than this many
#: frames apart (about half of a 2-4 s GOP at 30 fps).
SEEK_STRIDE = 64
#: Frames a seek is expected to decode before reaching its target (cost model estimate).
SEEK_DECODE_FRAMES = 32


class Decoded(NamedTuple):
    """Result of ``decode_frames``: ``video`` uint8 [T, 3, H, W]; ``decode_s`` wall seconds and
    ``cpu_s`` CPU seconds of this thread; ``frames_decoded``: frames the codec produced;
    ``read_bytes`` / ``read_s``: bytes fetched from storage and seconds spent waiting for them
    (a clip read by URL; 0 for a local file, whose reads the page cache serves)."""

    video: np.ndarray
    decode_s: float
    cpu_s: float
    strategy: str
    frames_decoded: int
    read_bytes: int = 0
    read_s: float = 0.0


def uniform_indices(source_frames: int, num_frames: int) -> np.ndarray:
    """``num_frames`` indices spread evenly over ``[0, source_frames)``, ascending (repeats when
    the clip is shorter than the request), as ``linspace(0, T-1, n).round()``."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    last = max(int(source_frames) - 1, 0)
    return np.linspace(0, last, int(num_frames)).round().astype(np.int64)


def choose_strategy(indices: np.ndarray, seek_stride: int = SEEK_STRIDE) -> str:
    """``"seek"`` when chosen frames are on average more than ``seek_stride`` apart."""
    if len(indices) < 2:
        return "seek" if len(indices) and indices[0] > seek_stride else "sequential"
    stride = (int(indices[-1]) - int(indices[0])) / (len(indices) - 1)
    return "seek" if stride > seek_stride else "sequential"


def decode_frames(
    path: str,
    indices,
    resize_hw: tuple[int, int],
    crop_hw: tuple[int, int] | None = None,
    *,
    index: int = 0,
    exact_count: bool = True,
    strategy: str = "auto",
    out: np.ndarray | None = None,
    storage: Storage | None = None,
    data: bytes | None = None,
) -> Decoded:
    """Decode the frames at ``indices`` (ascending), resize each to ``resize_hw`` = (H, W) in
    swscale, centre-crop to ``crop_hw`` if given, and write uint8 [T, 3, h, w] into ``out``
    (allocated when None; a shared-memory slab can be passed).

    ``exact_count``: the header's frame count is exact, so asking past what the file holds means
    the file is truncated (``SampleError``); with an estimated count the missing tail repeats the
    last decoded frame. ``index`` names the sample in errors. ``storage``: how a ``path`` that is a
    URL is read; ``data``: the clip's bytes already in memory (``path`` then only names it).
    """
    import av

    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1 or len(idx) == 0 or (np.diff(idx) < 0).any() or idx[0] < 0:
        raise ValueError(f"indices must be a non-empty ascending list of frame numbers, got {idx!r}")
    rh, rw = (int(v) for v in resize_hw)
    ch, cw = (rh, rw) if crop_hw is None else (int(crop_hw[0]), int(crop_hw[1]))
    if not (0 < ch <= rh and 0 < cw <= rw):
        raise ValueError(f"crop {ch}x{cw} does not fit in resize {rh}x{rw}")
    top, left = (rh - ch) // 2, (rw - cw) // 2
    if out is None:
        out = np.empty((len(idx), 3, ch, cw), dtype=np.uint8)
    elif out.shape != (len(idx), 3, ch, cw) or out.dtype != np.uint8:
        raise ValueError(f"out has shape {out.shape} {out.dtype}, need {(len(idx), 3, ch, cw)} uint8")
    if strategy == "auto":
        strategy = choose_strategy(idx)
    if strategy not in ("sequential", "seek"):
        raise ValueError(f"strategy={strategy!r}; valid: auto, sequential, seek")

    t0, c0 = time.perf_counter(), time.thread_time()
    container, stream, _, reader = open_video(path, index, storage, data=data)
    stream.codec_context.thread_count = 1
    stream.thread_type = "SLICE"

    def put(slot: int, frame) -> None:
        rgb = frame.to_ndarray(format="rgb24", width=rw, height=rh, threads=1)
        out[slot] = rgb[top : top + ch, left : left + cw].transpose(2, 0, 1)

    try:
        if strategy == "sequential":
            filled, decoded = _sequential(container, stream, idx, put)
        else:
            filled, decoded = _seek(container, stream, idx, put)
    except av.error.FFmpegError as e:
        raise SampleError(index, path, f"decode failed: {e}") from None
    except StorageError as e:
        raise SampleError(index, path, e.cause) from None
    finally:
        container.close()
    if filled == 0:
        raise SampleError(index, path, "no decodable video frames (truncated or corrupt file)")
    if filled < len(idx):
        if exact_count:
            raise SampleError(
                index,
                path,
                f"truncated: frame {int(idx[filled])} requested but the stream ended after {decoded} decodable frames",
            )
        out[filled:] = out[filled - 1]
    fetched, waited = (reader.fetched_bytes, reader.wait_s) if reader is not None else (0, 0.0)
    return Decoded(out, time.perf_counter() - t0, time.thread_time() - c0, strategy, decoded, fetched, waited)


def _sequential(container, stream, idx: np.ndarray, put) -> tuple[int, int]:
    slot, n, last = 0, 0, int(idx[-1])
    for frame in container.decode(stream):
        while slot < len(idx) and idx[slot] == n:
            put(slot, frame)
            slot += 1
        n += 1
        if n > last:
            break
    return slot, n


class _Inexact(Exception):
    """A decoded frame's timestamp is not where the index-derived list put it."""


def _index_pts(container, stream) -> list[int] | None:
    """Every frame's presentation timestamp from the container's index, without reading a packet's
    payload (what lets a clip read by range reads seek without fetching all of it): when the index
    lists every frame (MP4 does) at an even step (constant frame rate), presentation timestamps
    are that step apart from the first GOP's earliest one. None when the index can't tell (no
    index, keyframes only, a variable rate): then the packets are demuxed (``_demuxed_pts``)."""
    entries = stream.index_entries
    n = len(entries)
    if n < 2 or n != (stream.frames or 0):
        return None
    dts = np.sort(np.fromiter((e.timestamp for e in entries), dtype=np.int64, count=n))
    step = np.diff(dts)
    if step[0] <= 0 or (step != step[0]).any():
        return None
    first = []
    for packet in container.demux(stream):  # the first GOP's head: its earliest pts is the first frame's
        if packet.pts is not None and packet.size:
            first.append(packet.pts)
        if len(first) >= 16:
            break
    if not first:
        container.seek(0, stream=stream, backward=True, any_frame=True)
        return None
    start = min(first)
    return [start + int(step[0]) * k for k in range(n)]


def _demuxed_pts(container, stream, rewind: bool) -> list[int]:
    """Every frame's timestamp in presentation order, from the packets alone (demuxing reads no
    pixels: a small fraction of decoding). Frame n of sequential decoding is the one at the n-th
    timestamp, on a constant frame rate or a variable one. ``rewind``: packets were read already."""
    if rewind:
        container.seek(0, stream=stream, backward=True, any_frame=True)
    pts = sorted(p.pts for p in container.demux(stream) if p.pts is not None and p.size)
    return pts


def _seek(container, stream, idx: np.ndarray, put) -> tuple[int, int]:
    """Seek to the keyframe before each chosen frame and decode up to it. Frames are found by
    timestamp, never by ``pts x average rate``, which lands on the wrong frames of a
    variable-frame-rate clip: from the index where it lists every frame at an even step (each
    decoded frame is checked against it; a mismatch starts over from the demuxed timestamps),
    else from the demuxed packets."""
    if stream.time_base is None:  # no timing to seek by: fall back
        return _sequential(container, stream, idx, put)
    pts = _index_pts(container, stream)
    if pts is not None:
        try:
            return _seek_with(container, stream, idx, put, pts, strict=True)
        except _Inexact:
            pass
    pts = _demuxed_pts(container, stream, rewind=pts is not None)
    if not pts:
        return _sequential(container, stream, idx, put)
    return _seek_with(container, stream, idx, put, pts, strict=False)


def _seek_with(container, stream, idx: np.ndarray, put, pts: list[int], strict: bool) -> tuple[int, int]:
    import bisect

    slot, decoded = 0, 0
    while slot < len(idx):
        target = int(idx[slot])
        if target >= len(pts):
            break  # past the stream's last frame
        container.seek(pts[target], stream=stream, backward=True)
        before = slot
        for frame in container.decode(stream):
            decoded += 1
            if frame.pts is None:
                if strict:
                    raise _Inexact
                continue
            n = bisect.bisect_left(pts, frame.pts)  # this frame's number in presentation order
            if strict and (n >= len(pts) or pts[n] != frame.pts):
                raise _Inexact
            while slot < len(idx) and idx[slot] <= n:
                put(slot, frame)
                slot += 1
            if slot >= len(idx) or (slot > before and idx[slot] - n > SEEK_STRIDE):
                break
        if slot == before:
            if strict:
                raise _Inexact  # the stream ended before a frame the index promised
            break  # the stream ended before the target
    return slot, decoded
