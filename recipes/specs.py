"""The model families' configs: frozen dataclasses checked when built (``recipes.models`` builds
the networks from them). Every error names the YAML key (``model.<field>``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "FAMILIES",
    "SPECS",
    "Qwen2VLSpec",
    "VideoMAESpec",
    "WanSpec",
    "check_families",
    "dataset_kind",
    "default_collate_for",
    "mask_count",
]


# ---- configs (frozen, validated) ---------------------------------------------------------------
class _Spec:
    """Validation shared by the specs: int fields are positive, ``DIVIDES`` pairs divide, then
    ``check()``. ``TRAINING_KEYS``: keys that still apply to a pretrained model (the rest set the
    architecture)."""

    TRAINING_KEYS = ()
    DIVIDES = ()

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"model.{f.name} must be a positive int, got {v!r}")
        for a, b in self.DIVIDES:
            if getattr(self, a) % getattr(self, b):
                raise ValueError(f"model.{a}={getattr(self, a)} must be a multiple of model.{b}={getattr(self, b)}")
        self.check()


@dataclass(frozen=True)
class Qwen2VLSpec(_Spec):
    """Tiny Qwen2-VL. Widths are features, depths layers. The last 4 ids of ``vocab_size`` are
    the image, video, vision-start and vision-end tokens; captions use the ids below them."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 320
    vision_embed_dim: int = 32
    vision_depth: int = 1
    vision_heads: int = 2
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2

    DIVIDES = (("hidden_size", "num_heads"), ("num_heads", "num_kv_heads"), ("vision_embed_dim", "vision_heads"))

    def check(self):
        if (self.hidden_size // self.num_heads) % 8 or (self.vision_embed_dim // self.vision_heads) % 4:
            raise ValueError(
                "model: the text head width (hidden_size/num_heads) must be a multiple of 8 and the "
                "vision head width (vision_embed_dim/vision_heads) of 4 (3D rotary sections)"
            )
        if self.vocab_size < 263:
            raise ValueError(
                f"model.vocab_size={self.vocab_size} must be >= 263 (byte tokenizer ids 0..258 + 4 vision ids)"
            )


@dataclass(frozen=True)
class VideoMAESpec(_Spec):
    """Tiny VideoMAE. ``image_size`` (pixels) and ``num_frames`` must match the batches.
    ``mask_ratio``: fraction of spatial patches masked (the same ones in every frame)."""

    image_size: int = 64
    num_frames: int = 4
    patch_size: int = 16
    tubelet_size: int = 2
    hidden_size: int = 32
    num_layers: int = 1
    num_heads: int = 2
    intermediate_size: int = 64
    decoder_hidden_size: int = 32
    decoder_layers: int = 1
    decoder_heads: int = 2
    mask_ratio: float = 0.9
    task: str = "pretraining"
    num_labels: int = 400

    TRAINING_KEYS = ("mask_ratio", "task", "num_labels")
    DIVIDES = (
        ("image_size", "patch_size"),
        ("num_frames", "tubelet_size"),
        ("hidden_size", "num_heads"),
        ("decoder_hidden_size", "decoder_heads"),
    )

    def check(self):
        if self.task not in ("pretraining", "classification"):
            raise ValueError(f"model.task={self.task!r}; valid: pretraining, classification")
        mask_count(self.mask_ratio, (self.image_size // self.patch_size) ** 2)


@dataclass(frozen=True)
class WanSpec(_Spec):
    """Tiny Wan 2.1 transformer and VAE. ``text_vocab_size``: ids the caption embedding takes;
    ``timestep_sampling``: ``"uniform"`` or ``"logit-normal"`` flow-matching times in (0, 1)."""

    num_layers: int = 1
    num_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 64
    text_dim: int = 32
    freq_dim: int = 32
    vae_base_dim: int = 8
    z_dim: int = 4
    text_vocab_size: int = 320
    timestep_sampling: str = "uniform"

    TRAINING_KEYS = ("text_vocab_size", "timestep_sampling")

    def check(self):
        if self.head_dim % 2 or self.freq_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} and model.freq_dim={self.freq_dim} must be even")
        if self.timestep_sampling not in ("uniform", "logit-normal"):
            raise ValueError(f"model.timestep_sampling={self.timestep_sampling!r}; valid: uniform, logit-normal")


SPECS = {"qwen2-vl": Qwen2VLSpec, "videomae": VideoMAESpec, "wan": WanSpec}


def mask_count(ratio: float, patches: int) -> int:
    """Masked spatial patches per frame: ``int(ratio * patches)``, at least one kept and one masked."""
    n = int(float(ratio) * patches)
    if not 0 < n < patches:
        raise ValueError(
            f"model.mask_ratio={ratio} masks {n} of {patches} spatial patches; "
            "it must mask at least one and keep at least one"
        )
    return n


FAMILIES = tuple(SPECS)  # the families with a recipe model


# ---- the families and their data ---------------------------------------------------------------------
def _check_family(family) -> str:
    if family not in FAMILIES:
        raise ValueError(f"model.family={family!r} is not a model family; valid: {', '.join(FAMILIES)}")
    return family


def dataset_kind(family: str) -> str:
    """``"video-text"`` (``helix_core.VideoTextDataset``: the loss needs captions) for qwen2-vl
    and wan, ``"video"`` (``helix_core.VideoClipDataset``) for videomae."""
    return "video" if _check_family(family) == "videomae" else "video-text"


def default_collate_for(family: str):
    """The collate function of a family's batches: ``helix_core.pad_collate`` for all."""
    from helix_core.data.collate import pad_collate

    _check_family(family)
    return pad_collate


def check_families(family: str, datasets: Mapping) -> None:
    """The data must be decoded for the model being trained (frames, geometry, captions):
    ``datasets`` maps config keys (``dataset``, ``val_dataset``) to their specs; specs that are
    not mappings (torch datasets) are the user's to match."""
    for key, spec in datasets.items():
        if isinstance(spec, Mapping) and spec.get("model", "videomae") != family:
            raise ValueError(
                f"data.{key}.model={spec.get('model', 'videomae')!r} but model.family={family!r}: "
                "decode the clips for the model being trained"
            )
