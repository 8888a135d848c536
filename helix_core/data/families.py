"""What a model family makes of a clip: sampled frames, output geometry, tokens (pure, vectorised).

``size`` means, per family:
- ``videomae``: short side resized to ``size``, then a centre crop ``size x size`` (default 224,
  16 frames, uniform sampling).
- ``qwen2-vl`` / ``qwen2.5-vl``: frames sampled at 2 fps (or exactly ``num_frames`` uniformly when
  given); each frame ``smart_resize``-d within Qwen's bounds, the per-frame cap being ``size**2``
  pixels when ``size`` is given (default 768*28*28).
- ``wan``: short side to ``size`` (default 480), both sides rounded to multiples of 16, or an
  explicit ``(H, W)``; ``num_frames`` (default 81) rounded down to 4k+1.

Per-sample output hints ``num_frames`` / ``size`` (a manifest's, as the synthetic workloads write
them) fill in what the dataset leaves as ``None`` for VideoMAE and Wan, so a mixed workload keeps
its S/M/L decode profiles. Everything here works on numpy arrays over a whole profile table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from helix_core.data import tokens as tk
from helix_core.data.media.decode import SEEK_DECODE_FRAMES, SEEK_STRIDE

__all__ = ["FAMILIES", "Family", "Geometry", "MODELS", "VideoSpec"]


class Family(NamedTuple):
    """What Helix knows of a model family: default frames / size (None: the family's own rule),
    whether it trains on captions, and its GPU cost coefficients ``(a, b, c)`` of ``GpuCost``."""

    frames: int | None
    size: int | None
    captions: bool
    gpu_cost: tuple[float, float, float]


#: the one table of model families (attention over ~25k tokens doubles a VideoMAE-L sample's cost)
FAMILIES = {
    "videomae": Family(16, 224, False, (1.0, 1.0 / 25_000, 500.0)),
    "qwen2-vl": Family(None, None, True, (1.0, 1.0 / 16_000, 800.0)),
    "qwen2.5-vl": Family(None, None, True, (1.0, 1.0 / 16_000, 800.0)),
    "wan": Family(81, 480, True, (1.0, 1.0 / 32_000, 1000.0)),
}
MODELS = tuple(FAMILIES)
_DEFAULT_FRAMES = {k: f.frames for k, f in FAMILIES.items() if f.frames is not None}
_DEFAULT_SIZE = {k: f.size for k, f in FAMILIES.items() if f.size is not None}


class Geometry(NamedTuple):
    """Per-sample arrays (int64): sampled frames ``t``, swscale output ``resize_h/w``, final
    ``out_h/w`` after the crop, ``tokens``, and ``frames_decoded`` (codec work estimate)."""

    t: np.ndarray
    resize_h: np.ndarray
    resize_w: np.ndarray
    out_h: np.ndarray
    out_w: np.ndarray
    tokens: np.ndarray
    frames_decoded: np.ndarray


@dataclass(frozen=True)
class VideoSpec:
    """A model family's video configuration. ``size`` is an int, an (H, W) pair (Wan) or None."""

    model: str = "videomae"
    num_frames: int | None = None
    size: int | tuple[int, int] | None = None

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}; valid: {', '.join(MODELS)}")
        if self.num_frames is not None and int(self.num_frames) < 1:
            raise ValueError(f"num_frames must be >= 1 or None, got {self.num_frames}")
        if isinstance(self.size, (tuple, list)):
            if self.model != "wan" or len(self.size) != 2 or min(self.size) < 16:
                raise ValueError(f"size={self.size!r}: an (H, W) pair (each >= 16) is only valid for model='wan'")
        elif self.size is not None and int(self.size) < 16:
            raise ValueError(f"size must be >= 16 pixels, got {self.size}")

    @property
    def is_qwen(self) -> bool:
        return self.model.startswith("qwen")

    @property
    def uses_fps(self) -> bool:
        """Whether a clip's geometry depends on its frame rate (Qwen-VL sampling at 2 fps)."""
        return self.is_qwen and self.num_frames is None

    def geometry(self, frames, fps, height, width, hint_frames=None, hint_size=None) -> Geometry:
        """Vectorised geometry of clips with source ``frames`` / ``fps`` / ``height`` / ``width``."""
        frames = np.atleast_1d(np.asarray(frames, dtype=np.int64))
        fps = np.broadcast_to(np.asarray(fps, dtype=np.float64), frames.shape)
        h = np.broadcast_to(np.asarray(height, dtype=np.int64), frames.shape)
        w = np.broadcast_to(np.asarray(width, dtype=np.int64), frames.shape)
        t = self._frames(frames, fps, hint_frames)
        if self.model == "videomae":
            s = self._size(hint_size, frames.shape)
            short = np.maximum(np.minimum(h, w), 1)
            rh = np.where(h <= w, s, np.round(h * s / short)).astype(np.int64)
            rw = np.where(h <= w, np.round(w * s / short), s).astype(np.int64)
            oh, ow = s, s
            tokens = tk.videomae(t, oh, ow)
        elif self.is_qwen:
            max_px = None if self.size is None else int(self.size) ** 2
            rh, rw = tk.qwen_resize(t, h, w, max_px)
            rh, rw = np.atleast_1d(rh), np.atleast_1d(rw)
            oh, ow = rh, rw
            tokens = tk.qwen2_vl(t, rh, rw, resized=True)
        else:
            if isinstance(self.size, (tuple, list)):
                rh = np.full(frames.shape, _mult16(self.size[0]), dtype=np.int64)
                rw = np.full(frames.shape, _mult16(self.size[1]), dtype=np.int64)
            else:
                s = self._size(hint_size, frames.shape)
                short = np.maximum(np.minimum(h, w), 1)
                rh, rw = _mult16(h * s / short), _mult16(w * s / short)
            oh, ow = rh, rw
            tokens = tk.wan(t, rh, rw)
        oh = np.broadcast_to(oh, frames.shape).astype(np.int64)
        ow = np.broadcast_to(ow, frames.shape).astype(np.int64)
        return Geometry(t, rh, rw, oh, ow, np.atleast_1d(tokens).astype(np.int64), self._frames_decoded(frames, t))

    def _frames(self, frames, fps, hint):
        if self.is_qwen:
            if self.num_frames is not None:
                return np.full(frames.shape, int(self.num_frames), dtype=np.int64)
            return np.atleast_1d(tk.qwen_num_frames(frames, fps)).astype(np.int64)
        n = _fill(self.num_frames, hint, _DEFAULT_FRAMES[self.model], frames.shape)
        return np.atleast_1d(tk.wan_num_frames(n)) if self.model == "wan" else n

    def _size(self, hint, shape):
        return _fill(self.size, hint, _DEFAULT_SIZE[self.model], shape)

    @staticmethod
    def _frames_decoded(frames, t):
        """Frames the codec decodes: all up to the last chosen one when sequential (uniform
        sampling reaches the end), about ``SEEK_DECODE_FRAMES`` per chosen frame when seeking."""
        stride = (frames - 1) / np.maximum(t - 1, 1)
        seek = stride > SEEK_STRIDE
        return np.where(seek, np.minimum(t * SEEK_DECODE_FRAMES, frames), frames).astype(np.int64)


def _mult16(x):
    return np.maximum(16, (np.round(np.asarray(x, dtype=np.float64) / 16) * 16)).astype(np.int64)


def _fill(value, hint, default, shape) -> np.ndarray:
    """``value`` if set, else the per-sample ``hint`` (missing entries: ``default``)."""
    if value is not None:
        return np.full(shape, int(value), dtype=np.int64)
    if hint is None:
        return np.full(shape, default, dtype=np.int64)
    h = np.asarray(hint, dtype=np.float64).reshape(shape)
    return np.where(np.isfinite(h) & (h > 0), h, default).astype(np.int64)
