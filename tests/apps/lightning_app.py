"""A 2-process Lightning DDP fit on a Helix data module (run by tests/integrations/test_lightning.py).

Each rank writes ``OUT/rank<r>.json``: the sample indices of every batch it trained on, with the
epoch, plus the deadlines its loader sent. ``--crash-at N`` raises on every rank after global step
N (after the checkpoint of that step); ``--resume CKPT`` continues from a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from helix_lightning import HelixDataModule, HelixDeadlineCallback


class Recorder(pl.LightningModule):
    def __init__(
        self, out: str, crash_at: int | None, stepping_batches: bool = False, gpu_s: float = 0.0, after_s: float = 0.0
    ):
        super().__init__()
        self.out, self.crash_at, self.stepping_batches = Path(out), crash_at, stepping_batches
        self.gpu_s, self.after_s = gpu_s, after_s  # emulated compute inside the step; other work after it
        self.layer = torch.nn.Linear(3, 1)
        self.seen: list = []
        self.reported: list = []  # the step times the callback gave the loader

    def on_train_start(self):
        loader = self.trainer.datamodule.train_loader
        report = loader.report_step_time

        def recording(seconds):
            self.reported.append(seconds)
            report(seconds)

        loader.report_step_time = recording

    def training_step(self, batch, batch_idx):
        self.seen.append({"epoch": self.current_epoch, "indices": batch["index"].tolist()})
        x = batch["video"].float().mean(dim=(1, 3, 4)) / 255.0  # [B, 3]
        time.sleep(self.gpu_s)
        return self.layer(x).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        time.sleep(self.after_s)  # outside the callback's window (callbacks' hooks run first)
        self._dump()
        if self.crash_at is not None and self.global_step >= self.crash_at:
            raise RuntimeError(f"simulated crash after step {self.global_step}")

    def on_train_end(self):
        self._dump()

    def _dump(self):
        loader = self.trainer.datamodule.train_loader
        stats = loader.stats() if hasattr(loader, "stats") else {}
        path = self.out / f"rank{self.global_rank}.json"
        decisions = loader.client.telemetry(last_decisions=64)["decisions"] if hasattr(loader, "client") else []
        path.write_text(
            json.dumps(
                {
                    "seen": self.seen,
                    "world_size": self.trainer.world_size,
                    "reported": self.reported,
                    "deadlines": [d["deadline_s"] for d in decisions if d["rank"] == self.global_rank],
                    "deadline_p50_s": stats.get("deadline_p50_s"),
                    "window_s_per_unit": stats.get("window_s_per_unit"),
                }
            )
        )

    def configure_optimizers(self):
        if self.stepping_batches:
            _ = self.trainer.estimated_stepping_batches  # lightning#20550: skips restoring loader state
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--balance", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--stepping-batches", action="store_true")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--gpu-s", type=float, default=0.0)
    p.add_argument("--after-s", type=float, default=0.0)
    p.add_argument("--uneven", action="store_true")
    a = p.parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    dataset = {"manifest": a.manifest, "model": "videomae", "num_frames": 4, "size": 32}
    if a.uneven:  # a dataset whose length differs on each rank
        from helix_core.testing.datasets import IndexDataset

        dataset = IndexDataset(6 + int(os.environ.get("LOCAL_RANK", 0)))
    dm = HelixDataModule(dataset, a.batch_size, shuffle=True, seed=7, balance=a.balance, window=2, num_workers=2)
    callbacks = [HelixDeadlineCallback(log_every_n_steps=1)]
    if a.ckpt_every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=os.path.join(a.out, "ckpt"), every_n_train_steps=a.ckpt_every, save_top_k=-1, filename="{step}"
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=a.devices,
        strategy="ddp" if a.devices > 1 else "auto",
        max_epochs=a.epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    model = Recorder(a.out, a.crash_at, a.stepping_batches, a.gpu_s, a.after_s)
    trainer.fit(model, datamodule=dm, ckpt_path=a.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
