"""One pass over a ``DistributedDataLoader``'s epoch (``LoaderIter``) and the sampler-like view
trainers call ``set_epoch`` on (``EpochSampler``). The loader stays the sole owner of the epoch
and the position: an iterator only reports the batches it took."""

from __future__ import annotations

import sys
import time

from helix_core.loader.plan import ShardBatches

__all__ = ["EpochSampler", "LoaderIter"]


class LoaderIter:
    """One pass over the epoch. Like torch's iterator, an error at one batch (``SampleError``)
    does not end the pass; dropping the iterator early (``break``) cancels work in flight."""

    def __init__(self, loader, iteration: int):
        self._loader, self._iteration, self._done = loader, iteration, False
        self._epoch: int | None = None  # the epoch it iterates (read at its first next())

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        ld = self._loader
        if ld._closed:
            raise RuntimeError("this DistributedDataLoader is closed")
        if ld._iteration != self._iteration:
            raise RuntimeError(
                "a newer iteration of this DistributedDataLoader began (iter() was called again); "
                "this iterator has ended"
            )
        if ld._started != self._iteration:
            ld._begin(self._iteration)
            self._epoch = ld._epoch
        ld.deadlines.asked()  # the window of the batch it computed (if any) ends here
        t0 = time.perf_counter()
        taken = ld._root.get_state()[ShardBatches.YIELDED]
        try:
            batch = next(ld._root)
        except StopIteration:
            self._finish(completed=True)  # the end of the epoch is not an input wait
            raise
        except BaseException:
            ld._stats.input_wait.append(time.perf_counter() - t0)
            # a failed batch (SampleError) was taken and counts; a Ctrl-C or a timeout took nothing
            self._advance(ld._root.get_state()[ShardBatches.YIELDED] - taken)
            raise
        now = time.perf_counter()
        ld._stats.input_wait.append(now - t0)
        if ld._root.last_task.landed > t0:  # the rank was waiting when its reply landed: how long it took to wake
            ld._stats.wakeup.append(now - ld._root.last_task.landed)
        ld._stats.batches += 1
        self._advance(1)
        ld.deadlines.yielded(ld._root.last_seq)
        if ld._position >= len(ld) and ld._root.read_end():
            # the epoch is complete: a trainer may stop after len batches without asking for more, and
            # the requests already running ahead for the next epoch must survive for it to adopt
            self._finish(completed=True)
        return ld._deliver(batch)

    def _advance(self, batches: int) -> None:
        """Count batches yielded, unless ``set_epoch`` moved the loader to another epoch meanwhile
        (its position then belongs to that epoch)."""
        if self._loader._epoch == self._epoch:
            self._loader._position += batches

    def _finish(self, completed: bool) -> None:
        ld = self._loader
        if self._done or ld._iteration != self._iteration or ld._started != self._iteration or ld._closed:
            self._done = True  # superseded, or never started (nothing to stop)
            return
        self._done = True
        if completed:  # requests for the next pass run on (adopted by it, or cancelled)
            if ld._epoch == self._epoch:
                ld._position = len(ld)
            if not ld._root.run_ahead:
                ld.client.flush_completions()  # no Route follows soon to carry them
            return
        ld._root.shutdown()  # cancels what is in flight and frees its slabs

    def __del__(self):
        if sys.is_finalizing():  # the process is exiting: its clusters stop and sweep; no RPC can start
            return
        try:
            self._finish(completed=False)
        except Exception:
            pass


class EpochSampler:
    """``loader.sampler``: what a trainer may call on a DataLoader's ``DistributedSampler``."""

    def __init__(self, loader):
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self._loader.epoch

    def __len__(self) -> int:  # this rank's samples per epoch, as DistributedSampler's len
        return self._loader._batches.samples_per_epoch
