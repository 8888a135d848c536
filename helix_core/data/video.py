"""Map-style video datasets whose every sample can be costed before it is decoded.

Building a dataset reads the manifest (and ``profiles.jsonl`` when present) and never opens a
clip, so one bad file in a million cannot stop it: a bad sample fails when it is fetched or costed,
as ``SampleError`` naming its index, path and cause.

A sample is costed, without decoding, from the first of: the profile table; the source geometry
its manifest row states (``height``, ``width``, ``num_frames`` or ``duration x fps``, ``fps``,
``bytes``: see ``helix_core.data.manifest``); a probe of its container's header. Decoding always
probes the clip itself: a manifest's geometry feeds costs and planning, never what is decoded.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from helix_core.data.costs import CostFit, CostModel, profile_bucket
from helix_core.data.descriptors import CostProfile, SampleDescriptor
from helix_core.data.families import VideoSpec
from helix_core.data.manifest import Manifest
from helix_core.data.media.decode import decode_frames, uniform_indices
from helix_core.data.media.probe import probe
from helix_core.data.profiles import ProfileTable
from helix_core.data.storage.config import RemoteConfig, Storage
from helix_core.data.storage.urls import is_url
from helix_core.data.text import load_tokenizer
from helix_core.errors import PICKLING, SampleError

__all__ = [
    "ESTIMATED_BITS_PER_PIXEL",
    "MAX_FRAMES",
    "MAX_FRAME_PIXELS",
    "VideoClipDataset",
    "VideoTextDataset",
    "sample_generator",
]

#: Caps checked from the container's header before a sample is decoded (a forged header must not
#: make a worker allocate gigabytes): far above any training clip — 8K UHD is 33 Mpx, a 2-hour
#: film at 30 fps 216,000 frames.
MAX_FRAME_PIXELS = 8192 * 8192
MAX_FRAMES = 500_000
_GEOMETRY_MEMO = 4096  # samples whose geometry a dataset keeps (those in flight, many times over)
#: Encoded bits per source pixel and frame that a clip's size in bytes is estimated at when its
#: manifest row states its geometry but not its ``bytes`` (H.264 web video: 0.05 to 0.2).
ESTIMATED_BITS_PER_PIXEL = 0.1
_CHUNK_ROWS = 1 << 14  # rows costed at a time: the geometry's temporaries stay a few MB


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The generator a sample's random transforms draw from: seeded by (seed, epoch, index), so
    the sample is identical whichever process decodes it, and after a resume."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(epoch), int(index)]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class VideoClipDataset(torch.utils.data.Dataset):
    """Clips of a manifest decoded for one model family.

    ``ds[i]`` is a dict: ``"video"`` uint8 [T, 3, H, W], ``"index"``, ``"tokens"`` (visual tokens),
    ``"label"`` (-1 when the manifest has none), and for Qwen-VL ``"video_grid_thw"`` — the same
    bytes whichever process decodes it. ``fetch(i)`` also returns the decode measurements. See ``helix_core.data.families`` for ``size`` per family.

    ``manifest``: a ``.jsonl``, ``.csv`` or ``.parquet`` file, a local path or a URL (``s3://``,
    ``gs://``, ``https://``; its clips may be URLs too, or paths relative to its folder);
    ``path_key`` / ``caption_key`` / ``label_key`` name its columns. ``storage_options``: fsspec's
    options for the URLs (an ``endpoint_url``, a region; never credentials, which come from the
    environment); ``remote``: a ``RemoteConfig`` (or its fields as a dict): per-sample timeout,
    retries, range-read size, local cache. ``profiles``: path of a profile table (default ``profiles.jsonl`` beside the manifest, used
    when it exists; ``False`` to ignore it). ``random_flip``: probability of a horizontal flip;
    ``transform(sample, generator)``: an extra user transform. Both draw from
    ``sample_generator(seed, epoch, index)``; ``set_epoch`` advances the epoch.

    Costs (``estimate_cost``, ``cost_arrays``) come from the profile table when there is one, else
    from the manifest's source geometry columns (Open-Sora's ``height``, ``width``,
    ``num_frames``, ``fps``, ``duration``, and ``bytes``), else from probing each clip's header
    when it is first costed. Per-sample ``num_frames`` / ``size`` columns fill in the dataset's
    ``num_frames`` / ``size`` where they are None, except that in a manifest with ``height`` and
    ``width`` columns ``num_frames`` is the clip's length (see ``helix_core.data.manifest``).
    """

    def __init__(
        self,
        manifest: str | os.PathLike,
        model: str = "videomae",
        num_frames: int | None = None,
        size: int | tuple[int, int] | None = None,
        *,
        profiles: str | os.PathLike | bool | None = None,
        seed: int = 0,
        random_flip: float = 0.0,
        transform=None,
        max_frame_pixels: int = MAX_FRAME_PIXELS,
        max_frames: int = MAX_FRAMES,
        path_key: str = "path",
        caption_key: str = "caption",
        label_key: str = "label",
        storage_options: dict | None = None,
        remote: RemoteConfig | dict | None = None,
    ):
        if not 0.0 <= random_flip <= 1.0:
            raise ValueError(f"random_flip must be a probability in [0, 1], got {random_flip}")
        for name, v in (("max_frame_pixels", max_frame_pixels), ("max_frames", max_frames)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.max_frame_pixels, self.max_frames = max_frame_pixels, max_frames
        self.storage = Storage.of(storage_options, remote)
        self.manifest_path: str | Path = str(manifest) if is_url(str(manifest)) else Path(manifest).absolute()
        self.spec = VideoSpec(model, num_frames, size)
        self.manifest = self._read_manifest(manifest, path_key=path_key, caption_key=caption_key, label_key=label_key)
        self.seed, self.epoch = int(seed), 0
        if isinstance(transform, str):  # an import path, as a JSON spec carries it
            from helix_core.data.specs import resolve_function

            transform = resolve_function(transform, "transform")
        self.random_flip, self.transform = float(random_flip), transform
        self._profiles = profiles if profiles in (None, True, False) else Path(profiles).absolute()
        self.table = self._load_table(profiles)
        self._hints = _output_hints(self.manifest)  # (num_frames, size): arrays, or None without the column
        self._probed: dict[int, SampleDescriptor] = {}
        self._geo: dict = {}  # index -> its geometry (fixed per sample): decoding and costing share it
        self.cost_model = CostModel(self.table.fit if self.table is not None else CostFit(), work_fn=self._work)
        self._costs = self._table_costs() if self.table is not None else self._stated_costs()

    # ---- construction helpers ----------------------------------------------------------------
    def _load_table(self, profiles) -> ProfileTable | None:
        if profiles is False or (profiles in (None, True) and isinstance(self.manifest_path, str)):
            return None  # beside a manifest at a URL: only a table named by ``profiles``
        path = Path(profiles) if profiles not in (None, True) else Path(self.manifest_path).parent / "profiles.jsonl"
        if not path.exists():
            if profiles not in (None, True):
                raise FileNotFoundError(f"profile table {path} does not exist (make it with `helix profile`)")
            return None
        table = ProfileTable.load(path)
        if len(table) != len(self.manifest) or not _same_paths(table.path, self.manifest.resolved_paths()):
            raise ValueError(
                f"profile table {path} does not match manifest {self.manifest_path} "
                f"({len(table)} rows for {len(self.manifest)} samples or other paths): "
                "re-run `helix profile`"
            )
        return table

    def _source_costs(self, frames, fps, height, width, io_bytes, scale, rows: slice) -> dict[str, np.ndarray]:
        """Vectorised cost arrays of rows ``rows`` from their source facts (arrays of those rows)."""
        out_frames, out_size = (None if h is None else h[rows] for h in self._hints)
        geo = self.spec.geometry(frames, fps, height, width, out_frames, out_size)
        decoded_px = geo.frames_decoded * width * height
        output_px = geo.t * geo.resize_h * geo.resize_w
        return {
            "cpu_s": self.cost_model.fit.predict(decoded_px, output_px) * scale,
            "out_bytes": geo.t * 3 * geo.out_h * geo.out_w,
            "tokens": geo.tokens,
            "t": geo.t,
            "h": geo.out_h,
            "w": geo.out_w,
            "io_bytes": io_bytes,
            "bucket": profile_bucket(frames, width, height),
        }

    def _table_costs(self) -> dict[str, np.ndarray]:
        """Vectorised cost arrays over every row of the profile table."""
        t = self.table
        costs = self._source_costs(t.frames, t.fps, t.height, t.width, t.columns["bytes"], t.cost_scale, slice(None))
        costs["ok"] = t.ok()
        return costs

    def _stated(self, start: int, stop: int) -> dict[str, np.ndarray] | None:
        """Cost arrays of rows ``start:stop`` from the geometry their manifest rows state, or None
        when one of them lacks what its cost needs (frames, height and width; fps where the
        family samples by rate). A row without ``bytes`` has its size estimated at
        ``ESTIMATED_BITS_PER_PIXEL``."""
        s = self.manifest.source_hints(start, stop)
        if s is None:
            return None
        needed = (s.frames, s.height, s.width, s.fps) if self.spec.uses_fps else (s.frames, s.height, s.width)
        if any(np.isnan(a).any() for a in needed):
            return None
        frames, height, width = (a.astype(np.int64) for a in (s.frames, s.height, s.width))
        estimate = frames * height * width * (ESTIMATED_BITS_PER_PIXEL / 8)
        io_bytes = np.where(np.isnan(s.bytes), np.round(estimate), s.bytes).astype(np.int64)
        fps = np.nan_to_num(s.fps)  # where unknown, the geometry does not use it
        costs = self._source_costs(frames, fps, height, width, io_bytes, 1.0, slice(start, stop))
        costs["ok"] = np.ones(len(frames), dtype=bool)
        return costs

    def _stated_costs(self) -> dict[str, np.ndarray] | None:
        """Cost arrays over every row from the manifest's source geometry (by chunks of rows, into
        arrays allocated once), or None unless every row states what its cost needs."""
        n = len(self.manifest)
        if not _describes_sources(self.manifest):
            return None
        out: dict[str, np.ndarray] = {}
        for start in range(0, n, _CHUNK_ROWS):
            part = self._stated(start, min(start + _CHUNK_ROWS, n))
            if part is None:
                return None
            for k, v in part.items():
                if k not in out:
                    out[k] = np.empty(n, dtype=v.dtype)
                out[k][start : start + len(v)] = v
        return out

    def _read_manifest(self, manifest, **keys) -> Manifest:
        """The samples' records (``records``, ``paths``, ``hint``, ``keys``, ``len``): here a
        manifest file (a subclass whose samples live elsewhere, such as tar shards, reads its own)."""
        return Manifest(manifest, **keys, storage=self.storage)

    # ---- descriptors and costs (never decode) --------------------------------------------------
    def __len__(self) -> int:
        return len(self.manifest)

    def descriptor(self, index: int) -> SampleDescriptor:
        """Container facts of sample ``index`` (from the profile table, else a metadata probe)."""
        index = self._check(index)
        if self.table is not None:
            return self.table.descriptor(index)
        if index not in self._probed:
            rec = self.manifest.records[index]
            self._probed[index] = probe(
                self.manifest.paths[index],
                index=index,
                caption_len=len(rec.get("caption", "") or ""),
                locality=str(rec.get("locality", "local")),
                **self._source(index),
            )
        return self._probed[index]

    def _geometry(self, d: SampleDescriptor):
        i = d.index
        g = self._geo.get(i)
        if g is None:  # a sample's geometry is asked for several times on its way (decode, cost)
            if len(self._geo) >= _GEOMETRY_MEMO:
                self._geo.clear()
            hints = (None if h is None else h[i : i + 1] for h in self._hints)
            g = self._geo[i] = self.spec.geometry(d.frames, d.fps, d.height, d.width, *hints)
        return g

    def _work(self, d: SampleDescriptor) -> tuple[float, float]:
        g = self._geometry(d)
        return float(g.frames_decoded[0] * d.width * d.height), float(g.t[0] * g.resize_h[0] * g.resize_w[0])

    def estimate_cost(self, index: int) -> CostProfile:
        """Predicted cost of sample ``index`` without decoding (``SampleError`` if it can't be probed)."""
        index = self._check(index)
        if self.table is not None:
            self.table.descriptor(index)  # raises SampleError for a row that failed to probe
        stated = self._costs_of(index)
        if stated is not None:
            c, j = stated
            cpu_s = float(c["cpu_s"][j]) * self.cost_model.correction(str(c["bucket"][j]))
            return CostProfile(
                cpu_s=cpu_s,
                io_bytes=int(c["io_bytes"][j]),
                out_bytes=int(c["out_bytes"][j]),
                tokens=int(c["tokens"][j]),
                profile=f"{c['t'][j]}x{c['h'][j]}x{c['w'][j]}",
            )
        d = self.descriptor(index)
        g = self._geometry(d)
        t, h, w = int(g.t[0]), int(g.out_h[0]), int(g.out_w[0])
        return CostProfile(
            cpu_s=self.cost_model.predict(d),
            io_bytes=d.bytes,
            out_bytes=t * 3 * h * w,
            tokens=int(g.tokens[0]),
            profile=f"{t}x{h}x{w}",
        )

    def _costs_of(self, index: int) -> tuple[dict[str, np.ndarray], int] | None:
        """Cost arrays holding sample ``index`` and its row in them: every row's (a profile table, or
        a manifest whose every row states its geometry), or this row's alone where the manifest
        states its geometry; None where the sample must be probed to be costed."""
        if self._costs is not None:
            return self._costs, index
        if _describes_sources(self.manifest):
            row = self._stated(index, index + 1)
            if row is not None:
                return row, 0
        return None

    def cost_arrays(self) -> dict[str, np.ndarray] | None:
        """Every row's ``cpu_s`` (offline, without online corrections), ``io_bytes``,
        ``out_bytes``, ``tokens``, profile ``t/h/w``, source ``bucket`` and ``ok`` (False where
        the clip failed to probe) as arrays: from the profile table, else from the manifest's
        source geometry when every row states it (``io_bytes`` from its ``bytes`` column, else
        estimated at ``ESTIMATED_BITS_PER_PIXEL``); ``None`` otherwise."""
        return self._costs

    def observe_cost(self, index: int, cpu_s: float) -> None:
        """Fold one measured decode (CPU seconds of ``ds[index]``) into the online cost model: its
        profile bucket's correction, which ``estimate_cost`` applies from then on."""
        stated = self._costs_of(int(index)) if self.table is None else None
        if stated is not None:  # its bucket and prediction as costed: no probe in the training process
            c, j = stated
            self.cost_model.update_bucket(str(c["bucket"][j]), float(c["cpu_s"][j]), cpu_s)
            return
        try:
            d = self.descriptor(index)
        except Exception:  # a sample that cannot be described has no bucket to refine
            return
        scale = float(self.table.cost_scale[int(index)]) if self.table is not None else 1.0
        self.cost_model.update(d, cpu_s, scale=scale)

    # ---- fetching ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __getitem__(self, index: int) -> dict:
        return self.fetch(index)[0]

    def video_shape(self, index: int) -> tuple[int, int, int, int]:
        """The shape [T, 3, H, W] of sample ``index``'s ``"video"``, without decoding (so a
        DataServer worker can decode it straight into its place in a shared-memory batch)."""
        g = self._geometry(self.descriptor(self._check(index)))
        return int(g.t[0]), 3, int(g.out_h[0]), int(g.out_w[0])

    def fetch(self, index: int, out: np.ndarray | None = None):
        """``(sample, Decoded)``: the sample and its decode measurements (``decode_s`` wall
        seconds, ``cpu_s`` CPU seconds, ``strategy``, ``frames_decoded``) for the cost model.
        ``out``: a uint8 array of ``video_shape(index)`` (a view is fine) to decode into; the
        sample's ``"video"`` is then that memory, unless a transform made a new tensor."""
        index = self._check(index)
        d = self.descriptor(index)
        if d.width * d.height > self.max_frame_pixels:
            raise SampleError(
                index,
                d.path,
                f"frames of {d.width}x{d.height} ({d.width * d.height:,} pixels) exceed "
                f"max_frame_pixels={self.max_frame_pixels:,}: not decoded",
            )
        if d.frames > self.max_frames:
            raise SampleError(index, d.path, f"{d.frames:,} frames exceed max_frames={self.max_frames:,}: not decoded")
        g = self._geometry(d)
        idx = uniform_indices(d.frames, int(g.t[0]))
        crop = (int(g.out_h[0]), int(g.out_w[0]))
        r = decode_frames(
            d.path,
            idx,
            (int(g.resize_h[0]), int(g.resize_w[0])),
            crop,
            index=index,
            exact_count=d.frames_source == "header",
            out=out,
            **self._source(index),
        )
        video = torch.from_numpy(r.video)
        rec = self.manifest.records[index]
        sample = {"video": video, "index": index, "tokens": int(g.tokens[0]), "label": int(rec.get("label", -1))}
        if self.spec.is_qwen:
            sample["video_grid_thw"] = torch.tensor([(int(g.t[0]) + 1) // 2, crop[0] // 14, crop[1] // 14])
        if self.random_flip > 0 or self.transform is not None:
            gen = sample_generator(self.seed, self.epoch, index)
            if self.random_flip > 0 and torch.rand((), generator=gen).item() < self.random_flip:
                sample["video"] = video.flip(-1)
            if self.transform is not None:
                sample = self.transform(sample, gen)
        return sample, r

    def _source(self, index: int) -> dict:
        """How sample ``index``'s bytes are read, as keyword arguments of ``probe`` /
        ``decode_frames``: here through ``storage`` (a subclass whose samples are not files can
        hand over ``data=`` bytes instead)."""
        return {"storage": self.storage}

    def sample_path(self, index: int) -> str:
        """The file of sample ``index`` (for error messages)."""
        return self.manifest.paths[self._check(index)]

    def _check(self, index) -> int:
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        return i

    def helix_spec(self) -> dict:
        """Import path plus JSON arguments that rebuild this very dataset in another process (paths
        absolute); ``SpecError`` naming the argument when one cannot travel as JSON (a ``transform``
        that is not a module-level function; a subclass that does not define its own
        ``helix_spec``, whose fields would be lost) — it then needs cloudpickle, which a cluster reached
        over loopback or TLS accepts."""
        from helix_core.data.specs import function_path
        from helix_core.errors import SpecError

        name = type(self).__name__
        if "helix_spec" not in type(self).__dict__:
            raise SpecError(
                name,
                f"the fields of subclass {name}",
                f"define {name}.helix_spec() (extend super().helix_spec()), or use " + PICKLING,
            )
        kwargs = {
            "manifest": str(self.manifest_path),
            **{f"{k}_key": v for k, v in self.manifest.keys.items() if k != v},
            "model": self.spec.model,
            "num_frames": self.spec.num_frames,
            "size": list(self.spec.size) if isinstance(self.spec.size, tuple) else self.spec.size,
            "seed": self.seed,
            "random_flip": self.random_flip,
            "max_frame_pixels": self.max_frame_pixels,
            "max_frames": self.max_frames,
            "profiles": str(self._profiles) if isinstance(self._profiles, Path) else self._profiles,
        }
        if self.storage.options:
            kwargs["storage_options"] = self.storage.options
        if self.storage.remote != RemoteConfig():
            kwargs["remote"] = self.storage.remote.to_dict()
        if self.transform is not None:
            kwargs["transform"] = function_path(self.transform)
            if kwargs["transform"] is None:
                from helix_core.data.specs import why_not_json

                raise SpecError(name, f"transform={self.transform!r}", why_not_json(self.transform))
        return {"target": f"{type(self).__module__}.{type(self).__qualname__}", "kwargs": kwargs}


def _output_hints(manifest) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A manifest's per-sample ``(num_frames, size)`` (see ``Manifest.output_hints``); from the
    ``hint`` of a subclass's own records (``_read_manifest``), which state no source geometry."""
    if isinstance(manifest, Manifest):
        return manifest.output_hints()
    return np.asarray(manifest.hint("num_frames")), np.asarray(manifest.hint("size"))


def _describes_sources(manifest) -> bool:
    return isinstance(manifest, Manifest) and manifest.describes_sources


def _same_paths(table_paths, manifest_paths) -> bool:
    """Whether a profile table's paths are the manifest's resolved paths, row by row (vectorised)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table_paths = getattr(table_paths, "arrow", table_paths)  # a loaded table keeps its paths as arrow
    if not isinstance(table_paths, (pa.Array, pa.ChunkedArray)):
        table_paths = pa.array(list(table_paths), type=pa.string())
    same = pc.equal(manifest_paths, table_paths)
    return same.null_count == 0 and bool(pc.all(same).as_py())


class VideoTextDataset(VideoClipDataset):
    """Video plus caption: adds ``"caption"`` (str) and ``"input_ids"`` (int64, at most
    ``max_text_len``) from ``tokenizer`` — a Hugging Face tokenizer object, a local tokenizer
    folder, or ``None`` for the built-in byte tokenizer (nothing is downloaded)."""

    def __init__(
        self,
        manifest,
        model: str = "qwen2-vl",
        num_frames=None,
        size=None,
        *,
        tokenizer=None,
        max_text_len: int = 128,
        **kwargs,
    ):
        super().__init__(manifest, model, num_frames, size, **kwargs)
        if max_text_len < 2:
            raise ValueError(f"max_text_len must be >= 2, got {max_text_len}")
        self.tokenizer = load_tokenizer(tokenizer)
        self.max_text_len = int(max_text_len)

    def fetch(self, index: int, out: np.ndarray | None = None):
        sample, r = super().fetch(index, out)
        caption = self.manifest.records[sample["index"]].get("caption", "") or ""
        sample["caption"] = caption
        sample["input_ids"] = torch.as_tensor(self.tokenizer.encode(caption, self.max_text_len), dtype=torch.int64)
        return sample, r

    def helix_spec(self) -> dict:
        from helix_core.errors import SpecError

        spec = super().helix_spec()
        source = self.tokenizer.source
        if not isinstance(source, (str, os.PathLike, type(None))):
            raise SpecError(
                type(self).__name__, "tokenizer (an object)", "pass its local folder path instead, or use " + PICKLING
            )
        if source is not None and Path(source).exists():
            source = str(Path(source).absolute())
        spec["kwargs"].update(tokenizer=None if source is None else str(source), max_text_len=self.max_text_len)
        return spec
