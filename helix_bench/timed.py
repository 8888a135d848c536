"""Decode CPU measured the same way in every system, and this machine's decode capacity.

``TimedClipDataset`` is a ``VideoClipDataset`` whose every ``fetch`` logs the thread CPU-seconds
of the decode to ``<decode_log>/decode-<pid>.log`` — in whichever process decodes it: a torch
DataLoader worker, a Ray actor or a DataServer worker (the log folder travels in ``helix_spec()``).
``read_decode_log`` sums a time window of those lines. ``CapacityProbe`` measures how many
single-threaded decoders' worth of work the machine really does at once (two vCPUs do less than
twice one decoder's work), the denominator of the physical bound (docs/guide/bench.md, "Metrics").
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
from pathlib import Path

from helix_core.data.video import VideoClipDataset

__all__ = ["CapacityProbe", "TimedClipDataset", "capacity_from_spans", "read_decode_log"]


class TimedClipDataset(VideoClipDataset):
    """``VideoClipDataset`` plus one line per ``fetch`` in ``decode_log/decode-<pid>.log``:
    ``"<wall_end> <index> <cpu_s> <wall_start>"`` — ``time.time()`` when the fetch ended and began
    (seconds since the epoch) and the thread CPU-seconds it took (decode, resize, transforms)."""

    def __init__(
        self, *args, decode_log: str | os.PathLike, estimate_noise: float = 0.0, noise_seed: int = 0, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.decode_log = str(decode_log)
        self._log = None  # (pid, file): opened once per process, reopened after a fork
        # estimates that disagree with the clips: each sample's predicted tokens and CPU seconds are
        # off by a seeded log-normal factor (sigma ``estimate_noise``); the decoded sample keeps its
        # real tokens, so Tier 1 plans on wrong costs and Tier 2 has something to correct
        self.estimate_noise, self.noise_seed = float(estimate_noise), int(noise_seed)
        self._noise = None
        if self.estimate_noise > 0:
            import numpy as np

            self._noise = np.exp(np.random.default_rng(self.noise_seed).normal(0.0, self.estimate_noise, len(self)))
            if self._costs is not None:
                c = dict(self._costs)
                c["tokens"] = np.maximum(1, np.rint(c["tokens"] * self._noise)).astype(np.int64)
                c["cpu_s"] = c["cpu_s"] * self._noise
                self._costs = c

    def estimate_cost(self, index: int):
        cost = super().estimate_cost(index)
        if self._noise is None or self._costs is not None:  # a table's costs carry the noise already
            return cost
        from dataclasses import replace

        f = float(self._noise[int(index)])
        return replace(cost, tokens=max(1, round(cost.tokens * f)), cpu_s=cost.cpu_s * f)

    def fetch(self, index: int, out=None):
        w0, c0 = time.time(), time.thread_time()
        got = super().fetch(index, out)
        cpu = time.thread_time() - c0
        log = self._file()
        log.write(f"{time.time():.6f} {int(index)} {cpu:.6f} {w0:.6f}\n")
        log.flush()
        return got

    def _file(self):
        pid = os.getpid()
        if self._log is None or self._log[0] != pid:
            Path(self.decode_log).mkdir(parents=True, exist_ok=True)
            path = Path(self.decode_log) / f"decode-{pid}.log"
            self._log = (pid, open(path, "a", encoding="ascii"))  # noqa: SIM115 - open for the process's life
        return self._log[1]

    def __getstate__(self):  # DataLoader workers get a pickled copy: an open file does not travel
        state = dict(self.__dict__)
        state["_log"] = None
        return state

    def __del__(self):
        log = getattr(self, "_log", None)
        if log is not None and log[0] == os.getpid():
            log[1].close()

    def helix_spec(self) -> dict:
        spec = super().helix_spec()
        spec["kwargs"].update(
            decode_log=self.decode_log, estimate_noise=self.estimate_noise, noise_seed=self.noise_seed
        )
        return spec


def read_decode_log(folder: str | os.PathLike, t0: float, t1: float) -> tuple[float, int]:
    """``(cpu_s, samples)``: thread CPU-seconds and count of the fetches that ended within
    ``[t0, t1]`` (``time.time()`` seconds) in every ``decode-*.log`` of ``folder``. A line a
    process is still writing (cut short) is ignored."""
    cpu, n = 0.0, 0
    for path in sorted(Path(folder).glob("decode-*.log")):
        for line in path.read_text(encoding="ascii", errors="replace").splitlines():
            parts = line.split()
            if len(parts) not in (3, 4):
                continue
            try:
                end, c = float(parts[0]), float(parts[2])
            except ValueError:
                continue
            if t0 <= end <= t1:
                cpu += c
                n += 1
    return cpu, n


@contextlib.contextmanager
def _environ(**values: str):
    """Set environment variables for the duration of a ``with`` block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _capacity_main(spec: dict, order: list[int], barrier, orders, results) -> None:
    """One decoder of ``CapacityProbe``: build, warm up, then for each ``"go"`` it reads from
    ``orders`` wait for the others, decode ``order`` and report ``(index, start, end)`` of every
    sample (``time.monotonic()`` seconds, one clock for every process of the machine); ``"stop"``
    ends it."""
    try:
        import torch

        from helix_core.data.specs import resolve

        torch.set_num_threads(1)
        ds = resolve(spec["target"])(**spec["kwargs"])
        ds[order[0]]  # codec set-up and imports are not decode work
        results.put(("ready", None))
        while orders.get() == "go":
            barrier.wait(timeout=120)
            spans = []
            for i in order:
                s = time.monotonic()
                ds[i]
                spans.append((i, s, time.monotonic()))
            results.put(("ok", spans))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(("error", f"{type(e).__name__}: {e}"))


def capacity_from_spans(spans: list[list[tuple[int, float, float]]], yardstick: dict[int, float]) -> float:
    """Decoders' worth of single-decoder work per wall second while all of them ran at once.

    ``spans[p]``: ``(index, start, end)`` of every sample process ``p`` decoded (seconds, one
    clock). Only the window in which every process was decoding counts — from the last first
    start to the first last end — and a sample cut by its edges counts for its share inside."""
    lo = max(s[0][1] for s in spans)
    hi = min(s[-1][2] for s in spans)
    if hi <= lo:
        raise ValueError("the decoders never ran at the same time")
    work = 0.0
    for proc in spans:
        for i, s, e in proc:
            inside = min(e, hi) - max(s, lo)
            if inside > 0:
                work += yardstick[i] * inside / (e - s)
    return work / (hi - lo)


class CapacityProbe:
    """This machine's decode capacity in single-decoder units (e.g. 1.85 on two busy vCPUs), as
    often as asked: ``measure()`` once per probe, ``close()`` (or ``with``) at the end.

    ``decoders`` spawned processes (``OMP_NUM_THREADS=1``, one torch thread), kept between probes
    so a probe costs its decodes, not a start: each decodes every sample of ``indices``, each
    starting at a different offset, released together by a barrier with nothing else of ours
    running. ``yardstick[i]``: single-decoder CPU-seconds of sample ``i``
    (``emulate.measure_decode``). A probe returns yardstick-seconds decoded per wall second while
    all decoders ran (:func:`capacity_from_spans`)."""

    def __init__(
        self,
        dataset_spec: dict,
        indices: list[int],
        decoders: int,
        yardstick: dict[int, float],
        timeout_s: float = 600.0,
    ):
        indices = [int(i) for i in indices]
        if decoders < 1 or not indices:
            raise ValueError(f"CapacityProbe needs decoders >= 1 and some indices, got {decoders} and {len(indices)}")
        missing = sorted(set(indices) - set(yardstick))
        if missing:
            raise ValueError(f"no yardstick for samples {missing[:8]}")
        self.yardstick, self.timeout_s, self.decoders = yardstick, timeout_s, decoders
        ctx = mp.get_context("spawn")
        self._barrier, self._results = ctx.Barrier(decoders), ctx.Queue()
        self._orders = [ctx.Queue() for _ in range(decoders)]
        step = max(1, len(indices) // decoders)
        orders = [indices[p * step % len(indices) :] + indices[: p * step % len(indices)] for p in range(decoders)]
        self._procs = [
            ctx.Process(
                target=_capacity_main,
                daemon=True,
                args=(dataset_spec, orders[p], self._barrier, self._orders[p], self._results),
            )
            for p in range(decoders)
        ]
        try:
            with _environ(OMP_NUM_THREADS="1"):  # spawned children read it before torch is imported
                for p in self._procs:
                    p.start()
            self._gather("ready")
        except BaseException:
            self.close()
            raise

    def _gather(self, want: str) -> list:
        got, deadline = [], time.monotonic() + self.timeout_s
        while len(got) < self.decoders:
            try:
                status, item = self._results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CapacityProbe: decoders did not finish in {self.timeout_s:g} s") from None
                if not all(p.is_alive() for p in self._procs) and self._results.empty():
                    raise RuntimeError("CapacityProbe: a decoder process died without a result") from None
                continue
            if status == "error":
                raise RuntimeError(f"CapacityProbe: a decoder failed: {item}")
            if status == want:
                got.append(item)
        return got

    def measure(self) -> float:
        for q in self._orders:
            q.put("go")
        return capacity_from_spans(self._gather("ok"), self.yardstick)

    def close(self) -> None:
        self._barrier.abort()  # a decoder still waiting for one that failed stops waiting
        for q in self._orders:
            q.put("stop")
        for p in self._procs:
            if p.pid is not None:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
        for q in (self._results, *self._orders):
            q.close()
            q.join_thread()

    def __enter__(self) -> CapacityProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
