"""One rank of a multi-node job (tests/launch/test_multinode.py), launched by torchrun on an emulated host
with no coordinator given: ``lightning`` fits a tiny model on a ``HelixDataModule``; ``accelerate``
trains with ``HelixAcceleratePlugin``. Each rank writes ``OUT/rank<r>.json``: the indices of every
batch it trained on, the Coordinator its loader used, whether it started a part of the cluster,
and its host. Usage: python multinode_app.py lightning|accelerate OUT N BATCH"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from helix_core.security.hostid import host_id
from helix_core.testing.datasets import IndexDataset


def _record(out: Path, rank: int, seen: list, loader) -> None:
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "seen": seen,
                "coordinator": loader.coordinator,
                "owner": loader.cluster is not None,
                "host": host_id(),
                "world_size": loader.world_size,
                "resubmits": loader.stats()["resubmits"],
            }
        )
    )


def lightning(out: Path, n: int, batch: int) -> None:
    import lightning.pytorch as pl

    from helix_lightning import HelixDataModule

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer, self.seen = torch.nn.Linear(4, 1), []

        def training_step(self, b, i):
            self.seen.append(b["index"].tolist())
            return self.layer(b["x"].float() / 255.0).pow(2).mean()

        def on_train_end(self):
            _record(out, self.global_rank, self.seen, self.trainer.datamodule.train_loader)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    dm = HelixDataModule(IndexDataset(n), batch, shuffle=True, seed=7, num_workers=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(Model(), datamodule=dm)


def accelerate(out: Path, n: int, batch: int) -> None:
    from accelerate import Accelerator

    from helix_lightning import HelixAcceleratePlugin

    acc = Accelerator(cpu=True)
    plugin = HelixAcceleratePlugin(shuffle=True, seed=7, num_workers=2)
    loader = plugin.prepare(acc, IndexDataset(n), batch)
    model = acc.prepare(torch.nn.Linear(4, 1))
    seen = []
    for b in loader:
        seen.append(b["index"].tolist())
        acc.backward(model(b["x"].float() / 255.0).pow(2).mean())
    _record(out, acc.process_index, seen, loader)
    acc.wait_for_everyone()  # rank 0's process (the Coordinator's owner) outlives the others' use of it


if __name__ == "__main__":
    mode, out, n, batch = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    {"lightning": lightning, "accelerate": accelerate}[mode](out, n, batch)
