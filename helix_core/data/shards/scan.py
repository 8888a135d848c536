"""One shard scanned into its samples' index rows.

The tar is walked header by header (``tar.py``); members are grouped into samples by WebDataset's
key rule (adjacent members sharing the name up to the first dot, ``names.split_member``). For each
sample the scan keeps where every member's data lies, picks the video member (the first extension
of ``video_key`` present: ``"mp4;mkv"`` prefers ``.mp4``), probes its container from the bytes just
read (``probe(data=...)``: frames, picture size, rate, codec — no frame decoded) and keeps small
text members (``.json`` parsed, ``.txt`` / ``.cls`` as text, under ``TEXT_BYTES``) inline, so that
costing a sample and reading its caption or label need no further read.

One bad sample never stops a scan: it gets a row with its ``error`` (no video member, a member
that is not a video container, a duplicate member, invalid JSON, a member cut by the end of a
truncated shard). A shard that stops being a tar part-way (a corrupt header) keeps the samples
before it, and the shard's own ``error`` says where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from helix_core.data.media.probe import probe
from helix_core.data.shards.names import split_member
from helix_core.data.shards.reads import Chunked
from helix_core.data.shards.tar import TarFormatError, members
from helix_core.data.storage.config import Storage
from helix_core.errors import SampleError, text_of

__all__ = ["COLUMNS", "TEXT_BYTES", "TEXT_EXTS", "scan_shard", "video_exts"]

#: Text members at most this large (bytes) are kept in the index.
TEXT_BYTES = 64 << 10
#: Extensions (their last part) of the text members kept in the index.
TEXT_EXTS = ("json", "txt", "cls")
#: The fields of a sample's row in the index, with their values when unknown.
COLUMNS = {
    "key": "",
    "video": "",  # the video member's extension ("" when the sample has none)
    "offset": 0,  # where its data starts in the shard (bytes)
    "bytes": 0,
    "frames": 0,
    "width": 0,
    "height": 0,
    "fps": 0.0,
    "duration_s": 0.0,
    "codec": "",
    "frames_source": "header",
    "duration_source": "header",
    "error": None,
    "text": "{}",  # JSON text of {extension: parsed JSON or text} of the small text members
    "members": "{}",  # JSON text of {extension: [offset, size]} of every member
}
_PROBED = ("frames", "width", "height", "fps", "duration_s", "codec", "frames_source", "duration_source")


def video_exts(video_key: str) -> list[str]:
    """``"mp4;mkv"`` -> ``["mp4", "mkv"]`` (WebDataset's alternatives), lower-cased."""
    exts = [e.strip().lower().lstrip(".") for e in str(video_key).split(";") if e.strip()]
    if not exts:
        raise ValueError(f"video_key={video_key!r} names no extension (e.g. 'mp4' or 'mp4;webm')")
    return exts


class _Sample:
    """The members of one sample as the walk meets them."""

    def __init__(self, key: str):
        self.key = key
        self.members: dict[str, list[int]] = {}
        self.text: dict[str, object] = {}
        self.videos: dict[str, bytes] = {}
        self.error: str | None = None

    def fail(self, cause: str) -> None:
        self.error = self.error or cause


def scan_shard(
    shard: str,
    size: int,
    storage: Storage,
    video_key: str,
    *,
    on_fetch: Callable[[int], None] | None = None,
) -> tuple[list[dict], str | None]:
    """``(rows, error)``: one row per sample of ``shard`` (``size`` bytes), a dict of ``COLUMNS``,
    and why the walk stopped early (None when it read the whole tar). Storage failures (the shard
    cannot be read at all) raise ``StorageError``."""
    exts = video_exts(video_key)
    reader = Chunked(shard, size, storage, on_fetch=on_fetch)
    rows: list[dict] = []
    current: _Sample | None = None
    error = None
    try:
        for m in members(reader.read, size):
            split = split_member(m.name)
            if split is None:
                continue
            key, ext = (text_of(s) for s in split)  # a name that is not UTF-8 keeps its bytes as \\xNN
            if current is None or key != current.key:
                if current is not None:
                    _finish(current, shard, exts, rows)
                current = _Sample(key)
            _add(current, m, ext, exts, reader, size)
    except TarFormatError as e:
        error = f"not a readable tar from byte {e.offset} on ({e.cause}): samples after it are not indexed"
        if e.offset == 0 and reader.read(0, 2) == b"\x1f\x8b":
            error = "a compressed (gzip) tar: samples are read by range, which needs an uncompressed tar"
    if current is not None:
        _finish(current, shard, exts, rows)
    return rows, error


def _add(sample: _Sample, m, ext: str, exts: list[str], reader: Chunked, size: int) -> None:
    if ext in sample.members:
        sample.fail(f"duplicate member {m.name}")
        return
    sample.members[ext] = [m.offset, m.size]
    if m.offset + m.size > size:
        sample.fail(
            f"truncated shard: member {m.name} needs bytes {m.offset}-{m.offset + m.size} "
            f"but the shard ends at byte {size}"
        )
        return
    if ext in exts:
        sample.videos[ext] = reader.read(m.offset, m.size)
    elif ext.rsplit(".", 1)[-1] in TEXT_EXTS and m.size <= TEXT_BYTES:
        raw = reader.read(m.offset, m.size)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return  # not text: its place is kept in members
        if ext.rsplit(".", 1)[-1] == "json":
            try:
                sample.text[ext] = json.loads(text)
            except json.JSONDecodeError as e:
                sample.fail(f"{m.name} is not valid JSON ({e})")
        else:
            sample.text[ext] = text


def _finish(sample: _Sample, shard: str, exts: list[str], rows: list[dict]) -> None:
    row = dict(COLUMNS, key=sample.key, text=_compact(sample.text), members=_compact(sample.members))
    row["error"] = sample.error
    video = next((e for e in exts if e in sample.members), None)
    if video is None:
        row["error"] = row["error"] or (
            f"no video member (members: {', '.join(sorted(sample.members)) or 'none'}; video_key {';'.join(exts)})"
        )
    else:
        row["video"] = video
        row["offset"], row["bytes"] = sample.members[video]
        if row["error"] is None:
            try:
                d = probe(f"{shard}#{sample.key}.{video}", data=sample.videos[video])
                row.update({k: getattr(d, k) for k in _PROBED})
            except SampleError as e:
                row["error"] = f"{sample.key}.{video}: {e.cause}"
            except Exception as e:  # noqa: BLE001 - a probe's own failure is this sample's, not the scan's
                row["error"] = f"{sample.key}.{video}: {type(e).__name__}: {e}"
    rows.append(row)


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))
