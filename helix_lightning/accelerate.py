"""``HelixAcceleratePlugin``: Helix in an ``accelerate launch`` training script.

Accelerate has no third-party plugin hook (``prepare`` passes unknown objects through and
``kwargs_handlers`` takes only its own classes), so the plugin prepares the loader itself::

    plugin = HelixAcceleratePlugin(balance="tokens")
    loader = plugin.prepare(accelerator, dataset, batch_size=2)
    for epoch in range(loader.start_epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            with plugin.step(), accelerator.accumulate(model):
                ...
        plugin.log(step)

Ranks come from the accelerator, the sample order is ``DistributedSampler(seed)`` per process
index (as under Lightning, not Accelerate's round-robin batch sharding), batches land on
``accelerator.device``, ``accelerator.save_state`` / ``load_state`` carry the loader's position,
and ``accelerator.gradient_state.end_of_dataloader`` is true on an epoch's last batch.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Mapping

import torch

from helix_lightning.callbacks import METRICS, _Window
from helix_lightning.data import DatasetConfig, build_loader, check_loader_options, dataset_length_error

__all__ = ["HelixAcceleratePlugin", "HelixAcceleratedLoader"]


class HelixAcceleratedLoader:
    """A prepared loader: iterates the Helix loader and keeps Accelerate's gradient state
    (``end_of_dataloader``) as a prepared DataLoader does. Everything else is the loader's
    (``len``, ``set_epoch``, ``epoch``, ``sampler``, ``state_dict``, ``stats``, ...). ``remainder``
    stays -1: ``DistributedSampler``'s padding of the last step is not undone by
    ``gather_for_metrics`` (as with any loader Accelerate did not shard itself)."""

    def __init__(self, loader, gradient_state, training: bool = True):
        self.loader, self.gradient_state, self.training = loader, gradient_state, training
        self.end_of_dataloader, self.remainder = False, -1
        self.input_waits: list[float] = []  # seconds blocked in next(), whichever loader it is

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):  # only called for what this class lacks
        if name in ("loader", "gradient_state"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def set_epoch(self, epoch: int) -> None:  # the torch baseline's epoch lives in its sampler
        (self.loader if hasattr(self.loader, "set_epoch") else self.loader.sampler).set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return getattr(self.loader, "epoch", getattr(self.loader.sampler, "epoch", 0))

    @property
    def start_epoch(self) -> int:
        """The epoch a training loop starts (or resumes) at: the loaded state's epoch, or the next
        one when that state was saved at the end of its epoch."""
        if not hasattr(self.loader, "state_dict"):
            return self.epoch
        state = self.loader.state_dict()
        return state["epoch"] + (state["batches_yielded"] >= len(self.loader))

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def __iter__(self):
        self.end_of_dataloader, self.remainder = False, -1
        it = iter(self.loader)
        self.gradient_state._add_dataloader(self)
        stateful = hasattr(self.loader, "state_dict")
        try:
            n = 0
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self.input_waits.append(time.perf_counter() - t0)
                n += 1
                position = self.loader.state_dict()["batches_yielded"] if stateful else n
                self.end_of_dataloader = position >= len(self.loader)
                yield batch
                if self.end_of_dataloader:  # an epoch ends after len batches, as a prepared DataLoader's
                    return
        finally:
            self.gradient_state._remove_dataloader(self)


class HelixAcceleratePlugin:
    """Prepare Helix loaders for an ``Accelerator``. ``loader_options`` are
    ``DistributedDataLoader``'s (``scheduler``, ``balance``, ``window``, ``prefetch_depth``,
    ``on_error``, ...); ``coordinator`` names a running cluster (default: embedded); ``loader="torch"``
    gives the plain torch ``DataLoader`` baseline instead."""

    def __init__(
        self, *, coordinator: str | None = None, loader: str = "helix", device_placement: bool = True, **loader_options
    ):
        self.options = check_loader_options(loader_options)
        self.coordinator, self.loader_kind, self.device_placement = coordinator, loader, device_placement
        self.accelerator = None
        self.loaders: list = []
        self._window: _Window | None = None

    def prepare(self, accelerator, dataset, batch_size: int, *, validation: bool = False):
        """This process's loader of ``dataset`` (a torch ``Dataset`` or a mapping naming one, see
        ``helix_lightning.data.DatasetConfig``), registered for ``save_state`` / ``load_state``.
        ``validation=True``: no shuffle, no balancing, not checkpointed."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and accelerator.num_processes == 1:
            raise RuntimeError(
                f"the launcher started {world} processes (WORLD_SIZE={world}) but the Accelerator sees 1: every "
                "process would train on the same samples. On a machine without a GPU build "
                "Accelerator(cpu=True) (e.g. Accelerator(cpu=not torch.cuda.is_available()))."
            )
        self.accelerator = accelerator
        options = dict(self.options)
        if isinstance(dataset, Mapping):
            config = DatasetConfig(dataset, "dataset")
            with accelerator.main_process_first():  # the first synthesizes a named workload, the others reuse it
                if accelerator.is_local_main_process:
                    config.prepare()
            dataset = config.build()
            from helix_core import pad_collate

            options.setdefault("collate_fn", pad_collate)
        lengths = accelerator.gather(torch.tensor([len(dataset)], device=accelerator.device))
        error = dataset_length_error([int(n) for n in lengths.flatten().tolist()])
        if error:
            raise ValueError(error)
        if validation:
            options.update(shuffle=False)
            options.pop("balance", None)
        if self.device_placement and self.loader_kind == "helix" and accelerator.device.type != "cpu":
            options.setdefault("device", accelerator.device)
        raw = build_loader(
            self.loader_kind,
            dataset,
            batch_size,
            accelerator.process_index,
            accelerator.num_processes,
            coordinator=self.coordinator,
            options=options,
        )
        loader = HelixAcceleratedLoader(raw, accelerator.gradient_state, training=not validation)
        if not validation and hasattr(raw, "state_dict"):  # the torch baseline has no position to keep
            accelerator.register_for_checkpointing(loader)
        self.loaders.append(loader)
        return loader

    @contextlib.contextmanager
    def step(self):
        """Time the training step inside (the rank's GPU window: CUDA events on a GPU, read once
        done) and report it to the loaders as the deadline of the next batch."""
        if self._window is None:
            device = self.accelerator.device if self.accelerator is not None else torch.device("cpu")
            self._window = _Window(device.type == "cuda")
        self._window.start()
        try:
            yield
        finally:
            for seconds in self._window.stop():
                for loader in self.loaders:
                    if loader.training and hasattr(loader.loader, "report_step_time"):  # not the torch baseline
                        loader.report_step_time(seconds)

    def stats(self) -> dict:
        """The training loader's ``helix/...`` metrics on this process."""
        if not self.loaders:
            return {}
        loader = self.loaders[0]
        stats = loader.stats() if hasattr(loader.loader, "stats") else {}
        out = {name: float(stats.get(key, math.nan)) for name, (key, _) in METRICS.items()}
        waits = loader.input_waits
        out["helix/input_wait_total_s"] = float(sum(waits))
        if waits:  # measured the same way for the torch baseline
            out["helix/input_wait_s"] = float(waits[-1])
        return out

    def log(self, step: int | None = None) -> dict:
        """Reduce the metrics over processes (max wait, mean miss rate, max p95) and pass them to
        ``accelerator.log``. Call it on every process (it is a collective)."""
        acc = self.accelerator
        if acc is None or not self.loaders:
            return {}
        mine = self.stats()
        names = list(METRICS)
        values = torch.tensor([0.0 if math.isnan(mine[k]) else mine[k] for k in names], device=acc.device)
        gathered = acc.gather(values[None]).reshape(-1, len(names))
        out = {}
        for j, name in enumerate(names):
            column = gathered[:, j]
            out[name] = float(column.max() if METRICS[name][1] == "max" else column.mean())
        acc.log(out, step=step)
        return out
