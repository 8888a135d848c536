"""Turns a DataServer's replies into batches (a base class of ``ClusterClient``): a handle names a
slab on this host, which is mapped once and read zero-copy; the slab goes back to its server when
the batch is garbage-collected, or right after a copy into pinned / device memory.
"""
from __future__ import annotations

from ..errors import ClusterError, SampleError
from ..runtime.proto import helix_pb2 as pb
from ..runtime.crosshost import meta_dicts
from ..runtime.merge import merge_batches
from ..runtime.tensors import copy_tensors, read_tensors, unflatten
from ..protocol import ErrorKind

__all__ = ["ReplyBatches"]


class ReplyBatches:
    """A ``ClusterClient``'s replies to batches (its ``reader`` maps the slabs)."""

    def materialize(self, reply: pb.ExecuteReply, copy: bool, pad: bool = True):
        """The batch of a successful reply: zero-copy tensors on the slab (released when the last
        one is garbage-collected), or owned copies (slab released at once) when ``copy``. A batch
        that came in pieces (split among a server's workers) is merged, as collating it whole
        (``pad=False``: pieces whose tensors differ in shape raise, as ``default_collate`` would)."""
        if reply.pieces:
            try:
                parts = [self._materialize(b, copy=False) for b in reply.pieces]
            except BaseException:
                self.release(reply)  # the pieces not read yet would be stranded
                raise
            return merge_batches(parts, rows=list(reply.piece_rows), pad=pad)
        return self._materialize(reply.batch, copy)

    def _materialize(self, b: pb.BatchHandle, copy: bool):
        handle = {"segment": b.slab.segment, "generation": b.slab.generation, "nbytes": b.slab.nbytes}
        if b.tree_pickle and not self.pickle_allowed:
            self.reader.release(handle)
            raise ClusterError("a DataServer sent a pickled batch structure to a client that accepts none (a cluster "
                               "reached without TLS beyond loopback, or ClusterConfig(allow_pickle=False))")
        metas = meta_dicts(b.tensors)
        buf = self.reader.view(handle) if b.slab.segment else memoryview(b"")
        if copy:
            tensors = copy_tensors(buf, metas)
            del buf
            self.reader.release(handle)
        else:
            release = (lambda h=handle, r=self.reader: r.release(h))
            tensors = read_tensors(buf, metas, on_release=release)
            del buf
        return unflatten(b.tree_json, b.tree_pickle, tensors)

    def release(self, reply: pb.ExecuteReply) -> None:
        """Give a reply's slabs back unread (its request was cancelled)."""
        for b in (reply.batch, *reply.pieces):
            if b.slab.segment:
                self.reader.release({"segment": b.slab.segment, "generation": b.slab.generation})

    @staticmethod
    def error_of(reply: pb.ExecuteReply) -> Exception | None:
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
