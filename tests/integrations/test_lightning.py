"""Lightning integration: real 2-process DDP fits (gloo, spawned by Lightning) on a Helix data
module with its embedded cluster — the batches every rank trains on, exact resume after a crash
mid-epoch, deadlines from the callback — and the data module's checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helix_core as hx
from helix_lightning import HelixDataModule, HelixDeadlineCallback

APP = Path(__file__).resolve().parents[1] / "apps" / "lightning_app.py"
ROOT = Path(__file__).resolve().parents[2]
DATASET = {"model": "videomae", "num_frames": 4, "size": 32}


def run_app(tmp: Path, name: str, manifest: Path, *args: str, ok: bool = True, ranks: int = 2) -> dict:
    out = tmp / name
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HELIX_COORDINATOR", None)
    proc = subprocess.run(
        [sys.executable, str(APP), "--manifest", str(manifest), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=tmp,
        check=False,
    )
    assert (proc.returncode == 0) == ok, proc.stderr[-4000:]
    found = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)}
    return {"ranks": found, "stderr": proc.stderr, "out": out}


def sampler_batches(n: int, rank: int, epochs: int, batch_size: int = 1, seed: int = 7) -> list[dict]:
    sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=seed)
    out = []
    for e in range(epochs):
        sampler.set_epoch(e)
        idx = list(sampler)
        out += [{"epoch": e, "indices": idx[i : i + batch_size]} for i in range(0, len(idx), batch_size)]
    return out


@pytest.mark.slow
def test_ddp_fit_trains_every_rank_on_the_distributed_sampler_batches_and_deadlines_come_from_the_callback(
    kmix, tmp_path
):
    # the step's compute (inside the callback's window) is short; 1.5 s of other work follows it
    run = run_app(tmp_path, "fit", kmix / "manifest.jsonl", "--gpu-s", "0.05", "--after-s", "1.5")
    n = len(hx.Manifest(kmix / "manifest.jsonl"))
    for r in range(2):
        rank = run["ranks"][r]
        assert rank["seen"] == sampler_batches(n, r, epochs=2)
        assert len(rank["reported"]) == len(rank["seen"])  # one step time per training step
        deadlines = [d for d in rank["deadlines"] if d is not None]
        assert deadlines
        # requests carry deadlines predicted from the reported windows (at most prefetch_depth of them
        # ahead plus the one being computed), not from the 1.5 s longer gaps between next() calls
        bound = 5 * max(rank["reported"]) + 0.05
        assert max(deadlines) <= bound, (deadlines, rank["reported"])


@pytest.mark.slow
def test_ddp_resume_after_a_crash_mid_epoch_continues_exactly_on_every_rank(kmix, tmp_path):
    manifest = kmix / "manifest.jsonl"
    crashed = run_app(
        tmp_path, "crash", manifest, "--balance", "tokens", "--ckpt-every", "2", "--crash-at", "2", ok=False
    )
    assert "simulated crash" in crashed["stderr"]
    resumed = run_app(
        tmp_path, "resume", manifest, "--balance", "tokens", "--resume", str(crashed["out"] / "ckpt" / "step=2.ckpt")
    )
    # what the uninterrupted run yields: the token planner's batches (loaders made here, one per rank)
    ds = hx.VideoClipDataset(manifest, **{k: v for k, v in DATASET.items()})
    for r in range(2):
        with hx.DistributedDataLoader(
            ds,
            1,
            rank=r,
            world_size=2,
            shuffle=True,
            seed=7,
            balance="tokens",
            window=2,
            num_workers=1,
            collate_fn=hx.pad_collate,
        ) as loader:
            expected = []
            for e in range(2):
                loader.set_epoch(e)
                expected += [{"epoch": e, "indices": b["index"].tolist()} for b in loader]
        before = crashed["ranks"][r]["seen"]
        assert before == expected[:2]  # two steps ran; the checkpoint is after the second, mid-epoch
        assert resumed["ranks"][r]["seen"] == expected[2:]  # exactly the rest: nothing lost or repeated


@pytest.mark.slow
def test_a_dataset_whose_length_differs_across_ranks_stops_every_rank_with_an_error(kmix, tmp_path):
    run = run_app(tmp_path, "uneven", kmix / "manifest.jsonl", "--uneven", ok=False, ranks=0)
    assert "different length on each rank (rank 0: 6, rank 1: 7)" in run["stderr"]


def test_lightning_skipping_the_loader_restore_is_detected_and_repaired(kmix):
    dm = HelixDataModule({"manifest": str(kmix / "manifest.jsonl"), **DATASET}, 1, shuffle=True, seed=3, num_workers=1)
    dm.setup("fit")
    try:
        dm.load_state_dict({"train_loader": {**dm.train_loader.state_dict(), "batches_yielded": 2}})
        with pytest.warns(UserWarning, match="lightning#20550"):
            dm.check_restored()  # Lightning never called the loader's load_state_dict
        assert dm.train_loader.state_dict()["batches_yielded"] == 2
        remaining = [b["index"].tolist() for b in dm.train_dataloader()]
        assert len(remaining) == len(dm.train_loader) - 2
    finally:
        dm.teardown()


def test_iter_starts_no_work_and_the_epoch_is_read_at_the_first_next(kmix):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", **DATASET)
    with hx.DistributedDataLoader(ds, 2, shuffle=True, seed=1, num_workers=1) as loader:
        it = iter(loader)  # Lightning makes (and may discard) an iterator before the epoch is set
        assert not loader.running
        loader.sampler.set_epoch(3)  # what Lightning calls at the epoch's start
        got = [b["index"].tolist() for b in it]
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=1)
    sampler.set_epoch(3)
    idx = list(sampler)
    assert got == [idx[i : i + 2] for i in range(0, len(idx), 2)]


def test_data_module_bad_input_names_the_key_and_the_valid_values(kmix, tmp_path):
    manifest = str(kmix / "manifest.jsonl")
    with pytest.raises(ValueError, match=r"model.*'vit'.*videomae"):
        HelixDataModule({"manifest": manifest, "model": "vit"}, 1)
    with pytest.raises(ValueError, match=r"workload.*'kinetics-huge'.*kinetics-mixed"):
        HelixDataModule({"workload": "kinetics-huge"}, 1)
    with pytest.raises(ValueError, match=r"unknown loader option 'prefetch'.*prefetch_depth"):
        HelixDataModule({"manifest": manifest}, 1, prefetch=2)
    with pytest.raises(FileNotFoundError, match="dataset.manifest"):
        HelixDataModule({"manifest": str(tmp_path / "nope.jsonl")}, 1)
    with pytest.raises(ValueError, match=r"unknown key 'frames'"):
        HelixDataModule({"manifest": manifest, "frames": 8}, 1)
    with pytest.raises(ValueError, match="loader='jax'"):
        HelixDataModule({"manifest": manifest}, 1, loader="jax")
    with pytest.raises(ValueError, match="log_every_n_steps"):
        HelixDeadlineCallback(log_every_n_steps=0)


def test_a_named_workload_is_synthesized_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HELIX_CACHE", str(tmp_path / "cache"))
    dm = HelixDataModule({"workload": "kinetics-small", "clips": 2, "scale": 0.2, **DATASET}, 1, num_workers=1)
    dm.prepare_data()
    root = tmp_path / "cache" / "data" / "kinetics-small-2-s0.2-seed0"
    assert (root / "manifest.jsonl").exists() and (root / "profiles.jsonl").exists()
    stamp = (root / "manifest.jsonl").stat().st_mtime_ns
    HelixDataModule({"workload": "kinetics-small", "clips": 2, "scale": 0.2, **DATASET}, 1).prepare_data()
    assert (root / "manifest.jsonl").stat().st_mtime_ns == stamp  # reused, not written again


def test_validation_covers_the_whole_set_every_time_unshuffled_and_unbalanced(kmix):
    spec = {"manifest": str(kmix / "manifest.jsonl"), **DATASET}
    dm = HelixDataModule(spec, 2, val_dataset=spec, shuffle=True, balance="tokens", window=2, num_workers=1)
    dm.setup("fit")
    try:
        val = dm.val_dataloader()
        first = next(iter(val))["index"].tolist()  # a sanity check that stops after one batch
        full = [b["index"].tolist() for b in val]
        assert full[0] == first and full == [[0, 1], [2, 3], [4, 5]]  # in order, all of it, again
        assert [b["index"].tolist() for b in val] == full
    finally:
        dm.teardown()


def test_fit_with_validation_in_one_process_and_epochs_adopt_the_requests_sent_ahead(kmix, tmp_path):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer, self.val_seen, self.runs = torch.nn.Linear(3, 1), [], []

        def training_step(self, batch, batch_idx):
            if batch_idx == 0:  # the dispatch run serving this epoch: one for the whole fit
                self.runs.append(self.trainer.datamodule.train_loader.stats()["dispatch_runs"])
            return self.layer(batch["video"].float().mean(dim=(1, 3, 4))).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.val_seen.append(batch["index"].tolist())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    spec = {"manifest": str(kmix / "manifest.jsonl"), **DATASET}
    dm = HelixDataModule(spec, 2, val_dataset=spec, shuffle=True, seed=1, num_workers=1)
    model = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert model.val_seen == [[0, 1], [2, 3]] + [[0, 1], [2, 3], [4, 5]] * 3  # sanity check, then whole sets
    assert model.runs == [1, 1, 1]  # epochs 1, 2 adopted what epoch 0's run sent ahead: no restart
