"""The client's send and fetch loops (``Dispatch``, a ``torchdata.nodes`` node). No gRPC here.

A sender thread takes ``Task``s from the plan and starts their requests ahead of the training loop
(at most ``prefetch_depth`` in flight or waiting); a fetcher thread collects them in order. Every
wait blocks on the thing itself — a semaphore, a queue, a reply's done-callback — and a stop wakes
each of them at once: nothing polls between a reply landing and the rank that waits for it.
Errors and the end of an epoch travel as values through the queues.
"""

from __future__ import annotations

import collections
import threading
import time

from torchdata.nodes import BaseNode

from helix_core.loader.plan import ShardBatches
from helix_core.loader.waits import END as _END
from helix_core.loader.waits import Outbox, Stop

__all__ = ["Dispatch"]

_STOP = "stop"  # a run's stop marker in its order queue (_END: between epochs)


class _Run:
    """The threads and queues of a run of epochs. Threads get their run as an argument: a thread
    that outlives ``shutdown`` (a slow RPC) only ever sees its own, stopped run, never the next one's.

    ``order`` and ``out`` hold an epoch's tasks / results, then ``_END``, then the next epoch's (sent
    ahead), and so on; ``epochs`` lists the epochs whose tasks follow the current one's."""

    def __init__(self, prefetch_depth: int, seq: int):
        self.stop = Stop()
        self.slots = threading.Semaphore(prefetch_depth)  # plain: a stop wakes the sender with one release
        self.order: collections.deque = collections.deque()
        self.order_ready = threading.Semaphore(0)  # one release per item in ``order``
        self.out = Outbox()
        self.inflight: list = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.seq = seq  # the next task's sequence number
        self.epochs: collections.deque = collections.deque()  # epochs sent ahead, in order
        self.ended = False  # the current epoch's END was read: next() stops until a reset adopts the next

    def send(self, item) -> None:
        self.order.append(item)
        self.order_ready.release()

    def wake(self) -> None:
        """Stop: every thread sees it at once."""
        self.stop.set()
        self.slots.release()
        self.send(_STOP)


class Dispatch(BaseNode):
    """Sender / fetcher threads around ``requests`` (``submit(task, stop)``, ``collect(task, stop) ->
    batch``, ``cancel(task)``).

    Requests run ahead across epoch boundaries when ``run_ahead`` is set (the user advances epochs
    with ``set_epoch``): once an epoch's last task is sent, the sender goes on with the next epoch's
    as slots free up. A ``reset`` to exactly that epoch's start (the usual ``set_epoch(e + 1);
    iter()``) carries on with the same threads, so an epoch's first batches are neither decoded
    cold nor delayed by a thread restart; any other ``reset`` cancels what was sent ahead.
    ``timeout_s`` bounds every wait for a batch.
    """

    YIELDED, EPOCH = ShardBatches.YIELDED, ShardBatches.EPOCH

    def __init__(self, source, requests, prefetch_depth: int, timeout_s: float):
        super().__init__()
        self.source, self.requests, self.prefetch_depth, self.timeout_s = source, requests, prefetch_depth, timeout_s
        self.run_ahead = False
        self._run: _Run | None = None
        self._yielded, self._epoch = 0, 0
        self._seq = 0  # tasks yielded over this node's life
        self.runs = 0  # runs started (threads and queues); an epoch that adopts requests sent ahead starts none
        self.last_seq = -1  # sequence number of the task ``next`` returned last
        self.last_task = None  # the task ``next`` returned last (its ``landed`` time)

    @property
    def running(self) -> bool:
        """A run's threads are up (between ``reset`` and ``shutdown``)."""
        return self._run is not None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def reset(self, initial_state: dict | None = None):
        super().reset(initial_state)
        run = self._run
        if (
            run is not None
            and run.ended
            and initial_state is not None
            and run.epochs
            and int(initial_state.get(self.YIELDED, -1)) == 0
            and int(initial_state.get(self.EPOCH, -1)) == run.epochs[0]
        ):
            with run.lock:  # adopt what was sent ahead: same threads, same queues
                self._epoch, self._yielded = run.epochs.popleft(), 0
                run.ended = False
            return
        self.shutdown()
        self.source.reset(initial_state)
        st = self.source.get_state()
        self._epoch, self._yielded = st[self.EPOCH], st[self.YIELDED]
        run = self._run = _Run(self.prefetch_depth, self._seq)
        self.runs += 1
        run.threads = [
            threading.Thread(target=self._send, args=(run,), name="helix-sender", daemon=True),
            threading.Thread(target=self._fetch, args=(run,), name="helix-fetcher", daemon=True),
        ]
        for t in run.threads:
            t.start()

    def shutdown(self) -> None:
        """Stop both threads, cancel requests in flight (sent ahead too) and drop finished batches
        (their slabs are released when the dropped tensors are collected)."""
        run, self._run = self._run, None
        if run is None:
            return
        run.wake()
        for t in run.threads:
            if t is not threading.current_thread():  # the GC may close a dropped loader on one of its threads
                t.join(timeout=10.0)
        run.threads = []
        with run.lock:
            tasks, run.inflight = run.inflight, []
        for task in tasks:
            self.requests.cancel(task)
        run.out.clear()

    # ---- threads -------------------------------------------------------------------------------------
    def _send(self, run: _Run) -> None:
        while True:
            run.slots.acquire()
            if run.stop.is_set():
                return
            try:
                task = self.source.next()
            except StopIteration:
                run.slots.release()  # acquired for nothing
                if not self.run_ahead:
                    run.send(_END)
                    return
                epoch = int(self.source.get_state()[self.EPOCH]) + 1
                with run.lock:  # listed before its END goes out: a reset that reads END can adopt it
                    run.epochs.append(epoch)
                run.send(_END)
                try:  # go on with the next epoch's tasks
                    self.source.reset({self.EPOCH: epoch, self.YIELDED: 0})
                except BaseException as e:
                    run.send(e)
                    return
                continue
            except BaseException as e:  # errors travel as values to the consumer
                run.send(e)
                return
            task.t_dispatch = time.perf_counter()
            task.seq, run.seq = run.seq, run.seq + 1
            with run.lock:
                if run.stop.is_set():
                    return
                run.inflight.append(task)
            try:
                self.requests.submit(task, run.stop)
            except BaseException as e:
                task.error = e
            run.send(task)

    def _fetch(self, run: _Run) -> None:
        try:
            while True:
                run.order_ready.acquire()
                task = run.order.popleft()
                if task is _STOP or run.stop.is_set():
                    return
                if task is _END or isinstance(task, BaseException):
                    run.out.put(task)
                    if task is _END:
                        continue
                    return
                try:
                    item = task.error
                    if item is None:
                        task.result = self.requests.collect(task, run.stop)
                        item = task
                except BaseException as e:
                    item = e
                if run.stop.is_set() or isinstance(item, BaseException):
                    self.requests.cancel(task)  # what it left unread (other parts of a failed batch, or a stop)
                with run.lock:  # out of flight and into ``out`` at once: ``next`` tells whom it waits for
                    if task in run.inflight:
                        run.inflight.remove(task)
                    run.out.put(item)
                item = task = None  # an error's traceback holds this frame: don't let it hold the error back
        finally:
            run.out.close()

    # ---- BaseNode contract --------------------------------------------------------------------------
    def next(self):
        run = self._run
        if run is None:
            raise RuntimeError("this iteration was stopped (the loader was closed or a new iteration began)")
        if run.ended:
            raise StopIteration
        with run.lock:  # nothing ready: the rank waits for the oldest batch in flight (a held one hurries)
            if not run.out and run.inflight:
                run.inflight[0].want()
        try:
            item = run.out.get(self.timeout_s)
        except TimeoutError:
            raise RuntimeError(f"no batch within {self.timeout_s} s (the batch deadline)") from None
        if item is _END:
            run.ended = True
            raise StopIteration
        run.slots.release()
        self._yielded += 1
        self.last_seq = self._seq
        self._seq += 1
        if isinstance(item, BaseException):
            raise item
        self.last_task = item
        batch, item.result = item.result, None
        return batch

    def read_end(self, timeout_s: float = 2.0) -> bool:
        """After an epoch's last batch: take its end marker (it follows within moments), so a
        ``reset`` to the next epoch adopts what was sent ahead even when the consumer never asks
        for more. False when anything else comes next (it stays queued) or nothing within ``timeout_s``."""
        run = self._run
        if run is None:
            return False
        if not run.ended and run.out.take_end(timeout_s):
            run.ended = True
        return run.ended

    def get_state(self) -> dict:
        return {self.EPOCH: self._epoch, self.YIELDED: self._yielded}
