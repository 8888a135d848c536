"""Helix: a CPU–GPU co-scheduling data plane for multimodal training (the runtime).

The public surface; everything else is internal. See README.md and DESIGN.md.
"""
from . import tokens
from .collate import pad_collate
from .costs import CostFit, CostModel, calibrate, profile_bucket
from .datasets import VideoClipDataset, VideoTextDataset, sample_generator
from .descriptors import BatchRequest, CostProfile, SampleDescriptor
from .errors import ClusterError, ManifestError, SampleError
from .families import MODELS, VideoSpec
from .manifest import Manifest
from .media import synth
from .media.decode import decode_frames, uniform_indices
from .media.probe import probe
from .profiles import ProfileTable, profile_dataset

__version__ = "0.1.0"

__all__ = sorted([
    "BatchRequest", "ClusterError", "CostFit", "CostModel", "CostProfile", "MODELS", "Manifest",
    "ManifestError", "ProfileTable", "SampleDescriptor", "SampleError", "VideoClipDataset", "VideoSpec",
    "VideoTextDataset", "calibrate", "decode_frames", "pad_collate", "probe", "profile_bucket",
    "profile_dataset", "sample_generator", "synth", "tokens", "uniform_indices",
])
