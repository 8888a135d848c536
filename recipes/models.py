"""Video models that turn one Helix batch into one training loss.

``build_model(family, pretrained=None, **config)`` returns a ``VideoModel``; ``model(batch)`` is
the scalar loss of a batch from ``helix_core.pad_collate``. Each family is TINY and randomly
initialised from its config by default, or loaded from a local ``pretrained`` folder; nothing is
ever downloaded (``local_files_only=True`` everywhere).

- ``qwen2-vl``: ``Qwen2VLForConditionalGeneration``, LM loss on the caption after the video.
- ``videomae``: ``VideoMAEForPreTraining`` with tube masking, or ``VideoMAEForVideoClassification``
  (``task="classification"``, labels from ``batch["label"]``).
- ``wan``: ``WanTransformer3DModel`` on the latents of a frozen ``AutoencoderKLWan`` with the
  flow-matching loss; a learned embedding of the caption ids stands in for umT5.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

from .specs import SPECS, Qwen2VLSpec, VideoMAESpec, WanSpec, _check_family, mask_count

__all__ = ["Qwen2VLSpec", "VideoMAESpec", "VideoModel", "WanSpec", "build_model"]

_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
_IGNORE = -100  # label of positions without a loss (video placeholders, padding)


# ---- public surface ------------------------------------------------------------------------------
def build_model(family: str, *, pretrained: str | os.PathLike | None = None, **config) -> VideoModel:
    """A ``VideoModel`` of ``family``: tiny and random from ``config`` (overrides of the family's
    spec: ``Qwen2VLSpec``, ``VideoMAESpec``, ``WanSpec``), or loaded from the local folder
    ``pretrained`` (for wan, a diffusers folder with ``transformer/`` and ``vae/``); with
    ``pretrained`` only the spec's ``TRAINING_KEYS`` may be set. Every argument is checked before
    anything heavy is imported or built."""
    spec_cls = SPECS[_check_family(family)]
    valid = [f.name for f in dataclasses.fields(spec_cls)]
    for key in config:
        if key not in valid:
            raise ValueError(f"model.{key}: unknown config key for family {family!r}; valid keys: {', '.join(valid)}")
    if pretrained is not None:
        if not os.path.isdir(pretrained):
            raise FileNotFoundError(
                f"model.pretrained={os.fspath(pretrained)!r}: no such folder (Helix never downloads)"
            )
        arch = [k for k in config if k not in spec_cls.TRAINING_KEYS]
        if arch:
            raise ValueError(
                f"model.{arch[0]}: the pretrained folder sets the architecture; with model.pretrained "
                f"only {', '.join(spec_cls.TRAINING_KEYS) or 'no keys'} may be set"
            )
        pretrained = os.fspath(pretrained)
    spec = spec_cls(**config)
    return {"qwen2-vl": _Qwen2VL, "videomae": _VideoMAE, "wan": _Wan}[family].build(spec, pretrained)


class VideoModel(nn.Module):
    """A family's network plus how a batch becomes its training loss: ``forward(batch)`` is a
    scalar. Batch tensors may sit on the CPU; they move to the model's device."""

    family: str = ""

    def forward(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


def _equal_shapes(batch: dict, family: str) -> tuple[int, int, int, int, int]:
    """[B, T, 3, H, W] of a batch whose every sample fills it (no padding), else ValueError."""
    b, t, c, h, w = batch["video"].shape
    lengths, sizes = batch.get("video_lengths"), batch.get("video_sizes")
    ragged = lengths is not None and bool((lengths != t).any())
    ragged |= sizes is not None and bool((sizes != torch.tensor([h, w], device=sizes.device)).any())
    if ragged:
        raise ValueError(
            f"{family}: every sample of a batch needs the same frames and size (fix num_frames and "
            f"size in the dataset); got frames {lengths}, sizes {sizes}"
        )
    return b, t, c, h, w


def _captions(batch: dict, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of a batch, or a ValueError saying where captions come from."""
    if "input_ids" not in batch or "attention_mask" not in batch:
        raise ValueError(f"{family}: the batch has no captions (input_ids); build it with helix_core.VideoTextDataset")
    return batch["input_ids"], batch["attention_mask"]


def _normalise(video: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 [..., 3, H, W] to float ``(x / 255 - mean) / std`` per channel."""
    m, s = (torch.tensor(v, device=video.device).view(3, 1, 1) for v in (mean, std))
    return (video.float() / 255 - m) / s


# ---- qwen2-vl ------------------------------------------------------------------------------------
class _Qwen2VL(VideoModel):
    family = "qwen2-vl"

    def __init__(self, net):
        super().__init__()
        self.net = net

    @classmethod
    def build(cls, spec: Qwen2VLSpec, pretrained: str | None):
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        if pretrained is not None:
            return cls(Qwen2VLForConditionalGeneration.from_pretrained(pretrained, local_files_only=True))
        v, half = spec.vocab_size, spec.hidden_size // spec.num_heads // 2
        hw = half * 3 // 8  # Qwen2-VL splits the rotary frequencies t:h:w = 2:3:3 (16, 24, 24 of 64)
        text = {
            "vocab_size": v,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [half - 2 * hw, hw, hw]},
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "use_cache": False,
        }
        vision = {
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "hidden_size": spec.hidden_size,
            "num_heads": spec.vision_heads,
            "mlp_ratio": 2,
            "patch_size": spec.patch_size,
            "temporal_patch_size": spec.temporal_patch_size,
            "spatial_merge_size": spec.spatial_merge_size,
        }
        cfg = Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=v - 4,
            video_token_id=v - 3,
            vision_start_token_id=v - 2,
            vision_end_token_id=v - 1,
        )
        return cls(Qwen2VLForConditionalGeneration(cfg))

    def patchify(self, video: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One sample's uint8 [T, 3, H, W] as Qwen2-VL's video processor makes it: CLIP-normalised
        rows of 3 * temporal_patch * patch**2 values, in merge-window order, and its (t, h, w) grid.
        An odd last temporal pair repeats the last frame."""
        vc = self.net.config.vision_config
        p, tp, m = vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size
        x = _normalise(video, _CLIP_MEAN, _CLIP_STD)
        if pad := -x.shape[0] % tp:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        t, c, h, w = x.shape
        if h % (p * m) or w % (p * m):
            raise ValueError(
                f"qwen2-vl: frames of {h}x{w} pixels are not multiples of {p * m} (patch x merge); "
                "use helix_core's qwen2-vl datasets, which smart_resize them"
            )
        gt, gh, gw = t // tp, h // p, w // p
        x = x.view(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)

    def inputs(self, batch: dict) -> dict:
        """The network's keyword arguments for ``batch``: per sample, ``[vision start, video
        placeholders (t*h*w / merge**2), vision end, caption]``, right-padded; labels are the
        caption (else -100); ``mm_token_type_ids`` is 2 on video placeholders, 0 elsewhere."""
        cfg, dev = self.net.config, self.device
        (ids, mask), video = _captions(batch, "qwen2-vl"), batch["video"]
        mask = mask.bool()
        b, t_max, _, h_max, w_max = video.shape
        lengths = batch.get("video_lengths", torch.full((b,), t_max))
        sizes = batch.get("video_sizes", torch.tensor([[h_max, w_max]] * b))
        vocab = cfg.text_config.vocab_size
        special = (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
        captions = ids[mask]
        if captions.numel() and (
            int(captions.max()) >= vocab
            or bool(torch.isin(captions, torch.tensor(special, device=captions.device)).any())
        ):
            raise ValueError(
                f"qwen2-vl: caption ids must be below the vocabulary ({vocab}) and not vision ids {special}"
            )
        merge2 = cfg.vision_config.spatial_merge_size**2
        patches, grids, rows = [], [], {"input_ids": [], "labels": [], "mm_token_type_ids": [], "attention_mask": []}
        for i in range(b):
            h, w = (int(s) for s in sizes[i])
            pixels, grid = self.patchify(video[i, : int(lengths[i]), :, :h, :w].to(dev))
            if "video_grid_thw" in batch and tuple(int(g) for g in batch["video_grid_thw"][i]) != grid:
                raise ValueError(
                    f"qwen2-vl: sample {i} has video_grid_thw {batch['video_grid_thw'][i].tolist()} but "
                    f"its {int(lengths[i])}x{h}x{w} video patchifies to {list(grid)}"
                )
            patches.append(pixels)
            grids.append(grid)
            n, cap = grid[0] * grid[1] * grid[2] // merge2, ids[i][mask[i]].tolist()
            rows["input_ids"].append(
                [cfg.vision_start_token_id, *[cfg.video_token_id] * n, cfg.vision_end_token_id, *cap]
            )
            rows["labels"].append([_IGNORE] * (n + 2) + cap)
            # text 0, image 1, video 2: the modality M-RoPE gives (t, h, w) positions
            rows["mm_token_type_ids"].append([0] + [2] * n + [0] * (1 + len(cap)))
            rows["attention_mask"].append([1] * (n + 2 + len(cap)))
        width = max(len(r) for r in rows["input_ids"])
        fill = {"input_ids": cfg.text_config.pad_token_id or 0, "labels": _IGNORE}
        out = {
            k: torch.tensor([r + [fill.get(k, 0)] * (width - len(r)) for r in v], dtype=torch.int64, device=dev)
            for k, v in rows.items()
        }
        return {
            **out,
            "pixel_values_videos": torch.cat(patches),
            "video_grid_thw": torch.tensor(grids, dtype=torch.int64, device=dev),
        }

    def forward(self, batch: dict) -> torch.Tensor:
        return self.net(**self.inputs(batch), use_cache=False).loss


# ---- videomae ------------------------------------------------------------------------------------
class _VideoMAE(VideoModel):
    family = "videomae"

    def __init__(self, net, spec: VideoMAESpec):
        super().__init__()
        self.net, self.task, self.mask_ratio = net, spec.task, spec.mask_ratio

    @classmethod
    def build(cls, spec: VideoMAESpec, pretrained: str | None):
        import transformers as hf

        net_cls = hf.VideoMAEForVideoClassification if spec.task == "classification" else hf.VideoMAEForPreTraining
        if pretrained is not None:
            extra = {"num_labels": spec.num_labels} if spec.task == "classification" else {}
            return cls(net_cls.from_pretrained(pretrained, local_files_only=True, **extra), spec)
        cfg = hf.VideoMAEConfig(
            image_size=spec.image_size,
            num_frames=spec.num_frames,
            patch_size=spec.patch_size,
            tubelet_size=spec.tubelet_size,
            hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            intermediate_size=spec.intermediate_size,
            decoder_hidden_size=spec.decoder_hidden_size,
            decoder_num_hidden_layers=spec.decoder_layers,
            decoder_num_attention_heads=spec.decoder_heads,
            decoder_intermediate_size=2 * spec.decoder_hidden_size,
            num_labels=spec.num_labels,
        )
        return cls(net_cls(cfg), spec)

    def tube_mask(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """bool [B, tokens]: the same random spatial patches masked in every tubelet, the same
        count (``int(mask_ratio * patches)``) in every sample (tokens are time-major)."""
        cfg = self.net.config
        patches = (_side(cfg.image_size) // cfg.patch_size) ** 2
        n = mask_count(self.mask_ratio, patches)
        order = torch.rand(batch_size, patches, generator=generator).argsort(dim=1)
        spatial = torch.zeros(batch_size, patches, dtype=torch.bool).scatter_(1, order[:, :n], True)
        return spatial.repeat(1, cfg.num_frames // cfg.tubelet_size).to(self.device)

    def forward(self, batch: dict) -> torch.Tensor:
        cfg = self.net.config
        b, t, _, h, w = _equal_shapes(batch, "videomae")
        if (t, h, w) != (cfg.num_frames, _side(cfg.image_size), _side(cfg.image_size)):
            raise ValueError(
                f"videomae: the batch has {t} frames of {h}x{w} but the model takes {cfg.num_frames} "
                f"of {_side(cfg.image_size)}x{_side(cfg.image_size)} (set the dataset's num_frames "
                "and size, or model.num_frames and model.image_size)"
            )
        x = _normalise(batch["video"].to(self.device), _IMAGENET_MEAN, _IMAGENET_STD)
        if self.task == "classification":
            labels = batch["label"].to(self.device)
            if bool((labels < 0).any()) or bool((labels >= cfg.num_labels).any()):
                raise ValueError(
                    f"videomae classification needs labels in [0, {cfg.num_labels}), got "
                    f"{labels.tolist()} (-1: the manifest has no label)"
                )
            return self.net(pixel_values=x, labels=labels).loss
        return self.net(pixel_values=x, bool_masked_pos=self.tube_mask(b)).loss


def _side(size) -> int:  # a config's image_size: an int or an (H, W) pair
    return int(size if isinstance(size, int) else size[0])


# ---- wan -----------------------------------------------------------------------------------------
class _Wan(VideoModel):
    family = "wan"

    def __init__(self, transformer, vae, spec: WanSpec):
        super().__init__()
        self.transformer = transformer
        self.vae = vae.requires_grad_(False).eval()
        self.text_embed = nn.Embedding(spec.text_vocab_size, transformer.config.text_dim, padding_idx=0)
        self.timestep_sampling = spec.timestep_sampling
        for name in ("latents_mean", "latents_std"):  # per latent channel, as Wan's pipelines normalise
            self.register_buffer(name, torch.tensor(getattr(vae.config, name)).view(1, -1, 1, 1, 1), persistent=False)

    @classmethod
    def build(cls, spec: WanSpec, pretrained: str | None):
        from diffusers import AutoencoderKLWan, WanTransformer3DModel

        if pretrained is not None:
            return cls(
                WanTransformer3DModel.from_pretrained(pretrained, subfolder="transformer", local_files_only=True),
                AutoencoderKLWan.from_pretrained(pretrained, subfolder="vae", local_files_only=True),
                spec,
            )
        vae = AutoencoderKLWan(
            base_dim=spec.vae_base_dim,
            z_dim=spec.z_dim,
            num_res_blocks=1,
            latents_mean=[0.0] * spec.z_dim,
            latents_std=[1.0] * spec.z_dim,
        )
        transformer = WanTransformer3DModel(
            num_attention_heads=spec.num_heads,
            attention_head_dim=spec.head_dim,
            in_channels=spec.z_dim,
            out_channels=spec.z_dim,
            text_dim=spec.text_dim,
            freq_dim=spec.freq_dim,
            ffn_dim=spec.ffn_dim,
            num_layers=spec.num_layers,
        )
        return cls(transformer, vae, spec)

    def train(self, mode: bool = True):
        super().train(mode)
        self.vae.eval()  # frozen: always in inference mode
        return self

    def latents(self, video: torch.Tensor) -> torch.Tensor:
        """Normalised VAE latents [B, z, 1 + (T-1)/4, H/8, W/8] of uint8 video [B, T, 3, H, W]."""
        x = (video.to(self.device).float() / 127.5 - 1).permute(0, 2, 1, 3, 4)
        with torch.no_grad():
            z = self.vae.encode(x.to(self.vae.dtype)).latent_dist.sample()
        return (z.float() - self.latents_mean) / self.latents_std

    def forward(self, batch: dict) -> torch.Tensor:
        _, t, _, h, w = _equal_shapes(batch, "wan")
        space = getattr(self.vae.config, "scale_factor_spatial", 8) * self.transformer.config.patch_size[1]
        if (t - 1) % 4 or h % space or w % space:
            raise ValueError(
                f"wan: the batch has {t} frames of {h}x{w}; Wan needs 4k+1 frames and sides that are "
                f"multiples of {space} (helix_core's wan datasets round to both)"
            )
        ids, mask = (x.to(self.device) for x in _captions(batch, "wan"))
        if int(ids.max()) >= self.text_embed.num_embeddings:
            raise ValueError(
                f"wan: caption id {int(ids.max())} >= model.text_vocab_size={self.text_embed.num_embeddings}"
            )
        x0 = self.latents(batch["video"])
        b = x0.shape[0]
        logit_normal = self.timestep_sampling == "logit-normal"
        s = torch.randn(b, device=self.device).sigmoid() if logit_normal else torch.rand(b, device=self.device)
        noise = torch.randn_like(x0)
        sv = s.view(b, 1, 1, 1, 1)
        xt = (1 - sv) * x0 + sv * noise  # rectified flow: straight path from data (s=0) to noise (s=1)
        text = self.text_embed(ids) * mask.unsqueeze(-1).to(self.text_embed.weight.dtype)
        dtype = self.transformer.dtype
        pred = self.transformer(
            hidden_states=xt.to(dtype), timestep=s * 1000, encoder_hidden_states=text.to(dtype), return_dict=False
        )[0]
        return F.mse_loss(pred.float(), noise - x0)
