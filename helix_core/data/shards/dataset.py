"""WebDataset tar shards as a map-style Helix dataset: ``WebDatasetClips`` and
``WebDatasetTextClips``, which are ``VideoClipDataset`` and ``VideoTextDataset`` whose samples are
tar members instead of files.

Building one reads the set's index (``index.py``: scanned once, kept beside the shards) and never
a clip: every sample's costs come from the index's columns, as from a profile table. A sample is
one read of its video member's bytes (``pread``, or one range read for a URL), decoded from memory.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from helix_core.data.costs import CostFit, profile_bucket
from helix_core.data.profiles import ProfileTable
from helix_core.data.shards.index import ShardIndex
from helix_core.data.shards.names import shard_urls
from helix_core.data.shards.reads import read_bytes
from helix_core.data.shards.scan import video_exts
from helix_core.data.storage.reader import StorageError
from helix_core.data.storage.urls import is_url, local_path
from helix_core.data.video import VideoClipDataset, VideoTextDataset
from helix_core.errors import SampleError

__all__ = ["VIDEO_KEY", "ShardSamples", "WebDatasetClips", "WebDatasetTextClips"]

#: The video member's extensions, first present wins (WebDataset's ``"a;b"`` alternatives).
VIDEO_KEY = "mp4;m4v;mov;mkv;webm;avi;ts;h264"


class ShardSamples:
    """A shard index's samples as a dataset's manifest: ``records[i]`` (the sample's ``.json``
    fields, with ``caption`` from the ``caption_key`` field or else the ``.txt`` member, ``label``
    from the ``label_key`` field or else the ``.cls`` member, ``path``, ``key`` and ``shard``),
    ``paths[i]`` (``<shard>#<key>.<ext>``), ``hint(key)``, ``keys``; ``errors``: samples whose
    caption or label is of the wrong type, and why."""

    def __init__(self, index: ShardIndex, caption_key: str = "caption", label_key: str = "label"):
        self.keys = {"path": "path", "caption": caption_key, "label": label_key}
        self.paths = [index.path(i) for i in range(len(index))]
        self.errors: dict[int, str] = {}
        self.records = [self._record(index, i) for i in range(len(index))]

    def _record(self, index: ShardIndex, i: int) -> dict:
        text = index.text[i]
        meta = next((v for k, v in text.items() if k.rsplit(".", 1)[-1] == "json"), None)
        rec = dict(meta) if isinstance(meta, dict) else {}
        for name, key in self.keys.items():
            if key != name and key in rec:
                rec[name] = rec.pop(key)
        if "caption" not in rec and "txt" in text:
            rec["caption"] = text["txt"]
        if "label" not in rec and "cls" in text:
            try:
                rec["label"] = int(text["cls"].strip())
            except ValueError:
                self.errors[i] = f"label {text['cls']!r} of {index.columns['key'][i]}.cls is not an integer"
        if "caption" in rec and not isinstance(rec["caption"], str):
            self.errors[i] = f"field {self.keys['caption']!r} must be a string"
        if "label" in rec and (not isinstance(rec["label"], int) or isinstance(rec["label"], bool)):
            self.errors[i] = f"field {self.keys['label']!r} must be an integer"
        rec.update(path=self.paths[i], key=str(index.columns["key"][i]), shard=index.shards[index.columns["shard"][i]])
        return rec

    def __len__(self) -> int:
        return len(self.records)

    def hint(self, key: str) -> np.ndarray:
        """Per-sample numeric field ``key`` of the ``.json`` members (NaN where absent)."""
        return np.array(
            [
                float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan
                for v in (r.get(key) for r in self.records)
            ],
            dtype=np.float64,
        )


class WebDatasetClips(VideoClipDataset):
    """The samples of WebDataset tar shards, decoded for one model family: the same sample dicts,
    ``fetch``, costs and spec as ``VideoClipDataset`` (see it for ``model``, ``num_frames``,
    ``size``, ``seed``, ``random_flip``, ``transform``, ``max_frame_pixels`` / ``max_frames``,
    ``storage_options`` and ``remote``).

    ``shards``: a pattern as WebDataset writes them (``"s3://bucket/train-{000000..000099}.tar"``,
    several joined by ``::``) or a list of local paths / URLs. A sample is the adjacent members
    sharing a key: a video (``video_key``: its extensions, first present wins) plus optional
    ``key.json`` (its fields are the sample's record: ``caption_key``, ``label_key`` and hints such as
    ``num_frames`` / ``size``), ``key.txt`` (caption) and ``key.cls`` (label). ``index``: where the
    set's index is read and written (default beside the first shard, else the local cache folder).

    The index is built on first use by scanning the shards (a progress bar on stderr) and read back
    afterwards; it holds every sample's container facts, so costs never open a clip. A bad sample (a
    video member that is not a video, no video member, a truncated shard, a shard gone since it was
    indexed) raises ``SampleError`` naming ``<shard>#<key>.<ext>`` when fetched or costed."""

    def __init__(
        self,
        shards: str | os.PathLike | list,
        model: str = "videomae",
        num_frames: int | None = None,
        size: int | tuple[int, int] | None = None,
        *,
        video_key: str = VIDEO_KEY,
        caption_key: str = "caption",
        label_key: str = "label",
        index: str | os.PathLike | None = None,
        **kwargs,
    ):
        for name in ("manifest", "profiles", "path_key"):
            if name in kwargs:
                raise TypeError(f"{type(self).__name__} takes no {name}= (the shards' index is its manifest and costs)")
        self.shards = _absolute(shards)
        self.shard_urls = shard_urls(self.shards)
        self.video_key = ";".join(video_exts(video_key))
        self._index_at = None if index is None else (str(index) if is_url(str(index)) else local_path(index))
        self._reads = threading.local()
        super().__init__(
            self.shard_urls[0], model, num_frames, size, caption_key=caption_key, label_key=label_key, **kwargs
        )
        self.manifest_path = self.index.location

    # ---- the hooks of VideoClipDataset ---------------------------------------------------------
    def _read_manifest(self, manifest, **keys) -> ShardSamples:
        self.index = ShardIndex.open(self.shard_urls, self.storage, self.video_key, location=self._index_at)
        if not len(self.index):
            raise ValueError(f"no samples in the {len(self.shard_urls)} shards of {self.shards!r}")
        return ShardSamples(self.index, caption_key=keys["caption_key"], label_key=keys["label_key"])

    def _load_table(self, profiles) -> ProfileTable:
        """The index as a profile table (uncalibrated fit: ``observe_cost`` corrects it online)."""
        ix, n = self.index, len(self.index)
        records = self.manifest.records
        errors = np.array(ix.error, dtype=object)
        for i, cause in self.manifest.errors.items():
            errors[i] = errors[i] or cause
        columns = {
            "index": np.arange(n, dtype=np.int64),
            "path": np.asarray(self.manifest.paths, dtype=object),
            "bytes": ix.bytes,
            "frames": ix.frames,
            "width": ix.width,
            "height": ix.height,
            "caption_len": np.array([len(r.get("caption", "") or "") for r in records], dtype=np.int64),
            "duration_s": ix.duration_s,
            "fps": ix.fps,
            "cost_scale": np.ones(n),
            "codec": ix.codec,
            "locality": np.array([str(r.get("locality", "local")) for r in records], dtype=object),
            "frames_source": ix.frames_source,
            "duration_source": ix.duration_source,
            "bucket": np.asarray(profile_bucket(ix.frames, ix.width, ix.height), dtype=object).reshape(n),
            "error": errors,
        }
        return ProfileTable(columns, CostFit())

    def _source(self, index: int) -> dict:
        """Sample ``index``'s video member, read in one go (``SampleError`` naming it otherwise)."""
        ix = self.index
        shard = ix.shards[ix.columns["shard"][index]]
        start = int(ix.columns["offset"][index])
        t0 = time.perf_counter()
        try:
            data = read_bytes(shard, start, start + int(ix.columns["bytes"][index]), self.storage)
        except StorageError as e:
            raise SampleError(index, self.manifest.paths[index], e.cause) from None
        if is_url(shard):
            self._reads.last = (len(data), time.perf_counter() - t0)
        return {"data": data}

    def fetch(self, index: int, out: np.ndarray | None = None):
        self._reads.last = (0, 0.0)
        sample, r = super().fetch(index, out)
        n, s = self._reads.last
        return sample, r._replace(read_bytes=r.read_bytes + n, read_s=r.read_s + s)

    def helix_spec(self) -> dict:
        spec = super().helix_spec()
        kwargs = spec["kwargs"]
        for name in ("manifest", "profiles"):
            kwargs.pop(name, None)
        kwargs["shards"] = self.shards
        if self.video_key != VIDEO_KEY:
            kwargs["video_key"] = self.video_key
        if self._index_at is not None:
            kwargs["index"] = self._index_at
        return spec


class WebDatasetTextClips(WebDatasetClips, VideoTextDataset):
    """``WebDatasetClips`` plus the caption, as ``VideoTextDataset``: ``"caption"`` and
    ``"input_ids"`` (``tokenizer``, ``max_text_len``; default model ``qwen2-vl``)."""

    def __init__(self, shards, model: str = "qwen2-vl", num_frames=None, size=None, **kwargs):
        super().__init__(shards, model, num_frames, size, **kwargs)

    def helix_spec(self) -> dict:
        return super().helix_spec()


def _absolute(shards):
    """``shards`` as a spec carries it: local parts made absolute (so another working directory
    names the same files), a pattern kept a pattern."""
    if isinstance(shards, (list, tuple)):
        return [str(u) if is_url(str(u)) else local_path(u) for u in shards]
    if not isinstance(shards, (str, os.PathLike)):
        raise TypeError(f"shards must be a pattern or a list of paths / URLs, got {type(shards).__name__}")
    parts = os.fspath(shards).split("::")
    return "::".join(p if is_url(p) else local_path(p) for p in parts)
