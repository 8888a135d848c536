"""WebDataset tar shards as a map-style Helix dataset: ``WebDatasetClips`` and
``WebDatasetTextClips``, which are ``VideoClipDataset`` and ``VideoTextDataset`` whose samples are
tar members instead of files.

Building one reads the set's index (``index.py``: scanned once, kept beside the shards) and never
a clip: every sample's costs come from the index's columns, as from a profile table. A sample is
one read of its video member's bytes (``pread``, or one range read for a URL), decoded from memory.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from collections.abc import Sequence

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
    from the ``label_key`` field or else the ``.cls`` member, and ``path``, ``key``, ``shard``;
    built on access), ``paths[i]`` (``<shard>#<key>.<ext>``), ``hint(key)``, ``keys``;
    ``captions``: every sample's caption (None where it has none); ``errors``: samples whose caption
    or label is of the wrong type, and why.

    The text members of all samples are parsed at once by pyarrow (columnar, no Python loop per
    sample), or one by one when their fields' types differ between samples."""

    def __init__(self, index: ShardIndex, caption_key: str = "caption", label_key: str = "label"):
        self.index = index
        self.keys = {"path": "path", "caption": caption_key, "label": label_key}
        self.paths = [index.path(i) for i in range(len(index))]
        self.records = _Records(self)
        self._texts = _Texts(index)
        self.errors: dict[int, str] = {}
        caption = self.field(caption_key)
        txt = self._texts.field("txt")
        self.captions = [c if c is not None else t for c, t in zip(caption, txt)]
        for i, c in enumerate(self.captions):
            if c is not None and not isinstance(c, str):
                self.errors[i] = f"field {caption_key!r} must be a string"
        cls = self._texts.field("cls")
        for i, (v, c) in enumerate(zip(self.field(label_key), cls)):
            if v is not None and not _integral(v):
                self.errors[i] = f"field {label_key!r} must be an integer"
            elif v is None and c is not None and not c.strip().lstrip("-").isdigit():
                self.errors[i] = f"label {c!r} of {index.columns['key'][i]}.cls is not an integer"

    def record(self, i: int) -> dict:
        text = self.index.text_of(i)
        meta = text.get("json")
        rec = dict(meta) if isinstance(meta, dict) else {}
        for name, key in self.keys.items():
            if key != name and key in rec:
                rec[name] = rec.pop(key)
            if name != "path" and rec.get(name, 0) is None:  # a null caption or label: none
                del rec[name]
        if rec.get("caption") is None and "txt" in text:
            rec["caption"] = text["txt"]
        if rec.get("label") is None and "cls" in text and i not in self.errors:
            rec["label"] = int(text["cls"].strip())
        ix = self.index
        rec.update(path=self.paths[i], key=str(ix.columns["key"][i]), shard=ix.shards[ix.columns["shard"][i]])
        return rec

    def __len__(self) -> int:
        return len(self.paths)

    def field(self, name: str) -> list:
        """The ``.json`` members' field ``name``, per sample (None where absent)."""
        return self._texts.field("json", name)

    def hint(self, key: str) -> np.ndarray:
        """Per-sample numeric field ``key`` of the ``.json`` members (NaN where absent)."""
        values = self.field(key)
        return np.array(
            [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan for v in values],
            dtype=np.float64,
        )


class _Records(Sequence):
    """A shard set's records, one dict built per access (as a columnar manifest's)."""

    def __init__(self, samples: ShardSamples):
        self._s = samples

    def __len__(self) -> int:
        return len(self._s)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        return self._s.record(j)


class _Texts:
    """Every sample's text members, parsed: columnar by pyarrow when their types agree across
    samples, else one dict per sample."""

    def __init__(self, index: ShardIndex):
        import pyarrow as pa
        import pyarrow.json as pj

        self._n = len(index)
        self._table, self._dicts = None, None
        body = "\n".join(index.text.to_pylist()).encode()  # each a compact JSON object: one line
        try:
            if self._n:
                self._table = pj.read_json(pa.BufferReader(body), read_options=pj.ReadOptions(block_size=16 << 20))
        except pa.ArrowInvalid:  # a field that is a number in one sample and text in another
            self._dicts = [json.loads(line) for line in body.split(b"\n")]

    def field(self, ext: str, name: str | None = None) -> list:
        """Member ``ext``'s text (``name`` None) or its JSON field ``name``, per sample (None where
        absent)."""
        if self._dicts is not None:
            out = []
            for d in self._dicts:
                v = d.get(ext)
                out.append(v if name is None else v.get(name) if isinstance(v, dict) else None)
            return out
        if self._table is None or ext not in self._table.column_names:
            return [None] * self._n
        import pyarrow as pa

        col = self._table.column(ext).combine_chunks()
        if name is not None:
            if not pa.types.is_struct(col.type) or col.type.get_field_index(name) < 0:
                return [None] * self._n
            col = col.field(name)
        return col.to_pylist()


def _integral(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


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
        for shard, error in self.index.shard_errors.items():
            warnings.warn(f"shard {shard}: {error}", stacklevel=4)
        if not len(self.index):
            raise ValueError(f"no samples in the {len(self.shard_urls)} shards of {self.shards!r}")
        return ShardSamples(self.index, caption_key=keys["caption_key"], label_key=keys["label_key"])

    def _load_table(self, profiles) -> ProfileTable:
        """The index as a profile table (uncalibrated fit: ``observe_cost`` corrects it online)."""
        ix, n, samples = self.index, len(self.index), self.manifest
        errors = np.array(ix.error, dtype=object)
        for i, cause in samples.errors.items():
            errors[i] = errors[i] or cause
        columns = {
            "index": np.arange(n, dtype=np.int64),
            "path": np.asarray(samples.paths, dtype=object),
            "bytes": ix.bytes,
            "frames": ix.frames,
            "width": ix.width,
            "height": ix.height,
            "caption_len": np.array([len(c) if isinstance(c, str) else 0 for c in samples.captions], dtype=np.int64),
            "duration_s": ix.duration_s,
            "fps": ix.fps,
            "cost_scale": np.ones(n),
            "codec": ix.codec,
            "locality": np.array([str(v or "local") for v in samples.field("locality")], dtype=object),
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

    def __getstate__(self) -> dict:  # a thread-local cannot be pickled (torch's spawned workers, cloudpickle)
        return {k: v for k, v in self.__dict__.items() if k != "_reads"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _reads=threading.local())

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
