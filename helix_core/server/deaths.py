"""What a DataServer's worker pool (``pool.py``) does about a worker that hangs or dies: the
watchdog kills a worker whose sample ran past its limit, and a dead worker is respawned and its
task retried (bounded per sample: a sample that keeps killing workers fails) or failed.

``WorkerDeaths`` is a base class of ``WorkerPool``: its methods run on the pool's supervisor
thread, on the pool's state (its workers, lock, queue, futures and split batches)."""

from __future__ import annotations

import logging
import time

from helix_core.server.worker import _failure
from helix_core.server.workerproc import WorkerProcess
from helix_core.wire.messages import ErrorKind

__all__ = ["WorkerDeaths"]

log = logging.getLogger("helix.workers")


class WorkerDeaths:
    """The watchdog and the handling of dead workers of ``WorkerPool`` (which holds the state)."""

    TIMEOUT_COST_MULTIPLE = 20.0  # a sample's watchdog: at least this many times its predicted wall time

    def _sample_limit_s(self, task: dict) -> float:
        """How long one sample of ``task`` may take: ``sample_timeout_s``, or a multiple of its
        predicted wall time if that is longer."""
        n = max(1, len(task.get("indices", ())))
        predicted = task.get("predicted_cpu_s", 0.0) / n * self.latency_per_cost
        return max(self.config.sample_timeout_s, self.TIMEOUT_COST_MULTIPLE * predicted)

    def _watchdog(self) -> float | None:
        """Kill every worker whose sample ran past its limit (the sample fails: ``_on_death``);
        seconds until it must look again (None: no worker has a task).

        A worker with a task but no sample begun (loading a spec, waiting for a decode slot, or
        between two samples) is looked at again within a limit: nothing else may wake the
        supervisor (its only worker, hung on the sample it began meanwhile, and a queue that waits
        behind it), so without that a hung sample would never be found."""
        now, nxt = time.monotonic(), None  # Progress stamps samples with the host's monotonic clock
        for w in self._workers:
            task = w.task
            if task is None or w.timed_out is not None:
                continue
            limit = self._sample_limit_s(task)
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

    def _replace(self, w: WorkerProcess) -> None:
        """A new process in the place of dead worker ``w``, watched instead of it."""
        for fd in (w.conn.fileno(), w.proc.sentinel):
            self._sel.unregister(fd)
        w.conn.close()
        self._workers[self._workers.index(w)] = self._watch(self._spawn(w.wid, w.incarnation + 1))

    def _on_death(self, w: WorkerProcess) -> None:
        if self._stop.is_set():
            return
        code, held = w.bury()
        self._graveyard += held
        self._replace(w)
        self.respawns += 1
        task, current = w.task, w.progress.get()
        log.warning(
            "worker %d died (exit %s) during task %s at sample %s; respawned",
            w.wid,
            code,
            task and task["task_id"],
            current and current[0],
        )
        if task is None:
            return
        with self._lock:
            if not self._current(task):  # cancelled (or resubmitted) meanwhile
                self._piece_done(task, {"error_kind": ErrorKind.NOT_COMPLETED, "error": "cancelled"})
                return
            if w.timed_out is not None:  # a hung sample fails at once: it is never run again, here or elsewhere
                current = w.timed_out[:2]
                self._kills[current[0]] = self.config.max_task_retries
            if current is None:  # it died before its first sample (loading the spec, waiting for a slot)
                task["_early_deaths"] = task.get("_early_deaths", 0) + 1
                if task["_early_deaths"] > self.config.max_task_retries:
                    failed = {
                        "error_kind": ErrorKind.INTERNAL,
                        "skipped": [],
                        "error": f"worker processes died {task['_early_deaths']} times (last exit code {code}) "
                        "before preparing any sample of this task",
                    }
                    if task["_serial"] in self._split:
                        self._piece_done(task, failed)
                    else:
                        self._take_future(task).set_result(failed)
                    return
            if current is not None:
                self._kills[current[0]] += 1
                if self._kills[current[0]] > self.config.max_task_retries:
                    cause = (
                        w.timed_out[2]
                        if w.timed_out is not None
                        else (
                            f"worker process died (exit code {code}) while preparing this sample "
                            f"{self._kills[current[0]]} times"
                        )
                    )
                    failed = {
                        "error_kind": ErrorKind.SAMPLE,
                        "error": cause,
                        "failure": _failure(current[0], current[1], cause),
                        "skipped": [],
                    }
                    if task.get("on_error") == "skip":
                        task["bad"][current[0]] = cause
                    elif task["_serial"] in self._split:
                        self._piece_done(task, failed)
                        return
                    else:
                        self._take_future(task).set_result(failed)
                        return
            self._pending.push(task)  # its key is kept: it goes back near the front
