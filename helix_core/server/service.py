"""The DataServer: a gRPC service in front of a supervised worker pool (the payload plane).

A local server delivers by shared memory: the reply to ``Execute`` is a small handle naming a slab that a
worker wrote. A remote ("sidecar") server always sends its batch on — header (structure and tensor metadata,
small tensors inline), then the raw bytes — to the rank's local DataServer, which takes them into one of its
own slabs and returns the handle (``wire/delivery.py``: by the bulk path, straight into the slab, or by
gRPC's ``Deliver`` stream) — so the client always maps local shared memory; ``cross_ds_bytes`` counts what moved.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading

import grpc

from helix_core.config import PROTOCOL_VERSION, ClusterConfig
from helix_core.errors import PICKLING, ClusterError, text_of
from helix_core.memory import shm
from helix_core.memory.reader import SlabReader
from helix_core.memory.slabpool import SlabPool
from helix_core.security.auth import call_metadata
from helix_core.server.cpuslots import HostSlots
from helix_core.server.heartbeats import Beats, heartbeats
from helix_core.server.pool import WorkerPool
from helix_core.server.steal import handles
from helix_core.tier2.crosshost import ExchangeMember, HostExchange, load_row_code
from helix_core.tier2.leader import RoundTable, bad_timeout
from helix_core.wire.bulk.protocol import NO_ROOM
from helix_core.wire.bulk.recv import BulkListener
from helix_core.wire.chunks import ChunkWriter
from helix_core.wire.delivery import DeliveryFailed, Inbound, Outbound, Refused, metas_to_pb, moved_bytes
from helix_core.wire.frames import add_servicer
from helix_core.wire.locallink.link import link_name
from helix_core.wire.locallink.server import LocalListener
from helix_core.wire.messages import ErrorKind
from helix_core.wire.proto import helix_pb2 as pb
from helix_core.wire.proto import helix_pb2_grpc as pbg
from helix_core.wire.rpc import connect

__all__ = ["DataServerServicer", "serve_dataserver"]

log = logging.getLogger("helix.dataserver")


def _batch_pb(result: dict) -> pb.BatchHandle:
    return pb.BatchHandle(
        slab=pb.SlabHandle(**result["handle"]),
        tree_json=result["tree_json"],
        tree_pickle=result["tree_pickle"],
        tensors=metas_to_pb(result["metas"]),
    )


def _release_reply(reply: pb.ExecuteReply) -> None:
    """Free the slabs a reply names that will never reach its client."""
    for b in (reply.batch, *reply.pieces):
        if b.slab.segment:  # (an unset batch names none)
            shm.release_segment({"segment": b.slab.segment, "generation": b.slab.generation})


def _failure_pb(f: dict | None) -> pb.SampleFailure | None:
    return None if not f else pb.SampleFailure(index=f["index"], path=text_of(f["path"]), cause=text_of(f["cause"]))


class DataServerServicer(pbg.DataServerServicer):
    """Thin: converts messages, submits to the ``WorkerPool``, streams remote results."""

    def __init__(
        self,
        pool: WorkerPool,
        slabs: SlabPool,
        config: ClusterConfig,
        token: str | None,
        address: str,
        kind: str,
        tls=None,
        pickle_allowed: bool | None = None,
        host_id: str = "",
    ):
        self.pool, self.slabs, self.config, self.token = pool, slabs, config, token
        self.address, self.kind, self.tls = address, kind, tls
        self.pickle_allowed = bool(token) if pickle_allowed is None else pickle_allowed
        self.server_id, self.cluster_id, self.bulk_port = "", "", 0  # bulk_port: the bulk listener's (0: none)
        # maps of the workers' slabs, kept: they are reused, so a delivery never re-faults their pages
        self.reader = SlabReader()
        self.outbound = Outbound(token, config, tls, self.reader)  # remote: batches on to delivering servers
        self.inbound = Inbound(slabs, self.pickle_allowed, self._no_pickle_why(), lambda: self.server_id)
        self.beats = Beats(config)  # work that arrives wakes an idle server's heartbeats
        # Tier 2: its part in moving rows between hosts, and the rounds it leads
        self.member = ExchangeMember(
            self.reader,
            self.inbound,
            self.outbound,
            self.pickle_allowed,
            address.rsplit(":", 1)[0].strip("[]"),
            secure=tls is not None,
        )
        # held Rebalance calls take at most half the handler threads: control RPCs always find one
        self.rounds = RoundTable(
            self.pickle_allowed,
            exchange=HostExchange(self.member, token, config, tls),
            address=address,
            host=host_id,
            max_held=max(1, config.server_threads // 2),
        )

    def _no_pickle_why(self) -> str:
        return (
            "runs with ClusterConfig(allow_pickle=False)"
            if not self.config.allow_pickle
            else "listens beyond loopback without TLS (--insecure)"
        )

    def Hello(self, request, context):
        return pb.HelloReply(
            protocol_version=PROTOCOL_VERSION,
            cluster_id=self.cluster_id,
            pickle_allowed=self.pickle_allowed,
            bulk_port=self.bulk_port,
        )

    def Configure(self, request, context):
        if request.format == "cloudpickle" and not self.pickle_allowed:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"pickled dataset specs need {PICKLING}; this DataServer {self._no_pickle_why()}",
            )
        if request.format == "json":
            try:
                spec = json.loads(request.payload)
                assert isinstance(spec["dataset"]["target"], str)
            except Exception:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "dataset spec is not valid Helix JSON")
        elif request.format != "cloudpickle":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"spec format {request.format!r}; valid: json, cloudpickle")
        self.pool.configure(request.spec_id, request.payload, request.format)
        return pb.Ack(ok=True)

    def Execute(self, request, context):
        self.beats.kick()
        if not self.pool.knows(request.spec_id):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"unknown dataset spec {request.spec_id}: Configure first"
            )
        if request.on_error not in ("raise", "skip") or not request.indices:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Execute needs indices and on_error in (raise, skip)")
        remote = bool(request.deliver_to) and request.deliver_to != self.address
        task = {
            "task_id": request.task_id,
            "client_id": request.client_id,
            "spec_id": request.spec_id,
            "indices": list(request.indices),
            "epoch": request.epoch,
            "substitutes": list(request.substitutes),
            "on_error": request.on_error,
            "deadline_s": request.deadline_s if request.has_deadline else None,
            "predicted_cpu_s": max(0.0, request.predicted_cpu_s),
            # pieces are delivered here only, and substitutes (on_error="skip") belong to one worker
            "splittable": request.splittable and not remote and not request.substitutes,
            "features": request.features,
            # the room of the batch's later parts: only where the rank maps this slab itself
            "room": list(request.room) if request.splittable and not remote and not request.substitutes else [],
        }
        fut = self.pool.submit(task)
        context.add_callback(lambda: self.pool.cancel([request.task_id], request.client_id) if not fut.done() else None)
        try:
            # answer before the client's own deadline, or a result that lands just then is dropped
            # with its slab (the client never sees the reply, so nobody releases it)
            remaining = context.time_remaining()
            wait = self.config.execute_timeout_s if remaining is None else max(0.0, remaining - 1.0)
            result = fut.result(timeout=min(self.config.execute_timeout_s, wait))
        except Exception as e:  # cancelled by the client or timed out
            self.pool.cancel([request.task_id], request.client_id)
            if fut.done() and not fut.cancelled():  # it landed just as we gave up: nobody will read it
                for handle in handles(fut.result()):
                    shm.release_segment(handle)
            return pb.ExecuteReply(task_id=request.task_id, error_kind=ErrorKind.NOT_COMPLETED, error=repr(e))
        reply = pb.ExecuteReply(
            task_id=request.task_id,
            error_kind=result.get("error_kind", ErrorKind.NONE),
            error=text_of(result.get("error", "")),
            failure=_failure_pb(result.get("failure")),
            skipped=[_failure_pb(f) for f in result.get("skipped", [])],
            exec_s=result.get("exec_s", 0.0),
            decoded=result.get("decoded", ()),
            decode_cpu_s=result.get("decode_cpu_s", ()),
            queue_s=result.get("queue_s", 0.0),
            features_json=json.dumps(result["features"]) if "features" in result else "",
        )
        if "pieces" in result:  # split by stealing (never for a remote delivery)
            reply.pieces.extend(_batch_pb(p) for p in result["pieces"])
            reply.piece_rows.extend(result["rows"])
            reply.delivered_by = self.server_id
            if not context.is_active():  # the client gave up: nobody will release them
                for handle in handles(result):
                    shm.release_segment(handle)
            return reply
        if "handle" not in result:
            return reply
        if remote:
            try:
                delivered = self.outbound.send(request.task_id, result, request.deliver_to)
            except DeliveryFailed as e:  # it is up but has no room (final), or it is gone (run it elsewhere)
                reply.error_kind = ErrorKind.NO_ROOM if e.no_room else ErrorKind.DELIVERY_LOST
                reply.error = str(e)
                return reply
            finally:
                shm.release_segment(result["handle"])  # streamed (or failed): our slab is free again
            reply.batch.CopyFrom(delivered.batch)
            reply.delivered_by = delivered.server_id
            reply.cross_ds_bytes = moved_bytes(result)
        else:
            reply.batch.CopyFrom(_batch_pb(result))
            reply.delivered_by = self.server_id
        if not context.is_active():  # the client gave up: nobody will release it
            shm.release_segment(
                result["handle"]
                if not remote
                else {"segment": reply.batch.slab.segment, "generation": reply.batch.slab.generation}
            )
        return reply

    def take_bulk(self, header: pb.StreamHeader):
        """The bulk listener's way in (``Inbound.bulk``): a delivery, like ``Deliver``."""
        self.beats.kick()
        return self.inbound.bulk(header)

    def Deliver(self, request_iterator, context):
        self.beats.kick()
        first = next(request_iterator, None)  # chunks come as runtime.wire.decode_chunk makes them
        if not isinstance(first, pb.StreamChunk) or first.WhichOneof("part") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a delivery stream starts with a header")
        h = first.header
        try:
            slab = self.inbound.take(h)
        except Refused as e:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED if e.status == NO_ROOM else grpc.StatusCode.PERMISSION_DENIED, str(e)
            )
        try:
            writer = ChunkWriter(slab.payload, h.total_bytes)
            for chunk in request_iterator:
                writer.write(chunk if isinstance(chunk, memoryview) else chunk.data)
            if not writer.done:
                raise ValueError(f"stream for task {h.task_id} ended early")
        except Exception as e:
            shm.release_segment(slab.handle(h.total_bytes))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad delivery stream: {e}")
        return self.inbound.reply(slab, h)

    def Cancel(self, request, context):
        self.pool.cancel(list(request.task_ids), request.client_id)
        return pb.Ack(ok=True)

    def Rebalance(self, request, context):  # Tier 2: held until the round closes (tier2/leader.py)
        why = bad_timeout(request.timeout_s, "RebalanceRequest.timeout_s")
        if why:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        return self.rounds.rebalance(request, context)

    def LeaveRound(self, request, context):  # Tier 2: who owns a batch whose call will not be answered
        why = bad_timeout(request.timeout_s, "LeaveRoundRequest.timeout_s")
        if why:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        return self.rounds.leave(request)

    def AskRound(self, request, context):  # Tier 2: a rank waits for a batch held in its round
        return self.rounds.ask(request)

    def Exchange(self, request, context):  # Tier 2 across hosts: this host's part of a round (tier2/crosshost.py)
        try:
            return self.member.serve(request)
        except (ClusterError, ValueError, OSError) as e:  # a peer gone, a slab reused or gone, bad input
            context.abort(grpc.StatusCode.ABORTED, str(e))

    def Health(self, request, context):
        st = self.pool.stats()
        return pb.HealthReply(
            server_id=self.server_id,
            workers_alive=st["workers_alive"],
            queue_depth=st["queue_depth"],
            serving=st["workers_alive"] > 0,
            worker_pids=st["worker_pids"],
            pid=os.getpid(),
            inflight=st["inflight"],
        )


def serve_dataserver(
    coordinator: str,
    kind: str,
    local_rank: int,
    workers: int,
    token: str | None,
    config: ClusterConfig,
    stop: threading.Event,
    host: str = "127.0.0.1",
    port: int = 0,
    on_ready=None,
    host_id: str | None = None,
    tls=None,
    insecure: bool = False,
    advertise: str | None = None,
) -> None:
    """Run a DataServer until ``stop`` is set (blocking): serve, register, heartbeat. ``host``:
    the address to listen on; ``host_id``: this host's identity (default ``hostid.host_id()``);
    ``tls``: a ``Tls`` for its port and its channels; ``insecure``: beyond loopback without TLS;
    ``advertise``: the name peers dial it by (default ``host``, or the FQDN when ``host`` is a wildcard)."""
    from helix_core.security.auth import is_loopback, pickle_allowed
    from helix_core.security.hostid import host_id as this_host
    from helix_core.security.listeners import check_listener as check_coordinator
    from helix_core.security.tokenfiles import token_path
    from helix_core.wire.rpc import check_hello, create_server

    check_coordinator(coordinator)  # never this user's token to another user's port
    if not token:
        raise ValueError(
            f"no token for the Coordinator at {coordinator}: pass --token-file FILE or set HELIX_TOKEN "
            f"(a Coordinator this user started on this machine leaves it in {token_path(coordinator)})"
        )
    host_id = this_host(host_id)
    if not is_loopback(host):  # reachable from other hosts: Tier-2 rows may cross (torch), loaded before it serves
        load_row_code()  # (in the background it held the GIL for seconds: heartbeats missed, the server marked dead)
    server, bound = create_server(host, port, token, config, threads=config.server_threads, tls=tls, insecure=insecure)
    allow_pickle = pickle_allowed(host, token, tls, config.allow_pickle)
    coord_channel = connect(coordinator, config, tls, keepalive=False)  # heartbeats: short calls with deadlines
    coord = pbg.CoordinatorStub(coord_channel)
    hello = check_hello(coord, "dataserver", token, config.rpc_timeout_s, f"the Coordinator at {coordinator}", tls)
    # bound to every interface: peers need a name that reaches this machine, not the wildcard
    address = f"{advertise or (socket.getfqdn() if host in ('0.0.0.0', '::', '') else host)}:{bound}"
    tag = f"{kind[0]}{local_rank if kind == 'local' else ''}p{os.getpid()}-"
    slabs = SlabPool(
        f"helix-{hello.cluster_id}-{tag}d-",
        orphan_s=config.execute_timeout_s + config.rpc_timeout_s,
        idle_s=config.slab_idle_s,
    )
    slots = config.decode_slots or os.cpu_count() or 1  # one decode per core, across the host's servers
    host_slots = HostSlots(f"helix-{hello.cluster_id}-cpu")  # the last server of the host unlinks them
    try:
        pool = WorkerPool(
            workers,
            f"helix-{hello.cluster_id}-{tag}",
            allow_pickle=allow_pickle,
            config=config,
            cpu_slots=(f"helix-{hello.cluster_id}-cpu", slots),
        )
    except BaseException:
        host_slots.close()
        raise
    servicer = DataServerServicer(pool, slabs, config, token, address, kind, tls, allow_pickle, host_id)
    servicer.cluster_id = hello.cluster_id

    def commit_round(group: str, run: str, step: int, moved: dict, release: dict, age_s: float) -> bool:
        # (a port another user took once the Coordinator stopped gets no token: rpc.connect's guard)
        ranks = [
            pb.RankSamples(
                rank=r, indices=v, release=[pb.SlabHandle(segment=s, generation=g) for s, g in release.get(r, ())]
            )
            for r, v in moved.items()
        ]
        return coord.CommitRound(
            pb.CommitRoundRequest(group=group, run=run, step=step, ranks=ranks, age_s=age_s),
            timeout=config.rpc_timeout_s,
            metadata=call_metadata(token),
        ).committed

    servicer.rounds.commit = commit_round  # Tier 2: a moved round is recorded before a rank sees it
    # a local server takes remote batches by the bulk path too, on the host it serves gRPC on
    bulk = (
        BulkListener(host, token, config, tls, servicer.take_bulk) if kind == "local" and config.bulk_delivery else None
    )
    servicer.bulk_port = bulk.port if bulk is not None else 0
    link = None  # the ranks of its host send Execute over a Unix socket (the bulk of its calls)
    if kind == "local" and config.local_link:
        try:
            link = LocalListener(
                link_name(hello.cluster_id, address),
                token,
                servicer.Execute,
                config.execute_timeout_s,
                config.server_threads,
                unsent=_release_reply,
            )
        except OSError as e:  # its name taken: the ranks use gRPC
            log.warning("no local link for the DataServer at %s: %s", address, e)
    add_servicer(servicer, server)  # the generated registration, with zero-copy Deliver chunks
    server.start()

    def register():
        reply = coord.RegisterServer(
            pb.RegisterServerRequest(address=address, kind=kind, local_rank=local_rank, host=host_id, workers=workers),
            timeout=config.rpc_timeout_s,
            metadata=call_metadata(token),
        )
        servicer.server_id = reply.server_id

    try:
        register()
        hb = threading.Thread(
            target=heartbeats,
            args=(servicer, coord, token, config, stop, register),
            name="helix-heartbeat",
            daemon=True,
        )
        hb.start()
        if on_ready is not None:
            on_ready(address, servicer.server_id, hello.cluster_id)
        while not stop.wait(30.0):  # woken by stop (a signal handler sets it); the timeout is only a backstop
            pass
    finally:
        servicer.beats.close()
        server.stop(grace=min(1.0, config.stop_timeout_s)).wait(config.stop_timeout_s)
        if bulk is not None:
            bulk.close()
        if link is not None:
            link.close()
        servicer.outbound.close()
        servicer.rounds.close()
        pool.close()
        slabs.close()
        servicer.reader.close()
        shm.sweep(f"helix-{hello.cluster_id}-{tag}")
        host_slots.close()
