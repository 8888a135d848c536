"""recipes.models: each family's loss on real decoded batches, and its bad-input errors."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import helix_core as hx
from recipes.models import build_model
from recipes.specs import FAMILIES, dataset_kind, default_collate_for

# case -> (family, workload fixture, dataset kwargs, model config); sizes fit the tiny defaults
CASES = {
    "qwen2-vl": ("qwen2-vl", "kinetics", {"num_frames": 2}, {}),
    "videomae": ("videomae", "kinetics", {"num_frames": 4, "size": 64}, {}),
    "videomae-classification": ("videomae", "kinetics", {"num_frames": 4, "size": 64}, {"task": "classification"}),
    "wan": ("wan", "openvid", {"num_frames": 5, "size": (32, 32)}, {}),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread (and don't spin against other work on the machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def kinetics(tmp_path_factory):
    """Four kinetics-mixed clips with captions and labels (qwen: 252x448 frames)."""
    return hx.synth.make_dataset(tmp_path_factory.mktemp("recipes-k"), "kinetics-mixed", 4, seed=0, scale=0.25)


def _needs(family: str):
    pytest.importorskip("diffusers" if family == "wan" else "transformers")


def _dataset(root, family: str, **kwargs):
    cls = hx.VideoTextDataset if dataset_kind(family) == "video-text" else hx.VideoClipDataset
    return cls(root / "manifest.jsonl", model=family, **kwargs)


def _case(request, name: str, seed: int = 0):
    """(model, batch of samples 0 and 1) for a CASES entry."""
    family, workload, ds_kwargs, config = CASES[name]
    _needs(family)
    ds = _dataset(request.getfixturevalue(workload), family, **ds_kwargs)
    torch.manual_seed(seed)
    return build_model(family, **config), default_collate_for(family)([ds[0], ds[1]])


def _seeded_loss(model, batch, seed: int = 1) -> torch.Tensor:
    """The loss with the family's random draws (mask, noise, time) fixed, so two calls compare."""
    torch.manual_seed(seed)
    return model(batch)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_is_finite_and_gradients_reach_every_trainable_parameter(request, name):
    model, batch = _case(request, name)
    loss = model(batch)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable
    no_grad = [n for n, p in trainable.items() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not no_grad, f"{name}: no finite gradient for {no_grad[:5]}"
    assert any(float(p.grad.abs().sum()) > 0 for p in trainable.values())


@pytest.mark.parametrize("name", list(CASES))
def test_a_few_optimizer_steps_on_a_repeated_batch_lower_the_loss(request, name):
    model, batch = _case(request, name)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(3):
        loss = _seeded_loss(model, batch)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert _seeded_loss(model, batch).item() < first


def test_dataset_kind_and_collate_per_family():
    assert FAMILIES == ("qwen2-vl", "videomae", "wan")
    assert [dataset_kind(f) for f in FAMILIES] == ["video-text", "video", "video-text"]
    assert all(default_collate_for(f) is hx.pad_collate for f in FAMILIES)
    with pytest.raises(ValueError, match="model.family='llava'"):
        dataset_kind("llava")


# ---- qwen2-vl -------------------------------------------------------------------------------------
def test_qwen_patchify_matches_the_video_processor_layout():
    """Rows are Qwen2-VL's: CLIP-normalised (c, temporal, py, px) patches, in 2x2 merge-window
    order; an odd frame count repeats the last frame."""
    _needs("qwen2-vl")
    model = build_model("qwen2-vl")
    video = torch.randint(0, 256, (3, 3, 56, 84), dtype=torch.uint8)
    rows, grid = model.patchify(video)
    assert grid == (2, 4, 6) and rows.shape == (2 * 4 * 6, 3 * 2 * 14 * 14)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    x = (torch.cat([video, video[-1:]]).float() / 255 - mean) / std
    expected = [
        x[2 * t : 2 * t + 2, :, 14 * y : 14 * y + 14, 14 * z : 14 * z + 14].permute(1, 0, 2, 3).flatten()
        for t in range(2)
        for by in range(2)
        for bz in range(3)
        for y in (2 * by, 2 * by + 1)
        for z in (2 * bz, 2 * bz + 1)
    ]
    torch.testing.assert_close(rows, torch.stack(expected))


def test_qwen_inputs_place_video_tokens_and_label_only_the_caption(request):
    model, batch = _case(request, "qwen2-vl")
    cfg = model.net.config
    inputs = model.inputs(batch)
    n = 1 * (18 * 32) // 4  # a 2 x 252 x 448 clip: grid (1, 18, 32), 2x2 merge
    assert inputs["video_grid_thw"].tolist() == [[1, 18, 32]] * 2
    assert inputs["pixel_values_videos"].shape == (2 * 576, 1176)
    for i in range(2):
        cap = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        ids = inputs["input_ids"][i]
        assert ids[0] == cfg.vision_start_token_id and ids[n + 1] == cfg.vision_end_token_id
        assert (ids[1 : n + 1] == cfg.video_token_id).all()
        assert (inputs["mm_token_type_ids"][i] == 2).sum() == n and (
            inputs["mm_token_type_ids"][i][1 : n + 1] == 2
        ).all()
        assert inputs["labels"][i][inputs["labels"][i] != -100].tolist() == cap.tolist()
        assert inputs["attention_mask"][i].sum() == n + 2 + len(cap)


def test_qwen_mixes_clips_of_different_geometry_in_one_batch(openvid):
    """A portrait 2-frame clip and a landscape 3-frame clip in one padded batch: the batch loss is
    the caption-token-weighted mean of each clip's loss alone (padding changes nothing)."""
    _needs("qwen2-vl")
    a = _dataset(openvid, "qwen2-vl", num_frames=2)[0]
    b = _dataset(openvid, "qwen2-vl", num_frames=3)[1]
    assert a["video"].shape[0] != b["video"].shape[0] and a["video"].shape[2:] != b["video"].shape[2:]
    torch.manual_seed(0)
    model = build_model("qwen2-vl")
    batch = hx.pad_collate([a, b])
    assert batch["video_grid_thw"].tolist() == [[1, 32, 18], [2, 20, 28]]
    loss = model(batch)
    loss.backward()
    with torch.no_grad():
        alone = [model(hx.pad_collate([s])).item() for s in (a, b)]
    n = [len(s["input_ids"]) for s in (a, b)]
    assert loss.item() == pytest.approx((n[0] * alone[0] + n[1] * alone[1]) / sum(n), rel=1e-4)


def test_qwen_rejects_caption_ids_outside_its_vocabulary(request):
    model, batch = _case(request, "qwen2-vl")
    batch["input_ids"][0, 1] = model.net.config.video_token_id
    with pytest.raises(ValueError, match="caption ids"):
        model(batch)


@pytest.mark.parametrize("name", ["qwen2-vl", "wan"])
def test_caption_families_reject_batches_without_captions(request, name):
    model, batch = _case(request, name)
    with pytest.raises(ValueError, match="no captions"):
        model({k: v for k, v in batch.items() if k != "input_ids"})


# ---- videomae --------------------------------------------------------------------------------------
def test_videomae_tube_mask_repeats_one_spatial_mask_over_time():
    _needs("videomae")
    model = build_model("videomae", mask_ratio=0.75)  # 64 px / 16 -> 16 patches, 2 tubelets
    mask = model.tube_mask(3).view(3, 2, 16)
    assert (mask[:, 0] == mask[:, 1]).all()
    assert mask[:, 0].sum(dim=1).tolist() == [12, 12, 12]


def test_videomae_rejects_batches_that_do_not_match_its_config(request):
    model, batch = _case(request, "videomae")
    with pytest.raises(ValueError, match="the batch has 2 frames of 64x64 but the model takes 4"):
        model({"video": batch["video"][:, :2]})
    padded = dict(batch, video_lengths=torch.tensor([4, 3]))
    with pytest.raises(ValueError, match="same frames and size"):
        model(padded)
    classifier = build_model("videomae", task="classification")
    with pytest.raises(ValueError, match=r"labels in \[0, 400\)"):
        classifier(dict(batch, label=torch.tensor([3, -1])))


# ---- wan -------------------------------------------------------------------------------------------
def test_wan_vae_stays_frozen_while_the_transformer_trains(request):
    model, batch = _case(request, "wan")
    vae_before = {k: v.clone() for k, v in model.vae.state_dict().items()}
    tr_before = [p.detach().clone() for p in model.transformer.parameters()]
    model.train()
    assert model.transformer.training and not model.vae.training
    assert not any(p.requires_grad for p in model.vae.parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(batch).backward()
    assert all(p.grad is None for p in model.vae.parameters())
    opt.step()
    assert all(torch.equal(v, model.vae.state_dict()[k]) for k, v in vae_before.items())
    assert any(not torch.equal(a, b) for a, b in zip(tr_before, model.transformer.parameters()))


def test_wan_latents_and_logit_normal_times(request):
    model, batch = _case(request, "wan")
    assert model.latents(batch["video"]).shape == (2, 4, 2, 4, 4)  # 5 x 32 x 32 -> 1 + 4/4 frames, /8
    logit = build_model("wan", timestep_sampling="logit-normal")
    assert math.isfinite(logit(batch).item())


def test_wan_rejects_frames_that_are_not_4k_plus_1(request):
    model, batch = _case(request, "wan")
    with pytest.raises(ValueError, match="4k\\+1"):
        model(dict(batch, video=batch["video"][:, :4], video_lengths=None))


# ---- construction errors (checked before transformers / diffusers are imported) -------------------
@pytest.fixture
def no_model_libraries(monkeypatch):
    """Make importing transformers or diffusers fail, so a check that ran late would show."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("transformers", "diffusers")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "diffusers", None)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda tmp: build_model("llava"), ValueError, r"model.family='llava'.*valid: qwen2-vl, videomae, wan"),
        (
            lambda tmp: build_model("wan", hidden=3),
            ValueError,
            r"model.hidden: unknown.*valid keys: num_layers, num_heads",
        ),
        (lambda tmp: build_model("videomae", pretrained=tmp / "nope"), FileNotFoundError, r"model.pretrained=.*nope"),
        (
            lambda tmp: build_model("qwen2-vl", pretrained=tmp, hidden_size=8),
            ValueError,
            r"model.hidden_size: the pretrained",
        ),
        (lambda tmp: build_model("videomae", mask_ratio=1.0), ValueError, r"model.mask_ratio=1.0 masks 16 of 16"),
        (lambda tmp: build_model("videomae", task="detection"), ValueError, r"model.task='detection'; valid"),
        (lambda tmp: build_model("qwen2-vl", num_heads=0), ValueError, r"model.num_heads must be a positive int"),
        (lambda tmp: build_model("wan", timestep_sampling="beta"), ValueError, r"model.timestep_sampling='beta'"),
    ],
    ids=["family", "key", "pretrained-missing", "pretrained-arch-key", "mask-ratio", "task", "size", "sampling"],
)
def test_bad_arguments_fail_before_building(tmp_path, no_model_libraries, call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(tmp_path)


@pytest.mark.parametrize("name", ["videomae", "wan"])
def test_a_local_pretrained_folder_loads_the_same_model(request, tmp_path, name):
    model, batch = _case(request, name)
    family = CASES[name][0]
    if family == "wan":
        model.transformer.save_pretrained(tmp_path / "transformer")
        model.vae.save_pretrained(tmp_path / "vae")
        loaded = build_model(family, pretrained=tmp_path)
        loaded.text_embed.load_state_dict(model.text_embed.state_dict())  # the caption embedding is new
    else:
        model.net.save_pretrained(tmp_path)
        loaded = build_model(family, pretrained=tmp_path)
    with torch.no_grad():
        assert _seeded_loss(loaded, batch).item() == pytest.approx(_seeded_loss(model, batch).item(), rel=1e-5)
