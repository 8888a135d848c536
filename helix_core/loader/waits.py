"""What the client's send and fetch loops block on: a run's ``Stop`` (which also wakes whatever
the fetcher waits for) and the ``Outbox`` of results in order. Nothing here polls."""

from __future__ import annotations

import collections
import threading

__all__ = ["END", "Outbox", "Stop"]

END = "end-of-epoch"  # the marker between one epoch's results and the next's


class Stop:
    """A run's stop signal that also wakes whatever the fetcher waits for (``wait``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._set = False
        self._waiting: set[threading.Event] = set()

    def set(self) -> None:
        with self._lock:
            self._set = True
            waiting = list(self._waiting)
        for ev in waiting:
            ev.set()

    def is_set(self) -> bool:
        return self._set

    def wait(self, future, timeout_s: float, *, or_=None) -> bool:
        """Block until ``future`` (anything with ``add_done_callback``) is done — True — or the
        run stops or ``timeout_s`` passes — False. The done-callback wakes it at once. ``or_``:
        another future whose completion also ends the wait (then False unless ``future`` is done)."""

        def arm(ev):
            for f in (future, or_):
                if f is not None:
                    f.add_done_callback(lambda _: ev.set())

        self._block(arm, timeout_s)
        return future.done() and not self._set

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` unless the run stops first; True if it stopped."""
        self._block(lambda ev: None, seconds)
        return self._set

    def _block(self, arm, timeout_s: float) -> None:
        """Wait on a fresh event that a stop sets (``arm(event)`` may hand it to another waker)."""
        ev = threading.Event()
        with self._lock:
            if self._set:
                return
            self._waiting.add(ev)
        try:
            arm(ev)
            ev.wait(timeout_s)
        finally:
            with self._lock:
                self._waiting.discard(ev)


class Outbox:
    """Results in order, then ``END``, then the next epoch's (a deque under a condition)."""

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self.closed = False  # the fetcher is gone: nothing more will come

    def put(self, item) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def get(self, timeout_s: float):
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self.closed, timeout_s):
                raise TimeoutError
            if not self._items:
                raise RuntimeError("Helix dispatch threads stopped unexpectedly")
            return self._items.popleft()

    def take_end(self, timeout_s: float) -> bool:
        """Take ``END`` if it is (or within ``timeout_s`` becomes) the next item; False if anything
        else is next (it stays) or nothing came."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self.closed, timeout_s)
            if self._items and self._items[0] is END:
                self._items.popleft()
                return True
            return False

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def clear(self) -> None:
        with self._cond:
            self._items.clear()
