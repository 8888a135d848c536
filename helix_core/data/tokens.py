"""Token and latent formulas: the GPU cost of a sample, per model family.

Every function takes scalars or numpy arrays (vectorised over a whole profile table) and returns
the same kind. Frame counts are the *sampled* counts unless a name says ``source``.

- Qwen2-VL / Qwen2.5-VL follow qwen-vl-utils ``vision_process.py`` (FPS=2, FRAME_FACTOR=2,
  patch 14 merged 2x2 -> factor 28).
- VideoMAE: tubelet 2, patch 16.
- Wan 2.1: VAE stride (4, 8, 8), 16 latent channels, DiT patch (1, 2, 2).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "QWEN_FACTOR",
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen_num_frames",
    "qwen_resize",
    "smart_resize",
    "videomae",
    "wan",
    "wan_latent_shape",
    "wan_num_frames",
]

QWEN_FACTOR = 28
QWEN_FPS = 2.0
QWEN_FRAME_FACTOR = 2
QWEN_MIN_FRAMES = 4
QWEN_MAX_FRAMES = 768
QWEN_VIDEO_MIN_PIXELS = 128 * 28 * 28
QWEN_VIDEO_MAX_PIXELS = 768 * 28 * 28
QWEN_VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)


def _out(x):
    """Return a Python int for 0-d results, an int64 array otherwise."""
    a = np.asarray(x)
    return int(a) if a.ndim == 0 else a.astype(np.int64)


def qwen_num_frames(source_frames, source_fps, fps: float = QWEN_FPS):
    """Frames Qwen-VL samples from a clip (qwen-vl-utils ``smart_nframes``): about ``fps`` per
    second, clamped to [4, min(768, source_frames)], rounded down to even (at least 1)."""
    t = np.asarray(source_frames, dtype=np.float64)
    src_fps = np.maximum(np.asarray(source_fps, dtype=np.float64), 1e-6)
    max_frames = np.floor(np.minimum(QWEN_MAX_FRAMES, t) / QWEN_FRAME_FACTOR) * QWEN_FRAME_FACTOR
    n = np.minimum(np.minimum(np.maximum(t / src_fps * fps, QWEN_MIN_FRAMES), max_frames), t)
    n = np.floor(n / QWEN_FRAME_FACTOR) * QWEN_FRAME_FACTOR
    return _out(np.maximum(n, np.minimum(t, 1)))


def smart_resize(
    height, width, factor: int = QWEN_FACTOR, min_pixels=QWEN_VIDEO_MIN_PIXELS, max_pixels=QWEN_VIDEO_MAX_PIXELS
):
    """qwen-vl-utils ``smart_resize``: H, W rounded to multiples of ``factor`` with the pixel
    count kept within [min_pixels, max_pixels] and the aspect ratio nearly kept."""
    h = np.asarray(height, dtype=np.float64)
    w = np.asarray(width, dtype=np.float64)
    h_bar = np.maximum(factor, np.round(h / factor) * factor)
    w_bar = np.maximum(factor, np.round(w / factor) * factor)
    area = h_bar * w_bar
    beta_dn = np.sqrt(h * w / np.asarray(max_pixels, dtype=np.float64))
    beta_up = np.sqrt(np.asarray(min_pixels, dtype=np.float64) / (h * w))
    big, small = area > max_pixels, area < min_pixels
    h_bar = np.where(big, np.maximum(factor, np.floor(h / beta_dn / factor) * factor), h_bar)
    w_bar = np.where(big, np.maximum(factor, np.floor(w / beta_dn / factor) * factor), w_bar)
    h_bar = np.where(small & ~big, np.ceil(h * beta_up / factor) * factor, h_bar)
    w_bar = np.where(small & ~big, np.ceil(w * beta_up / factor) * factor, w_bar)
    return _out(h_bar), _out(w_bar)


def qwen_resize(num_frames, height, width, max_pixels=None):
    """Resized (H, W) of Qwen-VL video frames: the per-frame pixel cap is
    ``max(min(max_pixels, TOTAL / n * 2), int(1.05 * 128*28*28))``; ``max_pixels`` defaults to
    768*28*28 (a dataset's ``size`` sets it to ``size**2``)."""
    cap_hi = QWEN_VIDEO_MAX_PIXELS if max_pixels is None else max_pixels
    n = np.maximum(np.asarray(num_frames, dtype=np.float64), 1)
    cap = np.maximum(
        np.minimum(cap_hi, QWEN_VIDEO_TOTAL_PIXELS / n * QWEN_FRAME_FACTOR), int(QWEN_VIDEO_MIN_PIXELS * 1.05)
    )
    return smart_resize(height, width, QWEN_FACTOR, QWEN_VIDEO_MIN_PIXELS, cap)


def qwen2_vl(num_frames, height, width, max_pixels=None, resized: bool = False):
    """LLM tokens of a Qwen2-VL video: ``ceil(n/2) * (h/28) * (w/28)`` after ``qwen_resize``.

    ``num_frames`` is the sampled count; ``height`` / ``width`` the source size (or, with
    ``resized=True``, the already resized size). 16 frames at 224x224 -> 336x336, 1152 tokens.
    """
    n = np.asarray(num_frames, dtype=np.int64)
    h, w = (height, width) if resized else qwen_resize(n, height, width, max_pixels)
    return _out(((n + 1) // 2) * (np.asarray(h) // QWEN_FACTOR) * (np.asarray(w) // QWEN_FACTOR))


qwen2_5_vl = qwen2_vl  # Qwen2.5-VL keeps the vision token formula (patch 14, 2x2 merge, temporal 2)


def videomae(num_frames, height, width, tubelet: int = 2, patch: int = 16):
    """VideoMAE tokens ``(T // tubelet) * (H/patch) * (W/patch)``: 1568 for 16 x 224 x 224."""
    t = np.asarray(num_frames, dtype=np.int64)
    return _out((t // tubelet) * (np.asarray(height) // patch) * (np.asarray(width) // patch))


def wan_num_frames(num_frames):
    """Frames rounded down to the 4k+1 that Wan's causal VAE takes (at least 1)."""
    t = np.maximum(np.asarray(num_frames, dtype=np.int64), 1)
    return _out((t - 1) // 4 * 4 + 1)


def wan_latent_shape(num_frames, height, width) -> tuple[int, int, int, int]:
    """Wan 2.1 VAE latent ``(16, (T-1)//4 + 1, H/8, W/8)`` for T = 4k+1, H, W multiples of 16."""
    t = int(wan_num_frames(num_frames))
    return 16, (t - 1) // 4 + 1, int(height) // 8, int(width) // 8


def wan(num_frames, height, width):
    """Wan 2.1 DiT tokens ``((T-1)//4 + 1) * (H/16) * (W/16)``: 32,760 for 81 x 480 x 832."""
    t = np.asarray(wan_num_frames(num_frames), dtype=np.int64)
    return _out(((t - 1) // 4 + 1) * (np.asarray(height) // 16) * (np.asarray(width) // 16))
