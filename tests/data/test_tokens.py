"""Token and latent formulas against the model families' worked examples (docs/guide/data-plane.md)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helix_core.data import tokens


def test_qwen2_vl_worked_example():
    assert tokens.qwen_resize(16, 224, 224) == (336, 336)
    assert tokens.qwen2_vl(16, 224, 224) == 1152
    assert tokens.qwen2_5_vl(16, 224, 224) == 1152


def test_qwen_frame_sampling_follows_smart_nframes():
    assert tokens.qwen_num_frames(300, 30.0) == 20  # 10 s at 2 fps
    assert tokens.qwen_num_frames(10, 30.0) == 4  # at least 4
    assert tokens.qwen_num_frames(3, 30.0) == 2  # never more than the clip, rounded down to even
    assert tokens.qwen_num_frames(30 * 600, 30.0) == 768  # at most 768
    assert tokens.qwen_num_frames(301, 30.0) == 20  # 20.07 rounds down to even


def test_videomae_and_wan_worked_examples():
    assert tokens.videomae(16, 224, 224) == 1568
    assert tokens.wan(81, 480, 832) == 32760
    assert tokens.wan_latent_shape(81, 480, 832) == (16, 21, 60, 104)
    assert tokens.wan_num_frames(84) == 81


def test_vectorised_equals_scalar():
    n, h, w = np.array([16, 32, 8]), np.array([224, 720, 1080]), np.array([224, 1280, 1920])
    vec = tokens.qwen2_vl(n, h, w)
    assert vec.tolist() == [tokens.qwen2_vl(int(a), int(b), int(c)) for a, b, c in zip(n, h, w)]
    assert tokens.videomae(n, h, w).tolist() == [tokens.videomae(int(a), int(b), int(c)) for a, b, c in zip(n, h, w)]


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 768), st.integers(16, 4000), st.integers(16, 4000))
def test_smart_resize_bounds(n, h, w):
    if max(h, w) / min(h, w) > 200:
        return
    rh, rw = tokens.qwen_resize(n, h, w)
    assert rh % 28 == 0 and rw % 28 == 0
    cap = max(min(768 * 28 * 28, tokens.QWEN_VIDEO_TOTAL_PIXELS / n * 2), int(128 * 28 * 28 * 1.05))
    assert 128 * 28 * 28 <= rh * rw <= cap
    assert tokens.qwen2_vl(n, h, w) == ((n + 1) // 2) * (rh // 28) * (rw // 28)
