"""Helix: a CPU–GPU co-scheduling data plane for multimodal training (the runtime).

The public surface; everything else is internal. Names load on first use (PEP 562), so the
Coordinator process and the ``helix`` command start without importing torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CostProfile": "descriptors",
    "SampleDescriptor": "descriptors",
    "ClusterConfig": "config",
    "cache_dir": "config",
    "ClusterError": "errors",
    "ManifestError": "errors",
    "SampleError": "errors",
    "SpecError": "errors",
    "CostFit": "costs",
    "CostModel": "costs",
    "calibrate": "costs",
    "profile_bucket": "costs",
    "DistributedDataLoader": "client.loader",
    "LocalCluster": "runtime.cluster",
    "Tls": "runtime.tls",
    "ray_sidecars": "sidecars",
    "RaySidecars": "sidecars",
    "FAMILIES": "families",
    "MODELS": "families",
    "VideoSpec": "families",
    "Manifest": "manifest",
    "ProfileTable": "profiles",
    "profile_dataset": "profiles",
    "VideoClipDataset": "datasets",
    "VideoTextDataset": "datasets",
    "sample_generator": "datasets",
    "decode_frames": "media.decode",
    "uniform_indices": "media.decode",
    "pad_collate": "collate",
    "probe": "media.probe",
    "GPU_COSTS": "planning.gpu",
    "GpuCost": "planning.gpu",
    "TokenPlanner": "planning.batching",
    "Rebalance": "planning.rebalance",
    "GateArgs": "planning.rebalance",
}
_MODULES = {"synth": "media.synth", "tokens": "tokens"}

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
