"""A DataServer worker process (spawned, ``OMP_NUM_THREADS=1``): the child side of ``pool``.

It loads the dataset and collate function once per spec, then runs whole batch tasks: fetch +
decode + transform each sample (holding one of the host's decode slots), collate, and write the
batch into a reused shared-memory slab of its own; the result goes back on its pipe. The sample it
is working on is written into a small shared record (``Progress``) rather than sent: the
supervisor reads it only if the worker dies, to name the sample that killed it. It exits when its
parent's pipe closes.
"""
from __future__ import annotations

import ctypes
import os
import signal
import struct
import time

from ..dataset import Epochs
from ..protocol import ErrorKind
from . import shm
from .specs import load_spec, sample_path

__all__ = ["Progress", "worker_main"]


class Progress:
    """The sample a worker is preparing — index and path — in shared memory (written per sample
    by the worker, read by the supervisor only after the worker died; no message, no wake-up)."""

    SIZE = 4096

    def __init__(self, ctx):
        self._buf = ctx.RawArray(ctypes.c_char, self.SIZE)

    def set(self, index: int, path: str) -> None:
        raw = str(path).encode("utf-8", "replace")[: self.SIZE - 13]
        self._buf[8:12] = struct.pack("<i", len(raw))
        self._buf[12:12 + len(raw)] = raw
        self._buf[0:8] = struct.pack("<q", int(index))  # last: a reader never sees a new index with an old path

    def clear(self) -> None:
        self._buf[0:8] = struct.pack("<q", -1)

    def get(self) -> tuple[int, str] | None:
        (index,) = struct.unpack("<q", self._buf[0:8])
        if index < 0:
            return None
        (n,) = struct.unpack("<i", self._buf[8:12])
        return index, self._buf[12:12 + n].decode("utf-8", "replace")


def worker_main(conn, shm_prefix: str, allow_pickle: bool, parent_pid: int, cpu_slots=None,
                progress: Progress | None = None, claim=None) -> None:
    """Entry point of a worker process: serve ``("spec", ...)`` and ``("task", ...)`` messages.
    ``cpu_slots``: ``(prefix, n)`` of the host's decode slots (a task runs holding one);
    ``progress``: where it records the sample it is working on; ``claim``: the ``steal.Claim``
    it checks before each sample (the supervisor may give the tail of its batch to another worker)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to handle
    import torch

    from .cpuslots import CpuSlots

    torch.set_num_threads(1)
    slots = CpuSlots(*cpu_slots) if cpu_slots else None
    orphaned = (lambda: os.getppid() != parent_pid)
    pool = shm.SlabPool(shm_prefix)
    specs: dict[str, tuple] = {}
    try:
        while True:
            if not conn.poll(2.0):  # a closed pipe wakes it at once; this only catches a parent that vanished
                if os.getppid() != parent_pid:
                    return  # orphaned
                continue
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # the parent's pipe closed
            if msg[0] == "stop":
                return
            if msg[0] == "spec":
                _, spec_id, payload, fmt = msg
                try:
                    specs[spec_id] = load_spec(payload, fmt, allow_pickle)
                except Exception as e:  # reported with the next task of this spec
                    specs[spec_id] = e
            elif msg[0] == "task":
                task = msg[1]
                # while it waits, the pool sends it nothing but "stop" (or its pipe closes): watch the pipe
                if slots is not None and not slots.acquire(task.get("_key"), stop=lambda: orphaned() or conn.poll(),
                                                           watch=(conn.fileno(),)):
                    return
                try:
                    result = _run_task(task, specs, pool, progress, allow_pickle,
                                       claim.take if claim is not None else (lambda k: True))
                finally:
                    if progress is not None:
                        progress.clear()
                    if slots is not None:
                        slots.release()
                conn.send(("done", task["task_id"], result))
    finally:
        pool.close()
        if slots is not None:
            slots.close()


def _failure(index: int, path: str, cause: str) -> dict:
    return {"index": int(index), "path": str(path), "cause": str(cause)}


def _run_task(task: dict, specs: dict, pool, progress, allow_pickle: bool, may_start) -> dict:
    """Prepare the task's samples in order — each one only if ``may_start(k)`` (the rest may have
    been stolen) — collate them into a slab: the result dict the pool receives (``rows``: samples
    in the batch)."""
    from ..errors import SampleError
    from .direct import direct_batch, supports_direct
    from .tensors import flatten, layout, write_tensors

    t0 = time.perf_counter()
    spec = specs.get(task["spec_id"])
    if spec is None or isinstance(spec, Exception):
        return {"error_kind": ErrorKind.SPEC, "error": f"cannot load dataset spec {task['spec_id']}: {spec!r}"}
    dataset, collate = spec
    if isinstance(dataset, Epochs):
        dataset.set_epoch(task["epoch"])
    subs = list(task.get("substitutes", ()))
    bad = task.get("bad", {})
    if not bad and supports_direct(dataset, collate):  # decode straight into the slab: no copies
        got = direct_batch(dataset, collate, list(task["indices"]), pool, allow_pickle,
                           (lambda i: progress.set(i, sample_path(dataset, i))) if progress else (lambda i: None),
                           may_start)
        if got is not None:
            slab, total, tree_json, tree_pickle, metas, cpu = got
            return {"handle": slab.handle(total), "tree_json": tree_json, "tree_pickle": tree_pickle, "metas": metas,
                    "skipped": [], "exec_s": time.perf_counter() - t0, "rows": len(cpu),
                    "decoded": [int(i) for i in task["indices"][:len(cpu)]], "decode_cpu_s": cpu}
    samples, skipped, decoded, decode_cpu = [], [], [], []
    for k, index in enumerate(task["indices"]):
        if not may_start(k):
            break
        while True:
            path = sample_path(dataset, index)
            if progress is not None:
                progress.set(index, path)
            try:
                if index in bad:
                    raise SampleError(index, path, bad[index])
                c0 = time.thread_time()
                samples.append(dataset[index])
                decode_cpu.append(time.thread_time() - c0)
                decoded.append(int(index))
                break
            except SampleError as e:
                fail = _failure(e.index, e.path, e.cause)
            except Exception as e:  # a user dataset's own error still names the sample
                fail = _failure(index, path, f"{type(e).__name__}: {e}")
            if task.get("on_error") != "skip" or not subs:
                why = "" if task.get("on_error") != "skip" else " (no substitute left)"
                return {"error_kind": ErrorKind.SAMPLE, "error": fail["cause"] + why, "failure": fail, "skipped": skipped}
            skipped.append(fail)
            index = subs.pop(0)
    slab = None
    try:
        batch = collate(samples)
        tree_json, tree_pickle, tensors = flatten(batch, allow_pickle=allow_pickle)
        metas, total = layout(tensors)
        slab = pool.acquire(total)
        metas = write_tensors(slab.payload, tensors, metas)
    except Exception as e:
        if slab is not None:
            slab.release()  # nobody will get its handle
        kind = ErrorKind.NO_ROOM if isinstance(e, shm.ShmCapacityError) else ErrorKind.INTERNAL
        return {"error_kind": kind, "error": f"collate/deliver failed for task {task['task_id']}: "
                                             f"{type(e).__name__}: {e}", "skipped": skipped}
    return {"handle": slab.handle(total), "tree_json": tree_json, "tree_pickle": tree_pickle, "metas": metas,
            "skipped": skipped, "exec_s": time.perf_counter() - t0, "rows": len(samples), "decoded": decoded,
            "decode_cpu_s": decode_cpu}
