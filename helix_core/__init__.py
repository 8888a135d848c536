"""Helix: a CPU–GPU co-scheduling data plane for multimodal training (the runtime).

The user's surface — the names a training script needs; everything else is internal. Names load
on first use (PEP 562), so the Coordinator process and the ``helix`` command start without
importing torch; ``__init__.pyi`` declares them for type checkers and editors
(``tests/test_layers.py`` keeps the two equal).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CostProfile": "data.descriptors",
    "SampleDescriptor": "data.descriptors",
    "ClusterConfig": "config",
    "cache_dir": "config",
    "ClusterError": "errors",
    "ManifestError": "errors",
    "SampleError": "errors",
    "SpecError": "errors",
    "CostFit": "data.costs",
    "CostModel": "data.costs",
    "calibrate": "data.costs",
    "DistributedDataLoader": "loader.loader",
    "LocalCluster": "launch.cluster",
    "Tls": "security.tls",
    "ray_sidecars": "launch.sidecars",
    "RaySidecars": "launch.sidecars",
    "FAMILIES": "data.families",
    "MODELS": "data.families",
    "VideoSpec": "data.families",
    "Manifest": "data.manifest",
    "ProfileTable": "data.profiles",
    "profile_dataset": "data.profiles",
    "VideoClipDataset": "data.video",
    "VideoTextDataset": "data.video",
    "sample_generator": "data.video",
    "WebDatasetClips": "data.shards.dataset",
    "WebDatasetTextClips": "data.shards.dataset",
    "write_shards": "data.shards.write",
    "decode_frames": "data.media.decode",
    "pad_collate": "data.collate",
    "RemoteConfig": "data.storage.config",
    "check_storage_options": "data.storage.config",
    "probe": "data.media.probe",
    "GpuCost": "planning.gpu",
    "Rebalance": "tier2.rebalance",
    "GateArgs": "tier2.rebalance",
}
_MODULES = {"synth": "data.media.synth", "tokens": "data.tokens"}

__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{_MODULES[name]}", __name__)
    else:
        raise AttributeError(f"module 'helix_core' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return __all__
