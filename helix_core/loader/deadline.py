"""Deadlines from the training loop (paper §3.3): a rank's GPU compute window is the time budget
for its next batch.

``DeadlineEstimator`` is pure (an injected clock, no threads of its own). The loader tells it when
``next()`` returned a batch (the rank starts computing it) and when ``next()`` is called again
(the window ended), or the trainer reports the window itself (``report_step_time``, CUDA-event
timings on a GPU). Windows are learnt per unit of predicted GPU cost, so a token-heavy batch ahead
pushes back the deadlines of the batches behind it.

A window as measured includes the wait at the gradient sync for the slowest rank. When input
starves the job, that wait is input wait, not compute: learning its mean would let deadlines drift
to the starved pace, where every late server "meets" them and placement never moves work to spare
CPU — a slow equilibrium that feeds itself. So the estimate is a low quantile of the recent
windows: what a rank computes when nobody makes it wait (in a synchronous job the slowest rank of
each step waits for no one). A deadline is "seconds from now"
until the rank will ask for a batch: that is what crosses processes, never a clock value.
"""

from __future__ import annotations

import collections
import math
import threading
import time

__all__ = ["DeadlineEstimator"]


class DeadlineEstimator:
    """Predicts, for each upcoming batch position, the seconds until the rank asks for it.

    ``expect(position, units)``: the batch's predicted GPU cost units (the sender registers each
    batch it requests); ``yielded(position)``: ``next()`` returned it; ``asked()``: ``next()`` was
    called (the previous batch's window ended); ``report(seconds)``: the trainer measured the
    current batch's window. ``deadline(position)`` is None until one window was measured.
    ``seconds_per_unit``: the ``quantile`` of the last ``history`` windows' seconds per unit.
    """

    def __init__(self, quantile: float = 0.1, history: int = 64, clock=time.perf_counter):
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile}")
        if history < 1:
            raise ValueError(f"history must be >= 1 windows, got {history}")
        self.quantile, self.clock = quantile, clock
        self._history: collections.deque = collections.deque(maxlen=int(history))
        self._lock = threading.Lock()
        self._units: dict[int, float] = {}  # position -> predicted GPU cost units
        self._mean_units = 1.0
        self.seconds_per_unit: float | None = None
        self.windows = 0  # windows measured or reported
        self.reported = 0  # windows the trainer reported (report_step_time)
        self._current: int | None = None  # the position being computed (yielded, not asked since)
        self._t_yield = 0.0
        self._reported: float | None = None  # a window reported for the current batch
        self._next = 0  # the position the rank asks for next

    # ---- events from the loader / trainer ------------------------------------------------------------
    def expect(self, position: int, units: float) -> None:
        units = float(units)
        if not (math.isfinite(units) and units > 0):
            return
        with self._lock:
            self._units[position] = units
            self._mean_units += 0.1 * (units - self._mean_units)

    def measured(self, position: int, units: float) -> None:
        """Batch ``position``'s GPU cost as decoding measured it (Tier 2: the batch its round gave
        the rank): its window is learned against this, not the estimate."""
        units = float(units)
        if math.isfinite(units) and units > 0:
            with self._lock:
                if position in self._units or position >= self._next:  # not computed yet
                    self._units[position] = units

    def yielded(self, position: int) -> None:
        with self._lock:
            self._current, self._t_yield, self._reported = position, self.clock(), None
            self._next = position + 1
            for p in [p for p in self._units if p < position]:
                del self._units[p]

    def asked(self) -> None:
        """``next()`` was called: the window of the batch being computed is over."""
        with self._lock:
            if self._current is None:
                return
            window = self._reported if self._reported is not None else self.clock() - self._t_yield
            self._learn(self._current, window)
            self._current = None

    def report(self, seconds: float) -> None:
        """The trainer's measured window (compute + sync) of the batch being computed, seconds."""
        seconds = float(seconds)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"report_step_time(seconds) needs a finite number of seconds >= 0, got {seconds!r}")
        with self._lock:
            self.reported += 1
            if self._current is not None:
                self._reported = seconds
            else:  # reported after next() was called already: learn it for the last batch
                self._learn(self._next - 1, seconds)

    def _learn(self, position: int, window: float) -> None:
        self._history.append(window / self._units.get(position, self._mean_units))
        ordered = sorted(self._history)  # <= history values, once per step
        self.seconds_per_unit = ordered[int(self.quantile * (len(ordered) - 1))]
        self.windows += 1

    # ---- predictions --------------------------------------------------------------------------------
    def window_s(self, position: int) -> float | None:
        """Predicted compute window of batch ``position`` (seconds), None before any measurement."""
        with self._lock:
            return self._window(position)

    def _window(self, position: int) -> float | None:
        if self.seconds_per_unit is None:
            return None
        return self.seconds_per_unit * self._units.get(position, self._mean_units)

    def deadline(self, position: int) -> float | None:
        """Seconds from now until the rank asks for batch ``position`` (0: it is asking now or
        already did); None before any window was measured."""
        with self._lock:
            if self.seconds_per_unit is None:
                return None
            if position < self._next:
                return 0.0
            total = 0.0
            if self._current is not None:  # computing batch `current`: what is left of its window
                total += max(0.0, self._window(self._current) - (self.clock() - self._t_yield))
            for p in range(self._next, position):  # the batches it computes before it asks for `position`
                total += self._window(p)
            return total
