"""A DataServer worker process (spawned, ``OMP_NUM_THREADS=1``): the child side of ``pool``.

It loads the dataset and collate function once per spec, then runs whole batch tasks: fetch +
decode + transform each sample (holding one of the host's decode slots from the first sample to the
last, ``DecodeSlot``), collate, and write the batch into a reused shared-memory slab of its own;
the result (a ``TaskResult``) goes back on its pipe. The sample it is working on is written into a
small shared record (``Progress``) rather than sent: the supervisor reads it only if the worker
dies, to name the sample that killed it. It exits when its parent's pipe closes.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import struct
import time
from dataclasses import dataclass, field

from helix_core.data.contract import Epochs
from helix_core.data.specs import load_spec, sample_path
from helix_core.errors import SampleError, text_of
from helix_core.memory import shm
from helix_core.memory.shm import SlabHandle
from helix_core.memory.slabpool import SlabPool
from helix_core.wire.messages import ErrorKind

__all__ = ["DecodeSlot", "Progress", "SampleFailure", "TaskResult", "worker_main"]


@dataclass(frozen=True)
class SampleFailure:
    """A sample that failed: its ``index``, its ``path`` and why (``cause``)."""

    index: int
    path: str
    cause: str

    @classmethod
    def of(cls, index: int, path, cause) -> SampleFailure:
        return cls(int(index), text_of(path), text_of(cause))


@dataclass
class TaskResult:
    """What one task came to: its batch in a slab, or why there is none. A worker sends it back on
    its pipe; ``WorkerPool`` adds the wait in its queue (``queue_s``) and, for a batch split by
    stealing, combines the pieces' results into one (``Pieces.combine``: ``pieces`` in order, the
    batch's own ``handle`` None). The DataServer turns it into an ``ExecuteReply``.

    The batch: ``handle`` (None: no batch), its tree (``tree_json``, or ``tree_pickle``) and its
    tensors' ``metas`` (``memory.tensors.layout``); ``rows``: samples in it. Why not:
    ``error_kind`` (``ErrorKind.NONE``: it did not fail), ``error`` and the sample that failed
    (``failure``). Either way: the samples replaced (``skipped``, on_error="skip"), those decoded
    and the CPU seconds each took (``decoded``, ``decode_cpu_s``), the bytes each fetched from
    storage and the seconds it waited for them (``read_bytes``, ``read_s``: 0 for a local file;
    the pool's ``StorageMeter`` learns from them), the seconds the task ran at its worker
    (``exec_s``) and waited in the pool's queue (``queue_s``), and Tier 2's sample features
    (``features``; None: not asked)."""

    handle: SlabHandle | None = None
    tree_json: str = ""
    tree_pickle: bytes = b""
    metas: list[dict] = field(default_factory=list)
    rows: int = 0
    pieces: list[TaskResult] = field(default_factory=list)
    error_kind: ErrorKind = ErrorKind.NONE
    error: str = ""
    failure: SampleFailure | None = None
    skipped: list[SampleFailure] = field(default_factory=list)
    decoded: list[int] = field(default_factory=list)
    decode_cpu_s: list[float] = field(default_factory=list)
    read_bytes: list[int] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)
    exec_s: float = 0.0
    queue_s: float = 0.0
    features: list[dict] | None = None

    def handles(self) -> list[SlabHandle]:
        """The slab handles it holds: its batch's, or its pieces'."""
        if self.handle is not None:
            return [self.handle]
        return [p.handle for p in self.pieces if p.handle is not None]


class Progress:
    """The sample a worker is preparing — index, path and when it started (``time.monotonic``,
    one clock for every process of the host) — in shared memory, written per sample by the worker.
    The supervisor reads it when the worker dies (to name the sample that killed it) and when a
    sample's watchdog runs out; no message, no wake-up."""

    SIZE = 4096
    _HEAD = 20  # index (q), started (d), path length (i)

    def __init__(self, ctx):
        self._buf = ctx.RawArray(ctypes.c_char, self.SIZE)

    def set(self, index: int, path: str) -> None:
        raw = str(path).encode("utf-8", "surrogateescape")[: self.SIZE - self._HEAD - 1]
        self._buf[8:20] = struct.pack("<di", time.monotonic(), len(raw))
        self._buf[20 : 20 + len(raw)] = raw
        self._buf[0:8] = struct.pack("<q", int(index))  # last: a reader never sees a new index with an old path

    def clear(self) -> None:
        self._buf[0:8] = struct.pack("<q", -1)

    def get(self) -> tuple[int, str] | None:
        got = self.get_started()
        return None if got is None else got[:2]

    def get_started(self) -> tuple[int, str, float] | None:
        """(index, path, monotonic start time) of the sample in progress, None between samples."""
        (index,) = struct.unpack("<q", self._buf[0:8])
        if index < 0:
            return None
        started, n = struct.unpack("<di", self._buf[8:20])
        return index, self._buf[20 : 20 + n].decode("utf-8", "replace"), started


class Stopped(BaseException):
    """The pool stopped this worker (or its parent vanished) while it waited for a decode slot: a
    ``BaseException``, so no dataset's or collate's ``except Exception`` swallows it."""


class DecodeSlot:
    """A task's hold on one of the host's decode slots (``CpuSlots``; None: no cap), taken before
    its first sample is decoded and given back as soon as its last one is: making a slab,
    collating, laying out and replying leave the core to another worker's decode. ``enter``
    raises ``Stopped`` when ``stop()`` turns true while it waits (``watch``: descriptors that
    wake it to ask)."""

    def __init__(self, slots, key: float | None, stop, watch=()):
        self.slots, self.key, self.stop, self.watch = slots, key, stop, watch

    def enter(self) -> None:
        if self.slots is not None and not self.slots.acquire(self.key, stop=self.stop, watch=self.watch):
            raise Stopped

    def leave(self) -> None:
        if self.slots is not None:
            self.slots.release()


def limit_memory(fraction: float) -> int:
    """Cap this process's address space at ``fraction`` of the host's RAM (RLIMIT_AS), so a
    decode bomb fails with an allocation error here — a ``SampleError`` — instead of waking the
    OOM killer, which may pick the trainer. The cap in bytes (0: none could be set)."""
    import resource

    try:
        limit = int(fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        return limit
    except (ValueError, OSError):
        return 0


def worker_main(
    conn,
    shm_prefix: str,
    allow_pickle: bool,
    parent_pid: int,
    cpu_slots=None,
    progress: Progress | None = None,
    claim=None,
    memory_fraction: float = 1.0,
    slab_lease: tuple[float, float] = (900.0, 60.0),
    nice: int = 0,
) -> None:
    """Entry point of a worker process: serve ``("spec", ...)`` and ``("task", ...)`` messages.
    ``cpu_slots``: ``(prefix, n)`` of the host's decode slots (a task runs holding one);
    ``progress``: where it records the sample it is working on; ``claim``: the ``steal.Claim``
    it checks before each sample (the supervisor may give the tail of its batch to another worker);
    ``memory_fraction``: its address-space cap, a share of the host's RAM (``limit_memory``);
    ``slab_lease``: its slabs' ``(orphan_s, idle_s)`` (``SlabPool``), reclaimed whenever it is idle;
    ``nice``: added to its niceness, so that the ranks' threads (a model step, a kernel launch) and
    the servers' take a core before a decode does, and decoding fills the cores they leave idle."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if nice:
        os.nice(nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to handle
    if memory_fraction < 1.0:
        limit_memory(memory_fraction)
    import torch

    from helix_core.server.cpuslots import CpuSlots

    torch.set_num_threads(1)
    slots = CpuSlots(*cpu_slots) if cpu_slots else None
    orphaned = lambda: os.getppid() != parent_pid
    pipe = conn.fileno()
    readable = lambda timeout: bool(select.select([pipe], [], [], timeout)[0])  # conn.poll builds a selector each time
    pool = SlabPool(shm_prefix, orphan_s=slab_lease[0], idle_s=slab_lease[1])
    specs: dict[str, tuple] = {}
    try:
        while True:
            if not readable(2.0):  # a closed pipe wakes it at once; this only catches a parent that vanished
                if os.getppid() != parent_pid:
                    return  # orphaned
                pool.reclaim()  # idle: slabs of clients that died come back; unused ones go
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
                # while it waits for a slot, the pool sends it nothing but "stop" (or its pipe closes): watch the pipe
                decoding = DecodeSlot(slots, task.get("_key"), lambda: orphaned() or readable(0), (pipe,))
                try:
                    result = _run_task(
                        task,
                        specs,
                        pool,
                        progress,
                        allow_pickle,
                        claim.take if claim is not None else (lambda k: True),
                        decoding,
                    )
                except Stopped:
                    return
                finally:
                    if progress is not None:
                        progress.clear()
                    decoding.leave()
                conn.send(("done", task["task_id"], result))
    finally:
        pool.close()
        if slots is not None:
            slots.close()


def _run_task(task: dict, specs: dict, pool, progress, allow_pickle: bool, may_start, decoding=None) -> TaskResult:
    """Prepare the task's samples in order — each one only if ``may_start(k)`` (the rest may have
    been stolen) — collate them into a slab: the result the pool receives. ``decoding``: its
    ``DecodeSlot``, held while samples are prepared."""
    from helix_core.memory.tensors import flatten, layout, write_tensors
    from helix_core.server.direct import direct_batch, getitem_is_fetch, storage_reads, supports_direct

    t0 = time.perf_counter()
    spec = specs.get(task["spec_id"])
    if spec is None or isinstance(spec, Exception):
        detail = str(spec) if isinstance(spec, ValueError) else repr(spec)  # ours name the argument
        return TaskResult(error_kind=ErrorKind.SPEC, error=f"cannot load dataset spec {task['spec_id']}: {detail}")
    dataset, collate, feature_fn = spec
    want_features = bool(task.get("features"))
    if isinstance(dataset, Epochs):
        dataset.set_epoch(task["epoch"])
    subs = list(task.get("substitutes", ()))
    bad = task.get("bad", {})
    if not bad and supports_direct(dataset, collate):  # decode straight into the slab
        featurize = (
            (lambda samples, decoded: sample_features(samples, decoded, feature_fn, dataset)) if want_features else None
        )
        try:
            got = direct_batch(
                dataset,
                collate,
                list(task["indices"]),
                pool,
                allow_pickle,
                (lambda i: progress.set(i, sample_path(dataset, i))) if progress else (lambda i: None),
                may_start,
                featurize,
                room=list(task.get("room", ())),
                decoding=decoding,
            )
        except SampleError as e:  # the generic path reports it (or substitutes it) without reading it again
            got, bad = None, {**bad, e.index: e.cause}
        if got is not None:
            slab, total, tree_json, tree_pickle, metas, cpu, features, reads = got
            return TaskResult(
                handle=slab.handle(total),
                tree_json=tree_json,
                tree_pickle=tree_pickle,
                metas=metas,
                exec_s=time.perf_counter() - t0,
                rows=len(cpu),
                decoded=[int(i) for i in task["indices"][: len(cpu)]],
                decode_cpu_s=cpu,
                read_bytes=[b for b, _ in reads],
                read_s=[w for _, w in reads],
                features=features,
            )
    samples, skipped, decoded, decode_cpu, reads = [], [], [], [], []
    measured = getitem_is_fetch(dataset)  # fetch also says what the sample's reads cost
    for k, index in enumerate(task["indices"]):
        if not may_start(k):
            break
        while True:
            path = sample_path(dataset, index)
            if decoding is not None:
                decoding.enter()
            if progress is not None:
                progress.set(index, path)
            try:
                if index in bad:
                    raise SampleError(index, path, bad[index])
                c0 = time.thread_time()
                if measured:
                    sample, got = dataset.fetch(index)
                    samples.append(sample)
                    reads.append(storage_reads(got))
                else:
                    samples.append(dataset[index])
                    reads.append((0, 0.0))
                decode_cpu.append(time.thread_time() - c0)
                decoded.append(int(index))
                break
            except SampleError as e:
                fail = SampleFailure.of(e.index, e.path, e.cause)
            except Exception as e:  # a user dataset's own error still names the sample
                fail = SampleFailure.of(index, path, f"{type(e).__name__}: {e}")
            if task.get("on_error") != "skip" or not subs:
                why = "" if task.get("on_error") != "skip" else " (no substitute left)"
                return TaskResult(error_kind=ErrorKind.SAMPLE, error=fail.cause + why, failure=fail, skipped=skipped)
            skipped.append(fail)
            index = subs.pop(0)
    if decoding is not None:
        decoding.leave()  # collating and writing the batch leave the core to another decode
    features = None
    if want_features:
        try:
            features = sample_features(samples, decoded, feature_fn, dataset)
        except SampleError as e:
            fail = SampleFailure.of(e.index, e.path, e.cause)
            return TaskResult(error_kind=ErrorKind.SAMPLE, error=fail.cause, failure=fail, skipped=skipped)
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
        return TaskResult(
            error_kind=kind,
            error=f"collate/deliver failed for task {task['task_id']}: {type(e).__name__}: {e}",
            skipped=skipped,
        )
    return TaskResult(
        handle=slab.handle(total),
        tree_json=tree_json,
        tree_pickle=tree_pickle,
        metas=metas,
        skipped=skipped,
        exec_s=time.perf_counter() - t0,
        rows=len(samples),
        decoded=decoded,
        decode_cpu_s=decode_cpu,
        read_bytes=[b for b, _ in reads],
        read_s=[w for _, w in reads],
        features=features,
    )


def sample_features(samples: list, decoded: list, feature_fn, dataset) -> list[dict]:
    """Tier 2: ``feature_fn`` (default ``default_features``) of each decoded sample, as JSON-able
    dicts; one that raises, or returns anything else, is a ``SampleError`` naming the sample."""
    import json

    from helix_core.tier2.rebalance import default_features

    fn = feature_fn or default_features
    out = []
    for index, sample in zip(decoded, samples):
        try:
            f = fn(sample)
            if not isinstance(f, dict):
                raise TypeError(f"returned {type(f).__name__}, not a dict")
            json.dumps(f)
        except Exception as e:
            raise SampleError(
                index, sample_path(dataset, index), f"Rebalance.feature_fn: {type(e).__name__}: {e}"
            ) from None
        out.append(f)
    return out
