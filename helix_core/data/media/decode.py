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


def _presentation_pts(container, stream) -> list[int]:
    """Every frame's timestamp in presentation order, from the packets alone (demuxing reads no
    pixels: a small fraction of decoding, but every byte of the file). Frame n of sequential
    decoding is the one at the n-th timestamp, on a constant frame rate or a variable one."""
    pts = sorted(p.pts for p in container.demux(stream) if p.pts is not None and p.size)
    return pts


def _index_pts(stream) -> list[int] | None:
    """Every frame's timestamp from the container's index, which the header carries (an MP4's
    sample table): when it lists every frame one constant step apart, frame n is at
    ``start_time + n * step``. None otherwise. No packet is read, so a clip read by URL fetches
    only what the seeks decode; ``_seek`` checks every decoded frame against these timestamps."""
    entries, n = stream.index_entries, int(stream.frames or 0)
    if n < 2 or len(entries) != n or stream.start_time is None:
        return None
    dts = np.fromiter((e.timestamp for e in entries), np.int64, n)  # decode order
    step = np.diff(dts)
    if step[0] <= 0 or (step != step[0]).any():
        return None
    return (stream.start_time + step[0] * np.arange(n, dtype=np.int64)).tolist()


def _first_pts(container, stream, start: int) -> int | None:
    """The timestamp of the first frame decoded from ``start`` on."""
    container.seek(start, stream=stream, backward=True)
    return next((f.pts for f in container.decode(stream) if f.pts is not None), None)


class _NotOnIndex(Exception):
    """A decoded frame's timestamp is not one the index promised (a variable frame rate after
    all); ``args[0]``: frames decoded until then."""


def _seek(container, stream, idx: np.ndarray, put) -> tuple[int, int]:
    """Seek to the keyframe before each chosen frame and decode up to it. Frames are found by
    timestamp, never by ``pts x average rate``, which lands on the wrong frames of a
    variable-frame-rate clip: from the index when it shows a constant rate (``_index_pts``), else
    (or when a frame contradicts it) from every packet (``_presentation_pts``)."""
    if stream.time_base is None:  # no timing to seek by: fall back
        return _sequential(container, stream, idx, put)
    pts = _index_pts(stream)
    wasted = 0
    if pts is not None and (idx[0] == 0 or _first_pts(container, stream, pts[0]) == pts[0]):
        try:  # (frame 0, when it is sought, checks the first timestamp itself)
            return _seek_to(container, stream, idx, put, pts, exact=False)
        except _NotOnIndex as e:
            wasted = e.args[0]
    if pts is not None:  # the demux below must start at the first packet
        container.seek(stream.index_entries[0].timestamp, stream=stream, backward=True, any_frame=True)
    pts = _presentation_pts(container, stream)
    if not pts:
        filled, decoded = _sequential(container, stream, idx, put)
    else:
        filled, decoded = _seek_to(container, stream, idx, put, pts, exact=True)
    return filled, decoded + wasted


def _seek_to(container, stream, idx: np.ndarray, put, pts: list[int], exact: bool) -> tuple[int, int]:
    """``_seek`` with every frame's timestamp ``pts``; ``exact=False``: they come from the index,
    and a decoded frame that is not where they say (off them, or later than the frame sought)
    raises ``_NotOnIndex``."""
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
                continue
            n = bisect.bisect_left(pts, frame.pts)  # this frame's number in presentation order
            if not exact and (n == len(pts) or pts[n] != frame.pts or (slot == before and n > target)):
                raise _NotOnIndex(decoded)
            while slot < len(idx) and idx[slot] <= n:
                put(slot, frame)
                slot += 1
            if slot >= len(idx) or (slot > before and idx[slot] - n > SEEK_STRIDE):
                break
        if slot == before:
            break  # the stream ended before the target
    return slot, decoded
