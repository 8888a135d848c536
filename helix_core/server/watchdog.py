"""What a DataServer's worker pool (``pool.py``) does about a worker that hangs or dies: the
watchdog kills a worker whose sample ran past its limit, and a dead worker's task is retried
(bounded per sample: a sample that keeps killing workers fails) or failed.

``Watchdog`` decides; the pool acts. The pool holds one, calls it on its supervisor thread with the
workers and the pool's latency per cost passed in, and does what it answers (respawning, queueing,
resolving futures). Its own state is the count of deaths per sample, so its decisions can be tested
on plain data, without processes.
"""

from __future__ import annotations

import collections
import logging
import time

from helix_core.config import ClusterConfig
from helix_core.server.worker import SampleFailure, TaskResult
from helix_core.server.workerproc import WorkerProcess
from helix_core.wire.messages import ErrorKind

__all__ = ["Watchdog"]

log = logging.getLogger("helix.workers")


class Watchdog:
    """The worker pool's watchdog (``kill_hung``) and its verdict on a dead worker's task
    (``retry_or_fail``). Used on the pool's supervisor thread, under the pool's lock for
    ``retry_or_fail``."""

    TIMEOUT_COST_MULTIPLE = 20.0  # a sample's watchdog: at least this many times its predicted wall time

    def __init__(self, config: ClusterConfig):
        self.config = config
        self._kills: collections.Counter = collections.Counter()  # sample index -> deaths while preparing it

    def sample_limit_s(self, task: dict, latency_per_cost: float) -> float:
        """How long one sample of ``task`` may take: ``sample_timeout_s``, or a multiple of its
        predicted wall time (``latency_per_cost``: wall seconds per predicted CPU second) if that
        is longer."""
        n = max(1, len(task.get("indices", ())))
        predicted = task.get("predicted_cpu_s", 0.0) / n * latency_per_cost
        return max(self.config.sample_timeout_s, self.TIMEOUT_COST_MULTIPLE * predicted)

    def kill_hung(self, workers: list[WorkerProcess], latency_per_cost: float) -> float | None:
        """Kill every worker whose sample ran past its limit (naming the sample in its
        ``timed_out``: it fails once its death is seen, ``retry_or_fail``); seconds until it must
        look again (None: no worker has a task).

        A worker with a task but no sample begun (loading a spec, waiting for a decode slot, or
        between two samples) is looked at again within a limit: nothing else may wake the
        supervisor (its only worker, hung on the sample it began meanwhile, and a queue that waits
        behind it), so without that a hung sample would never be found."""
        now, nxt = time.monotonic(), None  # Progress stamps samples with the host's monotonic clock
        for w in workers:
            task = w.task
            if task is None or w.timed_out is not None:
                continue
            limit = self.sample_limit_s(task, latency_per_cost)
            got = w.progress.get_started()
            if got is None:
                nxt = limit if nxt is None else min(nxt, limit)
                continue
            index, path, started = got
            left = started + limit - now
            if left > 0:
                nxt = left if nxt is None else min(nxt, left)
                continue
            w.timed_out = (
                index,
                path,
                f"timed out: still decoding after {limit:.0f} s (sample_timeout_s); its worker was killed",
            )
            log.warning("worker %d: sample %s (%s) ran past %.0f s; killing the worker", w.wid, index, path, limit)
            w.kill()
        return nxt

    def retry_or_fail(
        self, task: dict, sample: tuple | None, timed_out: tuple | None, exit_code: int | None
    ) -> TaskResult | None:
        """A worker died during ``task`` at ``sample`` (its (index, path), None before its first
        sample), killed by the watchdog if ``timed_out`` (index, path, cause). None: run the task
        again (with ``on_error="skip"``, a sample that keeps killing workers is marked bad in
        ``task["bad"]`` and skipped); else the failed result to deliver for it."""
        c = self.config
        if timed_out is not None:  # a hung sample fails at once: it is never run again, here or elsewhere
            sample = timed_out[:2]
            self._kills[sample[0]] = c.max_task_retries
        if sample is None:  # it died before its first sample (loading the spec, waiting for a slot)
            task["_early_deaths"] = task.get("_early_deaths", 0) + 1
            if task["_early_deaths"] > c.max_task_retries:
                return TaskResult(
                    error_kind=ErrorKind.INTERNAL,
                    error=f"worker processes died {task['_early_deaths']} times (last exit code {exit_code}) "
                    "before preparing any sample of this task",
                )
            return None
        self._kills[sample[0]] += 1
        if self._kills[sample[0]] <= c.max_task_retries:
            return None
        cause = (
            timed_out[2]
            if timed_out is not None
            else (
                f"worker process died (exit code {exit_code}) while preparing this sample "
                f"{self._kills[sample[0]]} times"
            )
        )
        if task.get("on_error") == "skip":
            task["bad"][sample[0]] = cause
            return None
        return TaskResult(
            error_kind=ErrorKind.SAMPLE, error=cause, failure=SampleFailure.of(sample[0], sample[1], cause)
        )
