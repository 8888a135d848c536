"""What the Lightning data module and the Accelerate plugin share: datasets named in a config,
loader options checked by name, and the loaders themselves (Helix, or a plain torch DataLoader
with ``DistributedSampler`` for comparison).

Everything here is checked before any process starts or any clip is decoded: an unknown key
names itself and the valid values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

import helix_core as hx

__all__ = ["LOADERS", "LOADER_OPTIONS", "DatasetConfig", "build_loader", "check_loader_options", "dataset_length_error"]

LOADERS = ("helix", "torch")
_NOT_OPTIONS = {"self", "dataset", "batch_size", "rank", "world_size", "coordinator", "token"}
#: ``DistributedDataLoader`` keyword arguments a config may set (``loader_options``).
LOADER_OPTIONS = tuple(
    p for p in inspect.signature(hx.DistributedDataLoader.__init__).parameters if p not in _NOT_OPTIONS
) + ("worker_nice",)
#: The options a plain torch DataLoader understands too; the others are Helix's own.
_TORCH_OPTIONS = ("shuffle", "seed", "drop_last", "collate_fn", "pin_memory", "num_workers", "worker_nice")

_DATASET_KEYS = {
    "manifest",
    "shards",
    "workload",
    "clips",
    "scale",
    "model",
    "num_frames",
    "size",
    "kind",
    "profiles",
    "seed",
    "random_flip",
    "tokenizer",
    "max_text_len",
    "path_key",
    "caption_key",
    "label_key",
    "storage_options",
    "remote",
}
_KINDS = ("video", "video-text")
_TEXT_MODELS = tuple(name for name, family in hx.FAMILIES.items() if family.captions)  # trained on captions


def check_loader_options(options: Mapping, where: str = "loader_options") -> dict:
    """``options`` as a dict, or a ``ValueError`` naming the first unknown key."""
    for key in options:
        if key not in LOADER_OPTIONS:
            raise ValueError(f"{where}: unknown loader option {key!r}; valid: {', '.join(LOADER_OPTIONS)}")
    return dict(options)


class DatasetConfig:
    """A dataset named by a mapping, checked at once (no file is written or opened but the
    manifest's existence):

    - ``{"manifest": PATH, "model": "videomae", "num_frames": 16, "size": 224, ...}``
    - ``{"workload": "kinetics-mixed", "clips": 48, "seed": 0, "scale": 1.0, "model": ...}``:
      synthesized (and profiled) into ``hx.cache_dir()/data/<workload>-<clips>-s<scale>-seed<seed>``
      by ``prepare()``, once; later runs reuse it.
    - ``{"manifest": "s3://bucket/train.parquet", "storage_options": {"endpoint_url": ...},
      "remote": {"timeout_s": 30, ...}, ...}``: a manifest at a URL (its clips relative to its
      folder), read through fsspec with ``storage_options`` (never credentials: they come from the
      environment) and ``hx.RemoteConfig``'s fields as ``remote``; both are checked here, the
      manifest is read when the dataset is built.
    - ``{"shards": "s3://bucket/train-{000000..000009}.tar", "storage_options": ..., ...}``:
      WebDataset tar shards (local paths or URLs, a brace pattern), as ``hx.WebDatasetClips``
      (``WebDatasetTextClips`` for video-text); their index is built or read when the dataset is built.

    ``kind``: ``"video"`` (``VideoClipDataset``) or ``"video-text"`` (``VideoTextDataset``: captions
    as ``input_ids``); by default video-text for the families trained on captions (Qwen-VL, Wan).
    The other keys are the dataset's arguments (``profiles``, ``random_flip``, ``tokenizer``, ...).
    """

    def __init__(self, spec: Mapping, key: str = "dataset"):
        spec = dict(spec)
        for k in spec:
            if k not in _DATASET_KEYS:
                raise ValueError(f"{key}: unknown key {k!r}; valid: {', '.join(sorted(_DATASET_KEYS))}")
        if sum(k in spec for k in ("manifest", "workload", "shards")) != 1:
            raise ValueError(
                f"{key}: give exactly one of 'manifest' (a .jsonl / .csv / .parquet file or URL), 'shards' "
                f"(WebDataset tar shards: a brace pattern) or 'workload' (one of {', '.join(hx.synth.WORKLOADS)}, "
                f"synthesized into {hx.cache_dir()})"
            )
        model = spec.setdefault("model", "videomae")
        if model not in hx.MODELS:
            raise ValueError(f"{key}.model: unknown model family {model!r}; valid: {', '.join(hx.MODELS)}")
        kind = spec.pop("kind", "video-text" if model in _TEXT_MODELS else "video")
        if kind not in _KINDS:
            raise ValueError(f"{key}.kind: {kind!r}; valid: {', '.join(_KINDS)}")
        self.key, self.kind = key, kind
        self.synth = {k: spec.pop(k) for k in ("workload", "clips", "scale") if k in spec}
        if self.synth:
            workload = self.synth["workload"]
            if workload not in hx.synth.WORKLOADS:
                raise ValueError(
                    f"{key}.workload: unknown workload {workload!r}; valid: {', '.join(hx.synth.WORKLOADS)}"
                )
            self.synth.setdefault("clips", 48)
            self.synth.setdefault("scale", 1.0)
            hx.synth.plan_workload(
                workload, int(self.synth["clips"]), int(spec.get("seed", 0)), float(self.synth["scale"])
            )  # checks clips and scale (pure)
            self.synth["seed"] = int(spec.get("seed", 0))
        elif "shards" in spec:
            if not isinstance(spec["shards"], str) or not spec["shards"]:
                raise ValueError(f"{key}.shards: a shard path, URL or brace pattern, got {spec['shards']!r}")
        elif not _is_url(spec["manifest"]):
            manifest = Path(os.path.expanduser(str(spec["manifest"])))
            if not manifest.is_file():
                raise FileNotFoundError(f"{key}.manifest: {manifest} does not exist")
            spec["manifest"] = str(manifest)
        if "storage_options" in spec:
            spec["storage_options"] = hx.check_storage_options(spec["storage_options"], where=f"{key}.storage_options")
        if "remote" in spec:
            try:
                hx.RemoteConfig.of(spec["remote"])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{key}.remote: {str(e).removeprefix('remote: ')}") from None
        self.kwargs = spec

    @property
    def root(self) -> Path:
        """The folder of the synthesized workload (``workload`` configs only)."""
        s = self.synth
        return hx.cache_dir() / "data" / f"{s['workload']}-{s['clips']}-s{s['scale']:g}-seed{s['seed']}"

    def manifest(self) -> Path | str:
        """The manifest's path (a URL as it is; a shard set's pattern)."""
        if self.synth:
            return self.root / "manifest.jsonl"
        if "shards" in self.kwargs:
            return self.kwargs["shards"]
        return self.kwargs["manifest"] if _is_url(self.kwargs["manifest"]) else Path(self.kwargs["manifest"])

    def prepare(self, workers: int = 1, progress: bool = False) -> Path | str:
        """Synthesize and profile a named workload unless that was done before (call it on one
        process per host, as Lightning's ``prepare_data``); the manifest's path."""
        if self.synth:
            s = self.synth
            root = self.root
            if not (root / "manifest.jsonl").exists() or not (root / "profiles.jsonl").exists():
                hx.synth.make_dataset(
                    root,
                    s["workload"],
                    int(s["clips"]),
                    seed=s["seed"],
                    scale=float(s["scale"]),
                    workers=workers,
                    progress=progress,
                )
                hx.profile_dataset(root / "manifest.jsonl", calibrate_per_bucket=1, progress=progress)
        return self.manifest()

    def build(self):
        """The dataset (after ``prepare``)."""
        if "shards" in self.kwargs:
            kwargs = {k: v for k, v in self.kwargs.items() if k != "shards"}
            self._no_captions(kwargs)
            cls = hx.WebDatasetClips if self.kind == "video" else hx.WebDatasetTextClips
            return cls(self.kwargs["shards"], **kwargs)
        manifest = self.manifest()
        if isinstance(manifest, Path) and not manifest.is_file():
            raise FileNotFoundError(
                f"{self.key}: {manifest} does not exist; call prepare() (Lightning's "
                "prepare_data does) on one process per host first"
            )
        kwargs = {k: v for k, v in self.kwargs.items() if k != "manifest"}
        self._no_captions(kwargs)
        if self.kind == "video":
            return hx.VideoClipDataset(manifest, **kwargs)
        return hx.VideoTextDataset(manifest, **kwargs)

    def _no_captions(self, kwargs: dict) -> None:
        if self.kind == "video":
            for k in ("tokenizer", "max_text_len"):
                if k in kwargs:
                    raise ValueError(f"{self.key}.{k}: only a 'video-text' dataset has captions")


def _is_url(location) -> bool:
    """A manifest fsspec reads (``s3://``, ``https://``, ...), not a local path or ``file://``."""
    scheme, sep, _ = str(location).partition("://")
    return bool(sep) and scheme.lower() != "file" and scheme.replace("+", "").replace(".", "").isalnum()


def _nice_worker(nice: int, worker_id: int) -> None:
    os.nice(nice)


def build_loader(
    loader: str,
    dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    *,
    coordinator: str | None = None,
    options: Mapping | None = None,
):
    """This rank's loader: ``"helix"`` (``DistributedDataLoader``) or ``"torch"`` (a torch
    ``DataLoader`` with ``DistributedSampler(shuffle, seed)`` and the same collate: the baseline at
    the same CPU budget; Helix's own options are ignored there, with a warning). ``worker_nice``:
    the decoding workers' added niceness — for ``"helix"`` the ``ClusterConfig.worker_nice`` of the
    cluster it starts (default +10), for ``"torch"`` its workers' (default 0, as a plain DataLoader)."""
    options = dict(options or {})
    nice = options.pop("worker_nice", None)
    if nice is not None and (isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19):
        raise ValueError(f"worker_nice is a niceness in 0..19, got {nice!r}")
    if loader == "helix":
        if nice is not None:  # the decoding workers of the cluster it starts
            config = options.get("config") or hx.ClusterConfig()
            if isinstance(config, hx.ClusterConfig):  # anything else: the loader refuses it, naming `config`
                options["config"] = dataclasses.replace(config, worker_nice=nice)
        return hx.DistributedDataLoader(
            dataset, batch_size, rank=rank, world_size=world_size, coordinator=coordinator, **options
        )
    if loader != "torch":
        raise ValueError(f"loader={loader!r}; valid: {', '.join(LOADERS)}")
    ignored = sorted(k for k in options if k not in _TORCH_OPTIONS)
    if ignored:
        warnings.warn(f"loader='torch' ignores Helix's options {', '.join(ignored)}", stacklevel=2)
    sampler = torch.utils.data.DistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=bool(options.get("shuffle", False)),
        seed=int(options.get("seed", 0)),
        drop_last=bool(options.get("drop_last", False)),
    )
    workers = options.get("num_workers")
    workers = max(1, (os.cpu_count() or 2) // world_size) if workers is None else int(workers)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size,
        sampler=sampler,
        collate_fn=options.get("collate_fn"),
        num_workers=workers,
        pin_memory=bool(options.get("pin_memory", False)),
        persistent_workers=workers > 0,
        drop_last=bool(options.get("drop_last", False)),
        multiprocessing_context="spawn" if workers > 0 else None,
        worker_init_fn=functools.partial(_nice_worker, nice) if nice else None,
    )


def dataset_length_error(lengths: list[int], key: str = "dataset") -> str | None:
    """The error when ranks see datasets of different lengths (they would never agree on the
    number of steps: a DDP hang), else None."""
    if len(set(lengths)) <= 1:
        return None
    return (
        f"{key} has a different length on each rank ({', '.join(f'rank {r}: {n}' for r, n in enumerate(lengths))}):"
        " every rank must see the same dataset"
    )
