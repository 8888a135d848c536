"""Datasets: output shapes per model family, costs without decoding, determinism, collation."""

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import helix_core as hx
from helix_core.data import video as hx_datasets


def test_videomae_shapes_follow_manifest_profiles(kmix):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", model="videomae")
    shapes = [tuple(ds[i]["video"].shape) for i in range(3)]
    assert shapes == [(16, 3, 56, 56), (32, 3, 84, 84), (64, 3, 112, 112)]  # S/M/L at scale 0.25
    s = ds[0]
    assert s["video"].dtype == torch.uint8 and s["index"] == 0 and s["tokens"] == hx.tokens.videomae(16, 56, 56)


def test_explicit_arguments_override_hints(kmix):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", model="videomae", num_frames=8, size=48)
    batch = default_collate([ds[0], ds[2]])  # fixed shapes collate with torch's default
    assert batch["video"].shape == (2, 8, 3, 48, 48) and batch["index"].tolist() == [0, 2]


def test_qwen_shapes(kmix):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", model="qwen2-vl")
    d = ds.descriptor(1)
    s = ds[1]
    t, c, h, w = s["video"].shape
    assert c == 3 and h % 28 == 0 and w % 28 == 0
    assert t == hx.tokens.qwen_num_frames(d.frames, d.fps)
    assert s["tokens"] == hx.tokens.qwen2_vl(t, d.height, d.width)
    assert s["video_grid_thw"].tolist() == [(t + 1) // 2, h // 14, w // 14]


def test_wan_shapes(openvid):
    ds = hx.VideoClipDataset(openvid / "manifest.jsonl", model="wan", num_frames=17)
    for i in range(2):
        t, _, h, w = ds[i]["video"].shape
        assert t == 17 and h % 16 == 0 and w % 16 == 0
    fixed = hx.VideoClipDataset(openvid / "manifest.jsonl", model="wan", num_frames=20, size=(48, 80))
    assert tuple(fixed[0]["video"].shape) == (17, 3, 48, 80)  # 20 -> 4k+1 = 17


def test_invalid_options_list_valid_ones(kmix):
    with pytest.raises(ValueError, match="videomae"):
        hx.VideoClipDataset(kmix / "manifest.jsonl", model="resnet")
    with pytest.raises(ValueError, match="wan"):
        hx.VideoClipDataset(kmix / "manifest.jsonl", model="videomae", size=(32, 32))


@pytest.mark.parametrize("model", ["videomae", "qwen2-vl", "wan"])
def test_estimate_cost_matches_the_decoded_sample(kmix, model):
    with_table = hx.VideoClipDataset(kmix / "manifest.jsonl", model=model)
    no_table = hx.VideoClipDataset(kmix / "manifest.jsonl", model=model, profiles=False)
    assert with_table.table is not None and no_table.table is None
    for i in range(len(with_table)):
        a, b = with_table.estimate_cost(i), no_table.estimate_cost(i)
        assert (a.tokens, a.out_bytes, a.profile, a.io_bytes) == (b.tokens, b.out_bytes, b.profile, b.io_bytes)
        s = with_table[i]
        assert s["tokens"] == a.tokens and s["video"].numel() == a.out_bytes
        assert a.profile == "x".join(str(v) for v in (s["video"].shape[0], *s["video"].shape[2:]))
        assert a.cpu_s > 0 and b.cpu_s > 0


def test_estimate_cost_never_decodes(kmix, monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("estimate_cost decoded a clip")

    monkeypatch.setattr(hx_datasets, "decode_frames", tripwire)
    for profiles in (None, False):
        ds = hx.VideoClipDataset(kmix / "manifest.jsonl", profiles=profiles)
        assert [ds.estimate_cost(i).tokens > 0 for i in range(len(ds))] == [True] * len(ds)
    with pytest.raises(AssertionError, match="decoded"):
        ds[0]


def test_random_transforms_are_keyed_by_seed_epoch_index(kmix):
    def make():
        return hx.VideoClipDataset(kmix / "manifest.jsonl", num_frames=4, size=32, seed=3, random_flip=0.5)

    a, b = make(), make()
    for epoch in range(6):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert torch.equal(a[0]["video"], b[0]["video"])  # the same whichever instance decodes it
    plain = hx.VideoClipDataset(kmix / "manifest.jsonl", num_frames=4, size=32)[0]["video"]
    seen = set()
    for epoch in range(8):
        a.set_epoch(epoch)
        v = a[0]["video"]
        seen.add("flip" if torch.equal(v, plain.flip(-1)) else "same" if torch.equal(v, plain) else "?")
    assert seen == {"flip", "same"}


def test_video_text_dataset_and_pad_collate(kmix):
    ds = hx.VideoTextDataset(kmix / "manifest.jsonl", model="videomae", max_text_len=16)
    items = [ds[0], ds[1]]
    assert items[0]["caption"] and items[0]["input_ids"].dtype == torch.int64
    assert len(items[0]["input_ids"]) <= 16 and items[0]["input_ids"][0] == 1
    b = hx.pad_collate(items)
    assert b["video"].shape == (2, 32, 3, 84, 84)
    assert b["video_lengths"].tolist() == [16, 32] and b["video_sizes"].tolist() == [[56, 56], [84, 84]]
    assert b["video_mask"].sum(1).tolist() == [16, 32]
    assert torch.equal(b["video"][0, :16, :, :56, :56], items[0]["video"]) and b["video"][0, 16:].abs().sum() == 0
    assert b["attention_mask"].sum(1).tolist() == [len(items[0]["input_ids"]), len(items[1]["input_ids"])]
    assert b["caption"] == [items[0]["caption"], items[1]["caption"]]


def test_sample_generator_is_deterministic():
    a = torch.rand(3, generator=hx.sample_generator(1, 2, 3))
    assert torch.equal(a, torch.rand(3, generator=hx.sample_generator(1, 2, 3)))
    assert not torch.equal(a, torch.rand(3, generator=hx.sample_generator(1, 3, 3)))


def test_cost_arrays_are_vectorised(kmix):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl")
    arr = ds.cost_arrays()
    assert arr["tokens"].shape == (6,) and np.all(arr["cpu_s"] > 0)
    assert arr["tokens"].tolist() == [ds.estimate_cost(i).tokens for i in range(6)]
