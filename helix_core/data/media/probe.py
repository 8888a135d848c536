"""Container metadata probe: a ``SampleDescriptor`` without a full decode.

Frame count and duration come from the header when it has them (MP4 does); otherwise the count is
estimated as duration x fps (Matroska, MPEG-TS) or counted from demuxed packets (a raw Annex-B
stream has neither), and the descriptor says which was used. A raw stream's rate is the codec's
(the SPS's timing), not the 25 fps its demuxer assumes.
"""

from __future__ import annotations

import io
import os
from typing import Any, NamedTuple

from helix_core.data.descriptors import SampleDescriptor
from helix_core.data.storage.config import Storage
from helix_core.data.storage.reader import RangeFile, StorageError
from helix_core.data.storage.urls import is_url, local_path
from helix_core.errors import SampleError

__all__ = ["Opened", "open_video", "probe"]


class Opened(NamedTuple):
    """An open clip: the PyAV ``container`` and its first ``stream`` of video; ``size`` in bytes;
    ``reader``: the ``RangeFile`` it is read through when it lives at a URL (what it fetched)."""

    container: Any
    stream: Any
    size: int
    reader: RangeFile | None


def open_video(path: str, index: int, storage: Storage | None = None, *, data: bytes | None = None) -> Opened:
    """Open the clip at ``path`` (a local path or a URL read by range reads through ``storage``;
    ``data``: the clip's bytes already in memory, ``path`` then only names it) with PyAV, or raise
    ``SampleError`` naming ``index`` and ``path``.

    Checks existence and size first so the common bad inputs get a plain cause.
    """
    import av

    reader = None
    if data is not None:
        source: Any = io.BytesIO(data)
        size = len(data)
    elif is_url(path):
        storage = storage or Storage.of()
        try:
            reader = RangeFile(path, storage.options, storage.remote)
        except StorageError as e:
            raise SampleError(index, path, e.cause) from None
        source, size = reader, reader.size
    else:
        source = path = local_path(path) if path.startswith("file://") else path
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise SampleError(index, path, "file not found") from None
        except OSError as e:
            raise SampleError(index, path, f"cannot stat file: {e.strerror or e}") from None
        if not os.path.isfile(path):
            raise SampleError(index, path, "not a regular file")
    if size == 0:
        raise SampleError(index, path, "empty file (0 bytes)")
    try:
        container = av.open(source, mode="r", timeout=10.0)
    except av.error.FFmpegError as e:  # (its text names the file as '<none>' for a URL or bytes: drop it)
        raise SampleError(
            index, path, f"not a readable video container: {e.strerror or e} (not a video, or cut short)"
        ) from None
    except StorageError as e:
        raise SampleError(index, path, e.cause) from None
    except OSError as e:
        raise SampleError(index, path, f"cannot open: {e}") from None
    if not container.streams.video:
        container.close()
        raise SampleError(index, path, "no video stream in container")
    return Opened(container, container.streams.video[0], size, reader)


def probe(
    path: str | os.PathLike,
    index: int = 0,
    caption_len: int = 0,
    locality: str = "local",
    count_packets: bool = True,
    *,
    storage: Storage | None = None,
    data: bytes | None = None,
) -> SampleDescriptor:
    """Read ``path``'s container metadata into a ``SampleDescriptor`` (no frame is decoded).

    ``count_packets`` allows demuxing (not decoding) the stream when the header has neither a frame
    count nor a duration. Raises ``SampleError`` naming ``index`` and ``path`` on bad input.
    """
    path = os.fspath(path)
    container, stream, size, _ = open_video(path, index, storage, data=data)
    try:
        ctx = stream.codec_context
        width, height = int(ctx.width or 0), int(ctx.height or 0)
        if width <= 0 or height <= 0:
            raise SampleError(index, path, "video stream has no picture size (corrupt header?)")
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else 0.0
        duration_s, duration_source = 0.0, "header"
        if stream.duration is not None and stream.time_base is not None:
            duration_s = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            duration_s = container.duration / 1_000_000.0  # AV_TIME_BASE units
        if duration_s <= 0 and ctx.framerate:  # a raw stream: its demuxer assumes 25 fps; the codec's
            fps = float(ctx.framerate)  # rate (an H.264 SPS's timing) is the clip's own
        frames, frames_source = int(stream.frames or 0), "header"
        if frames <= 0 and duration_s > 0 and fps > 0:
            frames, frames_source = int(round(duration_s * fps)), "duration_x_fps"
        if frames <= 0 and count_packets:
            frames, frames_source = _count_packets(container, stream, index, path), "packet_count"
        if frames <= 0:
            raise SampleError(index, path, "cannot determine frame count (no header count, duration or packets)")
        if fps <= 0:
            fps = frames / duration_s if duration_s > 0 else 25.0
        if duration_s <= 0:
            duration_s, duration_source = frames / fps, "frames_div_fps"
        return SampleDescriptor(
            index=int(index),
            path=path,
            bytes=size,
            duration_s=duration_s,
            fps=fps,
            frames=frames,
            width=width,
            height=height,
            codec=str(ctx.name),
            caption_len=int(caption_len),
            locality=locality,
            frames_source=frames_source,
            duration_source=duration_source,
        )
    except StorageError as e:
        raise SampleError(index, path, e.cause) from None
    finally:
        container.close()


def _count_packets(container, stream, index: int, path: str) -> int:
    import av

    try:
        return sum(1 for p in container.demux(stream) if p.size > 0)
    except av.error.FFmpegError as e:
        raise SampleError(index, path, f"demux failed while counting packets: {e}") from None
