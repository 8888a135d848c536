"""Turns a DataServer's replies into batches: a handle names a slab on this host, which ``reader``
(the client's ``SlabReader``) maps once and reads zero-copy; the slab goes back to its server when
the batch is garbage-collected, or right after a copy into pinned / device memory.

Plain functions: ``ClusterClient.materialize`` / ``release`` / ``error_of`` pass them its reader.
"""

from __future__ import annotations

import math

import torch

from helix_core.errors import ClusterError, SampleError
from helix_core.memory.merge import merge_batches
from helix_core.memory.reader import SlabReader
from helix_core.memory.tensors import copy_tensors, read_tensors, unflatten
from helix_core.wire.messages import ErrorKind, meta_dicts, slab_handle
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["error_of", "materialize", "release"]


def materialize(
    reply: pb.ExecuteReply,
    reader: SlabReader,
    pickle_allowed: bool,
    copy: bool,
    pad: bool = True,
    grow: list | None = None,
):
    """The batch of a successful reply: zero-copy tensors on the slab (released when the last
    one is garbage-collected), or owned copies (slab released at once) when ``copy``. A batch
    that came in pieces (split among a server's workers) is merged, as collating it whole
    (``pad=False``: pieces whose tensors differ in shape raise, as ``default_collate`` would).
    ``grow`` (a list): gets the function that grows the batch's first slab's tensors in place
    (``merge_batches(grow=)``), for a merge with the batch's later parts (fan-out). A pickled
    batch structure raises ``ClusterError`` unless ``pickle_allowed``."""
    if reply.pieces:
        first: list = []
        try:
            parts = [
                _materialize(b, reader, pickle_allowed, copy=False, grow=first if k == 0 and not copy else None)
                for k, b in enumerate(reply.pieces)
            ]
        except BaseException:
            release(reply, reader)  # the pieces not read yet would be stranded
            raise
        if grow is not None:
            grow.extend(first)
        return merge_batches(parts, rows=list(reply.piece_rows), pad=pad, grow=first[0] if first else None)
    return _materialize(reply.batch, reader, pickle_allowed, copy, grow)


def _materialize(b: pb.BatchHandle, reader: SlabReader, pickle_allowed: bool, copy: bool, grow: list | None = None):
    """``grow`` (a list): gets the function that grows this batch's tensors in place into the
    room its slab leaves after them (``merge_batches(grow=)``): a split batch's first piece."""
    handle = slab_handle(b.slab)
    if b.tree_pickle and not pickle_allowed:
        reader.release(handle)
        raise ClusterError(
            "a DataServer sent a pickled batch structure to a client that accepts none (a cluster "
            "reached without TLS beyond loopback, or ClusterConfig(allow_pickle=False))"
        )
    metas = meta_dicts(b.tensors)
    buf = reader.view(handle) if b.slab.segment else memoryview(b"")
    if copy:
        tensors = copy_tensors(buf, metas)
        del buf
        reader.release(handle)
    else:
        tensors = read_tensors(buf, metas, on_release=lambda h=handle: reader.release(h))
        del buf
        if grow is not None:
            grow.append(_grower(tensors, metas))
    return unflatten(b.tree_json, b.tree_pickle, tensors)


def release(reply: pb.ExecuteReply, reader: SlabReader) -> None:
    """Give a reply's slabs back unread (its request was cancelled)."""
    for b in (reply.batch, *reply.pieces):
        if b.slab.segment:
            reader.release(slab_handle(b.slab))


def error_of(reply: pb.ExecuteReply) -> Exception | None:
    """The error a failed reply stands for; None for a successful one."""
    kind = ErrorKind(reply.error_kind)
    if kind is ErrorKind.NONE:
        return None
    if kind is ErrorKind.SAMPLE:
        f = reply.failure
        return SampleError(f.index, f.path, f.cause)
    if kind is ErrorKind.SPEC:
        return ClusterError(f"DataServer could not load the dataset: {reply.error}")
    if kind is ErrorKind.NO_ROOM:
        return ClusterError(f"batch of task {reply.task_id}: {reply.error}")
    return RuntimeError(f"DataServer task {reply.task_id} failed ({kind.name}): {reply.error}")


def _grower(tensors: list, metas: list[dict]):
    """``grow(x, shape)`` for ``merge_batches``: where ``x`` starts where one of ``tensors`` (read
    in place) starts — it, or what it grew into already — and the slab holds nothing else from
    there to ``shape``'s size (a worker that stopped short, or the first part of a fanned-out batch,
    left the missing rows' room there: ``direct``), the view of ``shape`` over that memory,
    sharing ``x``'s storage (so the slab stays held while it lives); else None."""
    spans = {t.data_ptr() for t, m in zip(tensors, metas) if not m["is_inline"]}

    def grow(x, shape):
        start = x.data_ptr()
        if start not in spans or not x.is_contiguous() or tuple(x.shape[1:]) != tuple(shape[1:]):
            return None
        end = start + math.prod(shape) * x.element_size()
        storage = x.untyped_storage()
        if end > storage.data_ptr() + storage.nbytes() or any(start < s < end for s in spans):
            return None
        return x.as_strided(tuple(shape), torch.empty(tuple(shape), device="meta").stride())

    return grow
