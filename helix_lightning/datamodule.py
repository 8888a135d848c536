"""``HelixDataModule``: Helix behind Lightning's ``trainer.fit(model, datamodule=...)``.

Built around how Lightning 2.6 treats a loader that is not a torch ``DataLoader`` (read in its
source): it is passed through as is (no sampler injection); ``iter()`` is called once at set-up and
the iterator thrown away (a Helix iterator starts no work before its first ``next()``); ``len`` is
all-reduced and an epoch ends after ``len`` batches; only ``loader.sampler.set_epoch(e)`` is
called, at each epoch's start; a loader's ``state_dict`` is saved from rank 0 and loaded on every
rank after ``train_dataloader()`` (Helix's is rank-independent).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping

import lightning.pytorch as pl
import torch

import helix_core as hx
from helix_lightning.data import LOADERS, DatasetConfig, build_loader, check_loader_options, dataset_length_error

__all__ = ["HelixDataModule"]


def _resolve_callable(value, key: str):
    """A callable, or its ``"module.name"`` import path (as a YAML config gives it)."""
    if value is None or callable(value):
        return value
    module, _, name = str(value).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"{key}={value!r} is neither a callable nor an importable 'module.name'") from None


class HelixDataModule(pl.LightningDataModule):
    """Train (and validation) batches from a Helix cluster, one ``DistributedDataLoader`` per rank.

    ``dataset`` / ``val_dataset``: a torch ``Dataset``, or a mapping naming one (see
    ``helix_lightning.data.DatasetConfig``: a ``manifest`` or a ``workload`` synthesized into the
    cache in ``prepare_data``). ``synth``: options of that synthesis (``{"workers": N}``).
    ``coordinator``: "host:port" of a running Helix cluster (default: ``HELIX_COORDINATOR``, else
    an embedded cluster that local rank 0 starts). ``loader``: ``"helix"``, or ``"torch"`` for the
    baseline (a torch ``DataLoader`` + ``DistributedSampler`` at the same CPU budget).
    Further keyword arguments are ``DistributedDataLoader``'s (``scheduler``, ``balance``, ``window``,
    ``prefetch_depth``, ``on_error``, ``microbatch_size``, ``shuffle``, ``seed``, ...); a YAML config
    (LightningCLI) gives them as the mapping ``loader_options``.
    Validation never shuffles or balances and always covers the whole validation set.
    A ``HelixDeadlineCallback`` is added to the trainer when it has none.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        *,
        val_dataset=None,
        synth: dict | None = None,
        coordinator: str | None = None,
        loader: str = "helix",
        loader_options: dict | None = None,
        **options,
    ):
        super().__init__()
        if set(options) & set(loader_options or {}):
            raise ValueError(f"loader options given twice: {', '.join(sorted(set(options) & set(loader_options)))}")
        loader_options = {**(loader_options or {}), **options}
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be an int >= 1")
        if dataset is None:
            raise ValueError("dataset is required: a torch Dataset or a mapping naming one (data.dataset in YAML)")
        if loader not in LOADERS:
            raise ValueError(f"loader={loader!r}; valid: {', '.join(LOADERS)}")
        options = check_loader_options(loader_options)
        if "collate_fn" in options:
            options["collate_fn"] = _resolve_callable(options["collate_fn"], "collate_fn")
        self._configs = {}
        for key, ds in (("dataset", dataset), ("val_dataset", val_dataset)):
            if isinstance(ds, Mapping):
                self._configs[key] = DatasetConfig(ds, key)
                options.setdefault("collate_fn", hx.pad_collate)  # clips of a workload differ in shape
            elif ds is not None and not hasattr(ds, "__getitem__"):
                raise TypeError(f"{key} must be a torch Dataset or a mapping naming one, got {type(ds).__name__}")
        self.dataset, self.val_dataset, self.batch_size = dataset, val_dataset, batch_size
        self.synth, self.coordinator, self.loader = dict(synth or {}), coordinator, loader
        self.loader_options = options
        self.train_loader = self.val_loader = None
        self._stash: dict | None = None  # the loader state this module saved, to check Lightning restored it

    # ---- Lightning hooks ---------------------------------------------------------------------------
    def prepare_data(self) -> None:
        for cfg in self._configs.values():  # once per host (local rank 0): synthesize and profile
            cfg.prepare(workers=int(self.synth.get("workers", 1)), progress=bool(self.synth.get("progress", True)))

    def setup(self, stage: str | None = None) -> None:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        if trainer is not None:
            self._add_callback(trainer)
            if trainer.overfit_batches:
                raise ValueError(
                    "HelixDataModule does not support Trainer(overfit_batches=...): it rewrites torch "
                    "DataLoaders; use limit_train_batches and a small dataset instead"
                )
        if stage not in (None, "fit"):
            self._stash = None  # a position loaded for validate/test must not move a later fit
        if self.train_loader is None and stage in (None, "fit"):
            dataset = self._dataset("dataset", self.dataset)
            self._check_lengths(trainer, "dataset", len(dataset))
            self.train_loader = build_loader(
                self.loader,
                dataset,
                self.batch_size,
                rank,
                world,
                coordinator=self.coordinator,
                options=self.loader_options,
            )
        if self.val_loader is None and self.val_dataset is not None and stage in (None, "fit", "validate"):
            dataset = self._dataset("val_dataset", self.val_dataset)
            self._check_lengths(trainer, "val_dataset", len(dataset))
            val = {**self.loader_options, "shuffle": False, "balance": None, "drop_last": False}
            if self.loader == "torch":
                val.pop("balance")
            self.val_loader = build_loader(
                self.loader, dataset, self.batch_size, rank, world, coordinator=self.coordinator, options=val
            )

    def train_dataloader(self):
        if self.train_loader is None:
            raise RuntimeError("HelixDataModule.train_dataloader() before setup('fit')")
        return self.train_loader

    def val_dataloader(self):
        return self.val_loader if self.val_loader is not None else []

    def teardown(self, stage: str | None = None) -> None:
        for name in ("train_loader", "val_loader"):
            loader = getattr(self, name)
            if loader is not None and hasattr(loader, "close"):
                loader.close()
            setattr(self, name, None)

    def state_dict(self) -> dict:
        """The train loader's position, kept here too: when Lightning skips restoring the loader
        (lightning#20550) the callback restores it from this copy, with a warning."""
        if self.train_loader is None or not hasattr(self.train_loader, "state_dict"):
            return {}
        return {"train_loader": self.train_loader.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self._stash = state_dict.get("train_loader")

    # ---- helpers -----------------------------------------------------------------------------------
    def _dataset(self, key: str, value):
        cfg = self._configs.get(key)
        if cfg is None:
            return value
        if self.trainer is None:  # used outside a trainer: nothing ran prepare_data
            cfg.prepare(workers=int(self.synth.get("workers", 1)))
        return cfg.build()

    @staticmethod
    def _check_lengths(trainer, key: str, length: int) -> None:
        """Ranks whose datasets differ in length would wait for each other forever: fail on all."""
        if trainer is None or trainer.world_size <= 1:
            return
        lengths = trainer.strategy.all_gather(torch.tensor([length], device=trainer.strategy.root_device))
        error = dataset_length_error([int(n) for n in lengths.flatten().tolist()], key)
        if error:
            raise ValueError(error)

    @staticmethod
    def _add_callback(trainer) -> None:
        from helix_lightning.callbacks import HelixDeadlineCallback

        if not any(isinstance(c, HelixDeadlineCallback) for c in trainer.callbacks):
            trainer.callbacks.append(HelixDeadlineCallback())

    def check_restored(self) -> None:
        """Called once training starts: if a checkpoint held this module's loader position but
        Lightning did not restore the loader (``estimated_stepping_batches`` inside
        ``configure_optimizers`` makes it skip that: lightning#20550), restore it now and warn."""
        stash, self._stash = self._stash, None
        loader = self.train_loader
        if stash is None or loader is None or not hasattr(loader, "load_state_dict"):
            return
        mine = loader.state_dict()
        if (mine["epoch"], mine["batches_yielded"]) != (stash["epoch"], stash["batches_yielded"]):
            warnings.warn(
                "Lightning did not restore the Helix loader's position from the checkpoint (it skips that "
                "when configure_optimizers calls trainer.estimated_stepping_batches: lightning#20550); "
                f"HelixDataModule restored it from its own copy (epoch {stash['epoch']}, "
                f"batch {stash['batches_yielded']})",
                stacklevel=2,
            )
            loader.load_state_dict(stash)
