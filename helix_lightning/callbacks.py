"""``HelixDeadlineCallback``: the trainer's measured step time becomes the loader's deadline.

A rank's GPU window (``on_train_batch_start`` → ``on_train_batch_end``) is the deadline of its
next batch. On a GPU the window is timed with CUDA events read once they completed (no
synchronisation is added to the step); on a CPU with the wall clock.
"""

from __future__ import annotations

import math
import time
from collections import deque

import lightning.pytorch as pl
import torch

__all__ = ["HelixDeadlineCallback", "helix_loaders"]

#: logged metric -> (loader statistic, how ranks are reduced)
METRICS = {
    "helix/input_wait_s": ("input_wait_last_s", "max"),
    "helix/ddl_miss_rate": ("ddl_miss_rate", "mean"),
    "helix/batch_ready_p95_s": ("batch_ready_p95_s", "max"),
}


def helix_loaders(obj) -> list:
    """The loaders in ``obj`` (a loader, or lists / dicts of them) that take step times."""
    if hasattr(obj, "report_step_time"):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in helix_loaders(item)]
    return []


class _Window:
    """One rank's step timer: CUDA events on a GPU (read when done), else ``perf_counter``."""

    def __init__(self, cuda: bool):
        self.cuda, self.t0, self.pending = cuda, None, deque()

    def start(self) -> None:
        if self.cuda:
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> list[float]:
        """Seconds of the windows that are complete now (a GPU window may finish later)."""
        if self.t0 is None:
            return []
        if not self.cuda:
            seconds, self.t0 = time.perf_counter() - self.t0, None
            return [seconds]
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((self.t0, end))
        self.t0 = None
        done = []
        while self.pending and self.pending[0][1].query():
            start, stop = self.pending.popleft()
            done.append(start.elapsed_time(stop) / 1000.0)
        return done


class HelixDeadlineCallback(pl.Callback):
    """Report each training step's compute window to the Helix loaders
    (``loader.report_step_time``) and log ``helix/input_wait_s``, ``helix/ddl_miss_rate`` and
    ``helix/batch_ready_p95_s`` (reduced over ranks: max, mean, max) every ``log_every_n_steps``
    steps (default: the trainer's) to the loggers and the progress bar."""

    def __init__(self, log_every_n_steps: int | None = None, prog_bar: bool = True):
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r}: must be >= 1 (or None: the trainer's)")
        self.log_every_n_steps, self.prog_bar = log_every_n_steps, prog_bar
        self._window: _Window | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        check = getattr(trainer.datamodule, "check_restored", None)
        if callable(check):
            check()
        self._window = _Window(pl_module.device.type == "cuda")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._window is not None:
            self._window.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._window is None:
            return
        loaders = helix_loaders(trainer.train_dataloader)
        for seconds in self._window.stop():
            for loader in loaders:
                loader.report_step_time(seconds)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if not loaders or not every or batch_idx % every:  # the same on every rank: reductions stay matched
            return
        stats = loaders[0].stats()
        for name, (key, reduce) in METRICS.items():
            value = stats.get(key, math.nan)
            pl_module.log(
                name,
                0.0 if value is None or math.isnan(value) else float(value),
                on_step=True,
                on_epoch=False,
                sync_dist=True,
                reduce_fx=reduce,
                prog_bar=self.prog_bar,
                batch_size=1,
            )
