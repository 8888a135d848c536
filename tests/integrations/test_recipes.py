"""The recipes run each shipped config for a few steps on CPU (tiny models, small synthesized
clips): Lightning (LightningCLI, one process here; DDP is in test_lightning.py) and Accelerate
(one process here; ``accelerate launch`` is in test_accelerate.py), Helix and the torch baseline."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def small(config: Path, tmp: Path, **data) -> Path:
    """The config on a handful of quarter-scale clips, one process, two steps."""
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["dataset"].update(clips=4, scale=0.25)
    cfg["data"].update(data)
    cfg["data"]["loader_options"]["num_workers"] = 1
    cfg["trainer"].update(devices=1, strategy="auto", max_steps=2, log_every_n_steps=1, enable_progress_bar=False)
    path = tmp / config.name
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HELIX_CACHE", str(tmp_path_factory.getbasetemp() / "recipes-cache"))  # shared: synth once
    monkeypatch.delenv("HELIX_COORDINATOR", raising=False)


def test_the_three_configs_ship():
    assert {c.name for c in CONFIGS} == {
        "qwen2_vl_kinetics_mixed.yaml",
        "videomae_kinetics_mixed.yaml",
        "wan_openvid_mixed.yaml",
    }


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_lightning_recipe_trains_a_few_steps(config, tmp_path):
    from recipes.train_lightning import main

    main(["fit", "--config", str(small(config, tmp_path)), "--trainer.default_root_dir", str(tmp_path)])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_accelerate_recipe_trains_a_few_steps(config, tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    from recipes.train_accelerate import main

    try:
        summary = main(["--config", str(small(config, tmp_path)), "--output-dir", str(tmp_path / "out")])
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert summary["steps"] == 2 and summary["steps_per_s"] > 0


def test_the_torch_baseline_runs_the_same_recipe(tmp_path):
    from recipes.train_lightning import main

    config = small(ROOT / "configs" / "videomae_kinetics_mixed.yaml", tmp_path, loader="torch")
    with pytest.warns(UserWarning, match="ignores Helix's options"):
        main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)])


def test_a_bad_config_fails_before_training_naming_the_key(tmp_path):
    from recipes.train_lightning import main

    cfg = yaml.safe_load((ROOT / "configs" / "videomae_kinetics_mixed.yaml").read_text())
    cfg["model"]["family"] = "llava"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=r"model.family='llava'.*qwen2-vl, videomae, wan"):
        main(["fit", "--config", str(path)])
    cfg["model"]["family"], cfg["model"]["config"] = "wan", {}  # the data is decoded for videomae
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=r"data.dataset.model='videomae' but model.family='wan'"):
        main(["fit", "--config", str(path)])
    cfg["model"].update(family="videomae", config={"task": "pretraining"}, pretrained=str(tmp_path / "no-such-folder"))
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(FileNotFoundError, match="model.pretrained"):
        main(["fit", "--config", str(path)])


def test_the_torch_baseline_runs_the_accelerate_recipe(tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    from recipes.train_accelerate import main

    config = small(ROOT / "configs" / "videomae_kinetics_mixed.yaml", tmp_path, loader="torch")
    try:
        with pytest.warns(UserWarning, match="ignores Helix's options"):
            summary = main(["--config", str(config), "--output-dir", str(tmp_path / "out")])
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert summary["loader"] == "torch" and summary["steps"] == 2 and summary["input_wait_s_per_step"] >= 0


def test_the_loader_comparison_alternates_the_order_and_takes_the_median_of_paired_ratios():
    import sys

    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        from compare_loaders import order, summarise
    finally:
        sys.path.remove(str(ROOT / "recipes"))
    assert [order(r) for r in range(3)] == [("torch", "helix"), ("helix", "torch"), ("torch", "helix")]
    runs = [(10.0, 13.0), (20.0, 18.0), (8.0, 10.0)]  # the machine drifts: each repeat against its own torch
    pairs = [
        {
            "torch": {"steps_per_s": t, "input_wait_s_per_step": 0.01},
            "helix": {"steps_per_s": h, "input_wait_s_per_step": 0.0},
        }
        for t, h in runs
    ]
    row = summarise("wan", pairs)
    assert row["speedups"] == [1.3, 0.9, 1.25] and row["speedup"] == 1.25  # not 13 / 10, the ratio of medians
    assert row["torch_steps_per_s"] == 10.0 and row["helix_steps_per_s"] == 13.0 and row["repeats"] == 3


class NiceOfTheWorker:
    """Each sample is the niceness of the process that loads it."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import os

        return {"index": i, "nice": os.nice(0)}


def test_worker_nice_sets_the_niceness_of_either_loaders_decoding_workers():
    import os

    from dataplane import CFG, helix_children

    from helix_core.testing.datasets import IndexDataset
    from helix_lightning.data import build_loader, check_loader_options

    base = os.nice(0)
    options = check_loader_options({"worker_nice": 3, "num_workers": 1})  # a config may set it
    torch_loader = build_loader("torch", NiceOfTheWorker(), 2, 0, 1, options=options)
    assert [int(n) for b in torch_loader for n in b["nice"]] == [min(19, base + 3)] * 4
    assert [
        int(n) for b in build_loader("torch", NiceOfTheWorker(), 2, 0, 1, options={"num_workers": 1}) for n in b["nice"]
    ] == [base] * 4  # a plain DataLoader's, by default
    with build_loader("helix", IndexDataset(4), 2, 0, 1, options={**options, "config": CFG}) as ld:
        list(ld)
        workers = [w for s in helix_children() for w in s.children() if "resource_tracker" not in " ".join(w.cmdline())]
        assert workers and {w.nice() for w in workers} == {min(19, base + 3)}  # CFG's own is 10
    with pytest.raises(ValueError, match="worker_nice"):
        build_loader("torch", NiceOfTheWorker(), 2, 0, 1, options={"worker_nice": 20})
