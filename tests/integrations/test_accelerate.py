"""Accelerate integration: a real 2-process ``accelerate launch`` (gloo on CPU) of the recipe that
crashes after a checkpoint mid-epoch and resumes exactly on every rank; the plugin's gradient
state, checkpointing and launcher trap in one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import helix_core as hx
from helix_lightning import HelixAcceleratePlugin

ROOT = Path(__file__).resolve().parents[2]
DATASET = {"model": "videomae", "num_frames": 4, "size": 64}


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    acc = Accelerator(cpu=True)
    yield acc
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def launch(tmp: Path, config: Path, out: Path, *args: str, ok: bool = True) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HELIX_CACHE": str(tmp / "cache")}
    env.pop("HELIX_COORDINATOR", None)
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ROOT / "recipes" / "train_accelerate.py"),
        "--config",
        str(config),
        "--output-dir",
        str(out),
        "--trace",
        *args,
    ]
    # a session of its own: a timeout kills the launcher and its ranks (an orphaned rank would keep its cluster)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("accelerate launch did not finish within 280 s:\n" + stdout[-3000:] + stderr[-4000:])
    assert (proc.returncode == 0) == ok, stdout[-3000:] + stderr[-4000:]
    return stdout + stderr


@pytest.mark.slow
def test_accelerate_launch_two_processes_resume_after_a_crash_mid_epoch_exactly(kmix, tmp_path):
    config = tmp_path / "videomae.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "videomae", "config": {"image_size": 64, "num_frames": 4}},
                "data": {
                    "dataset": {"manifest": str(kmix / "manifest.jsonl"), **DATASET},
                    "batch_size": 1,
                    "loader_options": {"shuffle": True, "seed": 7, "num_workers": 2},
                },
                "trainer": {"max_steps": 5, "log_every_n_steps": 2},
            }
        )
    )
    out = tmp_path / "run"
    log = launch(tmp_path, config, out, "--checkpoint-every", "2", "--fail-after-step", "2", ok=False)
    assert "simulated crash after step 2" in log
    launch(tmp_path, config, out, "--resume", str(out / "step_2"))
    n = len(hx.Manifest(kmix / "manifest.jsonl"))
    for r in range(2):
        rows = [json.loads(line) for line in (out / f"trace-rank{r}.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]  # two steps, the crash, then three more
        sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=2, rank=r, shuffle=True, seed=7)
        expected = []
        for e in range(2):
            sampler.set_epoch(e)
            expected += [[i] for i in sampler]
        assert [row["indices"] for row in rows] == expected[:5]  # each process index's DistributedSampler order


def test_plugin_prepares_a_loader_that_ends_epochs_like_a_prepared_dataloader(kmix, accelerator, tmp_path):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", **DATASET)
    plugin = HelixAcceleratePlugin(shuffle=True, seed=2, num_workers=1)
    loader = plugin.prepare(accelerator, ds, 2)
    try:
        ends = []
        for _ in loader:
            with plugin.step():
                ends.append(accelerator.gradient_state.end_of_dataloader)
        assert ends == [False] * (len(loader) - 1) + [True]
        assert loader.stats()["step_times_reported"] == len(loader)  # every plugin.step() timed a window
        assert loader.start_epoch == 1  # a state saved at an epoch's end resumes at the next epoch
        assert not accelerator.gradient_state.in_dataloader
        assert 0.0 <= plugin.stats()["helix/ddl_miss_rate"] <= 1.0
        assert set(plugin.log(step=1)) == {"helix/input_wait_s", "helix/ddl_miss_rate", "helix/batch_ready_p95_s"}

        # save_state / load_state carry the loader's position: mid-epoch here
        loader.set_epoch(1)
        it = iter(loader)
        first = next(it)["index"].tolist()
        accelerator.save_state(str(tmp_path / "ckpt"))
        rest = [b["index"].tolist() for b in it]
        loader.load_state_dict({**loader.state_dict(), "epoch": 0, "batches_yielded": 0})
        accelerator.load_state(str(tmp_path / "ckpt"))
        assert loader.epoch == 1 and first
        loader.set_epoch(1)  # the recipe's loop does this; the position stays
        assert [b["index"].tolist() for b in loader] == rest
    finally:
        loader.close()


def test_plugin_refuses_a_launcher_world_the_accelerator_does_not_see(kmix, accelerator, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun / accelerate launch set; Accelerator() saw 1 process
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", **DATASET)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*Accelerator\(cpu=True\)"):
        HelixAcceleratePlugin().prepare(accelerator, ds, 1)
    with pytest.raises(ValueError, match="unknown loader option 'workers'"):
        HelixAcceleratePlugin(workers=2)


def test_recipe_config_errors_name_the_key_before_any_process_starts(tmp_path):
    from recipes.train_accelerate import load_config

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "videomae", "optim": "sgd"},
                "data": {"dataset": {"workload": "kinetics-mixed"}, "batch_size": 1},
            }
        )
    )
    with pytest.raises(ValueError, match=r"model.optim.*valid: config, family"):
        load_config(str(bad))
    bad.write_text(yaml.safe_dump({"data": {"dataset": {"workload": "ucf101"}, "batch_size": 1}}))
    with pytest.raises(ValueError, match=r"data.dataset.workload.*'ucf101'.*kinetics-mixed"):
        load_config(str(bad))
    bad.write_text(
        yaml.safe_dump({"data": {"dataset": {"manifest": str(tmp_path / "missing.jsonl")}, "batch_size": 1}})
    )
    with pytest.raises(FileNotFoundError, match="data.dataset.manifest"):
        load_config(str(bad))
