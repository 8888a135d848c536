"""The DataServer's gRPC adapter: each RPC unpacks its request, calls ``DataServer``
(``dataserver.py``), and packs the reply; a ``Rejected`` call goes back as its status code.

The local link (``wire/locallink``) calls ``Execute`` here too, with a context of its own, and
frees the slabs of a reply it could not send with ``release_unsent``.
"""

from __future__ import annotations

import json

import grpc

from helix_core.config import PROTOCOL_VERSION
from helix_core.errors import text_of
from helix_core.memory import shm
from helix_core.server.dataserver import DataServer, Executed, Rejected
from helix_core.server.worker import SampleFailure, TaskResult
from helix_core.wire.messages import metas_to_pb, slab_handle, slab_handle_pb
from helix_core.wire.proto import helix_pb2 as pb
from helix_core.wire.proto import helix_pb2_grpc as pbg

__all__ = ["DataServerServicer", "release_unsent"]

_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "denied": grpc.StatusCode.PERMISSION_DENIED,
    "no_room": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "aborted": grpc.StatusCode.ABORTED,
}


def _batch_pb(result: TaskResult) -> pb.BatchHandle:
    return pb.BatchHandle(
        slab=slab_handle_pb(result.handle),
        tree_json=result.tree_json,
        tree_pickle=result.tree_pickle,
        tensors=metas_to_pb(result.metas),
    )


def _failure_pb(f: SampleFailure | None) -> pb.SampleFailure | None:
    return None if f is None else pb.SampleFailure(index=f.index, path=text_of(f.path), cause=text_of(f.cause))


def _task(request: pb.ExecuteRequest) -> dict:
    """The request as ``WorkerPool``'s task dict (``DataServer.execute`` settles what depends on
    where the batch goes: ``splittable``, ``room``)."""
    return {
        "task_id": request.task_id,
        "client_id": request.client_id,
        "spec_id": request.spec_id,
        "indices": list(request.indices),
        "epoch": request.epoch,
        "substitutes": list(request.substitutes),
        "on_error": request.on_error,
        "deadline_s": request.deadline_s if request.has_deadline else None,
        "predicted_cpu_s": request.predicted_cpu_s,
        "splittable": request.splittable,
        "features": request.features,
        "room": list(request.room),
    }


def _execute_reply(task_id: int, done: Executed) -> pb.ExecuteReply:
    result = done.result
    reply = pb.ExecuteReply(
        task_id=task_id,
        error_kind=result.error_kind if done.error_kind is None else done.error_kind,
        error=text_of(result.error) if done.error_kind is None else done.error,
        failure=_failure_pb(result.failure),
        skipped=[_failure_pb(f) for f in result.skipped],
        exec_s=result.exec_s,
        decoded=result.decoded,
        decode_cpu_s=result.decode_cpu_s,
        queue_s=result.queue_s,
        features_json=json.dumps(result.features) if result.features is not None else "",
        delivered_by=done.delivered_by,
        cross_ds_bytes=done.cross_ds_bytes,
    )
    if result.pieces:
        reply.pieces.extend(_batch_pb(p) for p in result.pieces)
        reply.piece_rows.extend(p.rows for p in result.pieces)
    if done.local is not None:
        reply.batch.CopyFrom(_batch_pb(done.local))
    elif done.remote is not None:
        reply.batch.CopyFrom(done.remote)
    return reply


def release_unsent(reply: pb.ExecuteReply) -> None:
    """Free the slabs a reply names that will never reach its client."""
    for b in (reply.batch, *reply.pieces):
        if b.slab.segment:  # (an unset batch names none)
            shm.release_segment(slab_handle(b.slab))


class DataServerServicer(pbg.DataServerServicer):
    """Thin: converts messages and calls ``server``. ``bulk_port``: the bulk listener's, which
    ``Hello`` offers (0: none)."""

    def __init__(self, server: DataServer, bulk_port: int = 0):
        self.server, self.bulk_port = server, bulk_port

    @staticmethod
    def _abort(context, e: Rejected):
        context.abort(_STATUS[e.reason], str(e))

    def Hello(self, request, context):
        return pb.HelloReply(
            protocol_version=PROTOCOL_VERSION,
            cluster_id=self.server.cluster_id,
            pickle_allowed=self.server.pickle_allowed,
            bulk_port=self.bulk_port,
        )

    def Configure(self, request, context):
        try:
            self.server.configure(request.spec_id, request.payload, request.format)
        except Rejected as e:
            self._abort(context, e)
        return pb.Ack(ok=True)

    def Execute(self, request, context):
        try:
            done = self.server.execute(_task(request), request.deliver_to, context)
        except Rejected as e:
            self._abort(context, e)
        return _execute_reply(request.task_id, done)

    def Deliver(self, request_iterator, context):
        first = next(request_iterator, None)  # chunks come as wire.frames.decode_chunk makes them
        header = first.header if isinstance(first, pb.StreamChunk) and first.WhichOneof("part") == "header" else None
        chunks = (c if isinstance(c, memoryview) else c.data for c in request_iterator)
        try:
            return self.server.deliver(header, chunks)
        except Rejected as e:
            self._abort(context, e)

    def Cancel(self, request, context):
        self.server.cancel(list(request.task_ids), request.client_id)
        return pb.Ack(ok=True)

    def Rebalance(self, request, context):
        try:
            return self.server.rebalance(request, context)
        except Rejected as e:
            self._abort(context, e)

    def LeaveRound(self, request, context):
        try:
            return self.server.leave_round(request)
        except Rejected as e:
            self._abort(context, e)

    def AskRound(self, request, context):
        return self.server.ask_round(request)

    def Exchange(self, request, context):
        try:
            return self.server.exchange(request)
        except Rejected as e:
            self._abort(context, e)

    def Health(self, request, context):
        return pb.HealthReply(**self.server.health())
