"""Train a Qwen2-VL, VideoMAE or Wan model with Lightning on a Helix data module.

    python recipes/train_lightning.py fit --config configs/videomae_kinetics_mixed.yaml

The YAML has LightningCLI's sections: ``model`` (``VideoTrainingModule``: ``family``,
``pretrained``, ``config``, ``lr``, ...), ``data`` (``HelixDataModule``: ``dataset``, ``batch_size``,
``loader`` — ``helix`` or ``torch`` —, ``loader_options``, ...) and ``trainer``. Every key is
checked before any process starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``recipes`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI

from helix_lightning import HelixDataModule
from recipes.models import build_model
from recipes.specs import check_families

__all__ = ["VideoTrainingModule", "main"]


class VideoTrainingModule(pl.LightningModule):
    """One of ``recipes.models``' families (``family``; tiny and random unless ``pretrained``
    names a local folder; ``config`` overrides its sizes), trained with AdamW."""

    def __init__(
        self,
        family: str = "videomae",
        pretrained: str | None = None,
        config: dict | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.01,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = build_model(family, pretrained=pretrained, **(config or {}))

    def training_step(self, batch, batch_idx):
        loss = self.model(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=int(batch["video"].shape[0]))
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(batch)
        self.log("val/loss", loss, sync_dist=True, batch_size=int(batch["video"].shape[0]))
        return loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class _RecipeCLI(LightningCLI):
    def before_fit(self) -> None:
        dm = self.datamodule
        check_families(self.model.hparams.family, {"dataset": dm.dataset, "val_dataset": dm.val_dataset})


def main(args=None) -> None:
    _RecipeCLI(VideoTrainingModule, HelixDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
