"""A DataServer's supervised pool of worker processes (``worker.py`` is the child's program,
``workerproc.py`` the supervisor's handle of one, ``watchdog.py`` the pool's watchdog and its
verdict on a dead worker's task).

Queued tasks run earliest-deadline-first: a task's key is its arrival time plus its deadline
(seconds from now, as the client sent it), or its arrival time when it has none — so without
deadlines the order is first-in-first-out. The pool's supervisor thread owns every worker pipe: it
hands tasks to idle workers, collects results, and watches process sentinels, blocking on all of
them at once (one epoll set, kept across wake-ups). A worker that dies is respawned and its task
retried (bounded per sample: a sample that keeps killing workers becomes a ``SampleError``): the
pool's ``Watchdog`` kills workers hung on a sample and decides whether a dead worker's task runs
again or fails; the pool respawns, queues and resolves. A worker with nothing queued takes the
unstarted tail of a running splittable batch (``steal``): the batch comes back in pieces.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import selectors
import threading
import time
from concurrent.futures import Future

from helix_core.config import ClusterConfig
from helix_core.memory import shm
from helix_core.server.edf import EdfQueue
from helix_core.server.steal import Pieces
from helix_core.server.storagemeter import StorageMeter
from helix_core.server.watchdog import Watchdog
from helix_core.server.worker import TaskResult
from helix_core.server.workerproc import WorkerProcess
from helix_core.wire.messages import ErrorKind

__all__ = ["WorkerPool"]

log = logging.getLogger("helix.workers")


def _key(task: dict) -> tuple[str, int]:
    return task.get("client_id", ""), task["task_id"]


class WorkerPool:
    """``n`` supervised worker processes. ``submit(task) -> Future`` of the task's ``TaskResult``.

    A task may carry ``deadline_s`` (seconds from now: earliest deadline runs first) and
    ``predicted_cpu_s`` (the client's CPU-cost prediction: the pool learns its latency per unit
    of predicted cost, ``latency_per_cost``, an EWMA of execution wall seconds / predicted CPU
    seconds, and reports the predicted CPU seconds queued or running, ``queued_cpu_s``). What its
    workers' samples waited on storage (``TaskResult.read_bytes`` / ``read_s``) feeds ``storage``,
    this server's storage bandwidth and latency (``StorageMeter``)."""

    LPC_ALPHA = 0.2  # weight of the newest measurement in latency_per_cost

    def __init__(
        self,
        n: int,
        shm_prefix: str,
        allow_pickle: bool,
        config: ClusterConfig,
        clock=time.monotonic,
        cpu_slots: tuple[str, int] | None = None,
    ):
        if n < 1:
            raise ValueError(f"workers must be >= 1, got {n}")
        self.prefix, self.allow_pickle, self.config, self.clock = shm_prefix, allow_pickle, config, clock
        self.cpu_slots = cpu_slots
        self._lock = threading.Lock()
        self._specs: dict[str, tuple[bytes, str]] = {}
        self._pending = EdfQueue()
        # (client id, task id) -> (serial of its current submission, Future): a task resubmitted under
        # the same id (the client retries) never receives a result, or a piece, of an earlier
        # submission; two clients' tasks never meet, whatever their ids
        self._futures: dict[tuple[str, int], tuple[int, Future]] = {}
        self._serials = itertools.count()
        self._split: dict[int, Pieces] = {}  # submission serial -> the pieces of a batch split by stealing
        self.steals = 0
        self._watchdog = Watchdog(config)
        self._wake_r, self._wake_w = os.pipe()  # a byte: work was queued (or close)
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self.completed, self.respawns, self.supervisor_errors = 0, 0, 0
        self._graveyard: list[str] = []  # dead workers' slabs still held by clients
        self.latency_per_cost = 1.0  # wall seconds per predicted CPU second (1 until measured)
        self.storage = StorageMeter()  # what reading a sample from storage costs here (by URL)
        self._workers = [self._watch(self._spawn(i, 0)) for i in range(n)]
        self._thread = threading.Thread(target=self._supervise, name="helix-supervisor", daemon=True)
        self._thread.start()

    def _watch(self, w: WorkerProcess) -> WorkerProcess:
        self._sel.register(w.conn.fileno(), selectors.EVENT_READ, (w, False))
        self._sel.register(w.proc.sentinel, selectors.EVENT_READ, (w, True))
        return w

    def _spawn(self, wid: int, incarnation: int) -> WorkerProcess:
        c = self.config
        return WorkerProcess(
            wid,
            incarnation,
            self.prefix,
            self.allow_pickle,
            self.cpu_slots,
            c.worker_memory_fraction,
            (c.execute_timeout_s + c.rpc_timeout_s, c.slab_idle_s),
            c.worker_nice,
        )

    # ---- API used by gRPC handler threads --------------------------------------------------------
    def configure(self, spec_id: str, payload: bytes, fmt: str) -> None:
        with self._lock:
            self._specs[spec_id] = (payload, fmt)

    def knows(self, spec_id: str) -> bool:
        return spec_id in self._specs

    def submit(self, task: dict) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("worker pool is closed")
            task.setdefault("bad", {})
            now = self.clock()
            deadline = task.get("deadline_s")
            task["_arrival"], task["_key"] = now, now + (max(0.0, deadline) if deadline is not None else 0.0)
            task["_serial"] = next(self._serials)
            self._futures[_key(task)] = (task["_serial"], fut)
            self._pending.push(task)
        self._ring()
        return fut

    def _ring(self) -> None:
        try:
            os.write(self._wake_w, b"t")
        except BlockingIOError:  # a full pipe wakes the supervisor already
            pass

    def cancel(self, task_ids, client_id: str = "") -> None:
        """Drop the tasks ``task_ids`` of client ``client_id`` (not started: never run)."""
        with self._lock:
            ids = set(task_ids)
            for tid in ids:
                _, fut = self._futures.pop((client_id, tid), (None, None))
                if fut is not None:
                    fut.cancel()
            for task in self._pending.remove(
                ids, client_id
            ):  # queued pieces of a split batch never run: count them out
                self._piece_done(task, TaskResult(error_kind=ErrorKind.NOT_COMPLETED, error="cancelled"))

    def stats(self) -> dict:
        with self._lock:
            busy = [w for w in self._workers if w.task is not None]
            now = self.clock()
            running = sum(
                max(0.0, w.task.get("predicted_cpu_s", 0.0) - (now - w.started) / self.latency_per_cost) for w in busy
            )
            storage_bps, storage_latency_s = self.storage.estimate()
            return {
                "queue_depth": len(self._pending),
                "inflight": len(busy),
                "completed": self.completed,
                "workers_alive": sum(w.proc.is_alive() for w in self._workers),
                "respawns": self.respawns,
                "worker_pids": [w.proc.pid for w in self._workers],
                "latency_per_cost": self.latency_per_cost,
                "storage_bandwidth_bps": storage_bps,
                "storage_latency_s": storage_latency_s,
                "steals": self.steals,
                "queued_cpu_s": self._pending.cpu_s + running,
            }

    # ---- supervisor thread ---------------------------------------------------------------------------
    def _supervise(self) -> None:
        """The supervisor thread: survives its own failures (a respawn refused with EAGAIN or
        ENOMEM right after an OOM kill, ...) with a bounded back-off; meanwhile ``stats`` shows
        fewer live workers, and a server with none reports itself unhealthy."""
        delay = 0.05
        while not self._stop.is_set():
            try:
                self._supervise_once()
                delay = 0.05
            except Exception as e:
                self.supervisor_errors += 1
                log.error("worker supervisor: %s: %s; retrying in %.2f s", type(e).__name__, e, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)

    def _supervise_once(self) -> None:
        self._assign()
        if self._graveyard:
            orphan_s = self.config.execute_timeout_s + self.config.rpc_timeout_s  # as the slab pools'
            self._graveyard = [n for n in self._graveyard if not shm.unlink_if_free(n, orphan_s)]
        timeout = self._watchdog.kill_hung(self._workers, self.latency_per_cost)
        if self._graveyard:  # dead workers' slabs are re-checked
            timeout = 1.0 if timeout is None else min(timeout, 1.0)
        # every event wakes it (a task, a result, a death, close), and the next sample's watchdog
        events = self._sel.select(timeout)
        died = []
        for key, _ in events:
            if key.data is None:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            w, death = key.data
            if w not in self._workers:  # replaced by an earlier event of this round
                continue
            self._drain(w)
            if death:
                died.append(w)
        for w in died:
            self._on_death(w)

    def _assign(self) -> None:
        with self._lock:
            for w in self._workers:
                if w.task is not None or not w.proc.is_alive():
                    continue
                task = self._pending.pop() if self._pending else self._steal()
                if task is None:
                    return
                self._hand(w, task)

    def _hand(self, w: WorkerProcess, task: dict) -> None:
        try:
            if task["spec_id"] not in w.specs:
                payload, fmt = self._specs.get(task["spec_id"], (b"", "missing"))
                w.conn.send(("spec", task["spec_id"], payload, fmt))
                w.specs.add(task["spec_id"])
            w.claim.reset(len(task["indices"]))
            w.conn.send(("task", task))
            w.task, w.started = task, self.clock()
            task.setdefault("_queue_s", w.started - task["_arrival"])
        except (BrokenPipeError, OSError):
            self._pending.push(task)

    def _steal(self) -> dict | None:
        """For a worker with nothing queued: the unstarted tail of the running splittable batch
        due first, as a piece of its own (None when there is none)."""
        if not self.config.work_stealing:
            return None
        running = sorted(
            (
                w
                for w in self._workers
                if w.task is not None
                and w.task.get("splittable")
                and len(w.task["indices"]) > 1
                and not w.task["bad"]
                and self._current(w.task)
                and w.proc.is_alive()
            ),
            key=lambda w: w.task["_key"],
        )
        for w in running:
            got = w.claim.steal()
            if got is None:
                continue
            start, end = got
            task, n = w.task, len(w.task["indices"])
            piece = dict(
                task,
                indices=task["indices"][start:end],
                _offset=task.get("_offset", 0) + start,
                bad={},
                room=[],
                predicted_cpu_s=task.get("predicted_cpu_s", 0.0) * (end - start) / n,
            )
            task["indices"] = task["indices"][:start]  # what it keeps (a retry after its death runs just that)
            task["predicted_cpu_s"] = task.get("predicted_cpu_s", 0.0) * start / n
            self._split.setdefault(task["_serial"], Pieces()).add(piece["_offset"])
            self.steals += 1
            return piece
        return None

    def _drain(self, w: WorkerProcess) -> None:
        fd = w.conn.fileno()
        while True:
            try:
                if not select.select([fd], [], [], 0)[0]:  # (conn.poll builds a selector each time)
                    return
                msg = w.conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "done":
                self._finish(w, msg[1], msg[2])

    def _finish(self, w: WorkerProcess, task_id: int, result: TaskResult) -> None:
        with self._lock:
            task = w.task
            w.task = None
            self.completed += 1
            predicted = task.get("predicted_cpu_s", 0.0) if task is not None else 0.0
            # wall time at the worker, waiting for a decode slot included
            if predicted > 0 and result.handle is not None:
                a, ratio = self.LPC_ALPHA, (self.clock() - w.started) / predicted
                self.latency_per_cost = (1 - a) * self.latency_per_cost + a * min(max(ratio, 0.05), 50.0)
            for read_bytes, read_s in zip(result.read_bytes, result.read_s):
                self.storage.observe(read_bytes, read_s)
            if task is not None:
                result.queue_s = task.get("_queue_s", 0.0)
            if task is not None and task.get("_serial") in self._split:
                self._piece_done(task, result)
                return
            fut = self._take_future(task) if task is not None else None
        self._deliver(fut, result)

    def _current(self, task: dict) -> bool:
        """``task`` (or a piece of it) belongs to its id's live submission (not cancelled, not superseded)."""
        return self._futures.get(_key(task), (None, None))[0] == task.get("_serial")

    def _take_future(self, task: dict) -> Future | None:
        """The Future a result of ``task`` resolves, if it is the live submission's (under the lock)."""
        return self._futures.pop(_key(task))[1] if self._current(task) else None

    @staticmethod
    def _deliver(fut: Future | None, result: TaskResult) -> None:
        if fut is None or fut.cancelled():
            for handle in result.handles():  # nobody will read it: free the slabs now
                shm.release_segment(handle)
            return
        fut.set_result(result)

    def _piece_done(self, task: dict, result: TaskResult) -> None:
        """A piece of a split batch is in (under the lock): the last one completes the batch."""
        pieces = self._split.get(task.get("_serial"))
        if pieces is None:
            return
        if not pieces.finish(task.get("_offset", 0), result):
            return
        del self._split[task["_serial"]]
        combined, unused = pieces.combine()  # the batch waited as long as its first piece
        for r in unused:
            for handle in r.handles():
                shm.release_segment(handle)
        self._deliver(self._take_future(task), combined)

    def _replace(self, w: WorkerProcess) -> None:
        """A new process in the place of dead worker ``w``, watched instead of it."""
        for fd in (w.conn.fileno(), w.proc.sentinel):
            self._sel.unregister(fd)
        w.conn.close()
        self._workers[self._workers.index(w)] = self._watch(self._spawn(w.wid, w.incarnation + 1))

    def _on_death(self, w: WorkerProcess) -> None:
        """Worker ``w`` died: respawn it, and run its task again or fail it (``Watchdog.retry_or_fail``)."""
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
                self._piece_done(task, TaskResult(error_kind=ErrorKind.NOT_COMPLETED, error="cancelled"))
                return
            failed = self._watchdog.retry_or_fail(task, current, w.timed_out, code)
            if failed is None:
                self._pending.push(task)  # its key is kept: it goes back near the front
            elif task["_serial"] in self._split:
                self._piece_done(task, failed)
            else:
                self._take_future(task).set_result(failed)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._ring()
        self._thread.join(timeout=self.config.stop_timeout_s)
        for w in self._workers:
            try:
                w.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + self.config.stop_timeout_s
        for w in self._workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=self.config.stop_timeout_s)
            w.conn.close()
        with self._lock:
            for _, fut in self._futures.values():
                fut.cancel()
            self._futures.clear()
        if not self._thread.is_alive():
            self._sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        shm.sweep(self.prefix)
