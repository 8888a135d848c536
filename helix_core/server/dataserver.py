"""The DataServer itself: what it does with a call, apart from the gRPC that carries it.

A local server delivers by shared memory: an executed batch stays in the slab a worker wrote, and
the reply names it. A remote ("sidecar") server always sends its batch on — header (structure and
tensor metadata, small tensors inline), then the raw bytes — to the rank's local DataServer, which
takes them into one of its own slabs and returns the handle (``wire/delivery.py``: by the bulk
path, straight into the slab, or by gRPC's ``Deliver`` stream) — so the client always maps local
shared memory; ``cross_ds_bytes`` counts what moved.

``DataServer`` owns the slabs' lifetime on the way out: a batch whose client gave up, or that
landed just after its wait ended, is released here, since no reply will name it to anyone. It
speaks the wire's own types where its parts already do (a delivery's header, Tier 2's requests),
and refuses a call by raising ``Rejected``; ``service.py`` turns both into gRPC.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable

from helix_core.config import ClusterConfig
from helix_core.errors import PICKLING, ClusterError
from helix_core.memory import shm
from helix_core.memory.reader import SlabReader
from helix_core.memory.slabpool import SlabPool
from helix_core.server.heartbeats import Beats
from helix_core.server.pool import WorkerPool
from helix_core.server.worker import TaskResult
from helix_core.tier2.crosshost import CrossHostMover, HostMember
from helix_core.tier2.leader import RoundTable, bad_timeout
from helix_core.wire.bulk.protocol import NO_ROOM
from helix_core.wire.chunks import ChunkWriter
from helix_core.wire.delivery import DeliveryFailed, Inbound, Outbound, Refused, moved_bytes
from helix_core.wire.messages import ErrorKind, slab_handle
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["DataServer", "Executed", "Rejected"]


class Rejected(Exception):
    """A call this DataServer will not serve. ``reason``: ``"invalid"`` (bad arguments),
    ``"precondition"`` (not configured), ``"denied"`` (not allowed here), ``"no_room"`` (no slab
    free) or ``"aborted"`` (a peer or slab gone mid-call); the message says why."""

    REASONS = ("invalid", "precondition", "denied", "no_room", "aborted")

    def __init__(self, reason: str, message: str):
        if reason not in self.REASONS:
            raise ValueError(f"Rejected(reason={reason!r}): valid reasons are {', '.join(self.REASONS)}")
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Executed:
    """What one ``Execute`` came to. ``result``: the task's result as ``WorkerPool`` returns it
    (error fields, timings, features; ``pieces`` where stealing split it), an empty ``TaskResult``
    when it never came. ``error_kind`` / ``error``: set where this server's own part failed (the
    wait, the delivery on), overriding the result's. The batch is ``local`` (a result naming this
    server's slab) or ``remote`` (the ``BatchHandle`` a delivery server replied with), or neither.
    ``cross_ds_bytes``: bytes sent on to the delivery server."""

    result: TaskResult
    error_kind: int | None = None
    error: str = ""
    local: TaskResult | None = None
    remote: pb.BatchHandle | None = None
    delivered_by: str = ""
    cross_ds_bytes: int = 0


class DataServer:
    """A DataServer's work: Configure, Execute (and where its batch goes), Deliver, Cancel,
    Tier 2's rounds and exchange, and its stats. ``pool`` and ``slabs`` are the caller's (it closes
    them); the parts built here go with ``close``. ``pickle_allowed`` defaults to: only with a
    token. ``commit``: Tier 2 records a moved round there before a rank sees it (``RoundTable``).
    ``server_id`` is the Coordinator's name for it, known once it registered (``registered``)."""

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
        cluster_id: str = "",
        commit=None,
    ):
        self.pool, self.slabs, self.config, self.token = pool, slabs, config, token
        self.address, self.kind, self.tls, self.cluster_id = address, kind, tls, cluster_id
        self.pickle_allowed = bool(token) if pickle_allowed is None else pickle_allowed
        self.server_id = ""
        # maps of the workers' slabs, kept: they are reused, so a delivery never re-faults their pages
        self.reader = SlabReader()
        self.outbound = Outbound(token, config, tls, self.reader)  # remote: batches on to delivery servers
        self.inbound = Inbound(slabs, self.pickle_allowed, self.no_pickle_why(), lambda: self.server_id)
        self.beats = Beats(config)  # work that arrives wakes an idle server's heartbeats
        # Tier 2: its part in moving rows between hosts, and the rounds it leads
        self.member = HostMember(
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
            mover=CrossHostMover(self.member, token, config, tls),
            address=address,
            host=host_id,
            commit=commit,
            max_held=max(1, config.server_threads // 2),
        )

    def registered(self, server_id: str) -> None:
        """The Coordinator's name for this server, from its (re-)registration."""
        self.server_id = server_id

    def no_pickle_why(self) -> str:
        return (
            "runs with ClusterConfig(allow_pickle=False)"
            if not self.config.allow_pickle
            else "listens beyond loopback without TLS (--insecure)"
        )

    def configure(self, spec_id: str, payload: bytes, fmt: str) -> None:
        """Hold a dataset spec (``fmt``: ``json`` or ``cloudpickle``) for the Executes that name it."""
        if fmt == "cloudpickle" and not self.pickle_allowed:
            raise Rejected("denied", f"pickled dataset specs need {PICKLING}; this DataServer {self.no_pickle_why()}")
        if fmt == "json":
            try:
                spec = json.loads(payload)
                assert isinstance(spec["dataset"]["target"], str)
            except Exception:
                raise Rejected("invalid", "dataset spec is not valid Helix JSON") from None
        elif fmt != "cloudpickle":
            raise Rejected("invalid", f"spec format {fmt!r}; valid: json, cloudpickle")
        self.pool.configure(spec_id, payload, fmt)

    def execute(self, task: dict, deliver_to: str, call) -> Executed:
        """Run ``task`` (``WorkerPool``'s task dict, as the request gave it) and deliver its batch:
        here, or on to ``deliver_to`` when that is another server. ``call`` is the caller's call
        (gRPC's context, or a local link's): ``add_callback`` cancels the task if it ends first,
        ``time_remaining`` bounds the wait, ``is_active`` says whether anyone will read the reply."""
        self.beats.kick()
        if not self.pool.knows(task["spec_id"]):
            raise Rejected("precondition", f"unknown dataset spec {task['spec_id']}: Configure first")
        if task["on_error"] not in ("raise", "skip") or not task["indices"]:
            raise Rejected("invalid", "Execute needs indices and on_error in (raise, skip)")
        remote = bool(deliver_to) and deliver_to != self.address
        # pieces are delivered here only, and substitutes (on_error="skip") belong to one worker;
        # the room of the batch's later parts matters only where the rank maps this slab itself
        splittable = task["splittable"] and not remote and not task["substitutes"]
        task = {
            **task,
            "predicted_cpu_s": max(0.0, task["predicted_cpu_s"]),
            "splittable": splittable,
            "room": task["room"] if splittable else [],
        }
        task_id, client_id = task["task_id"], task["client_id"]
        fut = self.pool.submit(task)
        call.add_callback(lambda: self.pool.cancel([task_id], client_id) if not fut.done() else None)
        try:
            # answer before the client's own deadline, or a result that lands just then is dropped
            # with its slab (the client never sees the reply, so nobody releases it)
            remaining = call.time_remaining()
            wait = self.config.execute_timeout_s if remaining is None else max(0.0, remaining - 1.0)
            result = fut.result(timeout=min(self.config.execute_timeout_s, wait))
        except Exception as e:  # cancelled by the client or timed out
            self.pool.cancel([task_id], client_id)
            if fut.done() and not fut.cancelled():  # it landed just as we gave up: nobody will read it
                for handle in fut.result().handles():
                    shm.release_segment(handle)
            return Executed(TaskResult(), ErrorKind.NOT_COMPLETED, repr(e))
        if result.pieces:  # split by stealing (never for a remote delivery)
            if not call.is_active():  # the client gave up: nobody will release them
                for handle in result.handles():
                    shm.release_segment(handle)
            return Executed(result, delivered_by=self.server_id)
        if result.handle is None:
            return Executed(result)
        if not remote:
            if not call.is_active():  # the client gave up: nobody will release it
                shm.release_segment(result.handle)
            return Executed(result, local=result, delivered_by=self.server_id)
        try:
            delivered = self.outbound.send(task_id, result, deliver_to)
        except DeliveryFailed as e:  # it is up but has no room (final), or it is gone (run it elsewhere)
            return Executed(result, ErrorKind.NO_ROOM if e.no_room else ErrorKind.DELIVERY_LOST, str(e))
        finally:
            shm.release_segment(result.handle)  # streamed (or failed): our slab is free again
        if not call.is_active():  # the client gave up: nobody will release it
            shm.release_segment(slab_handle(delivered.batch.slab))
        return Executed(
            result, remote=delivered.batch, delivered_by=delivered.server_id, cross_ds_bytes=moved_bytes(result)
        )

    def take_bulk(self, header: pb.StreamHeader) -> pb.DeliverReply:
        """The bulk listener's way in (``Inbound.bulk``): a delivery, like ``deliver``."""
        self.beats.kick()
        return self.inbound.bulk(header)

    def deliver(self, header: pb.StreamHeader | None, chunks: Iterable) -> pb.DeliverReply:
        """Take a batch another server sends on: ``header`` (a ``StreamHeader``; None: the stream
        did not start with one), then its bytes in ``chunks`` (bytes-like), into one of this
        server's slabs; returns the ``DeliverReply`` naming it."""
        self.beats.kick()
        if header is None:
            raise Rejected("invalid", "a delivery stream starts with a header")
        try:
            slab = self.inbound.take(header)
        except Refused as e:
            raise Rejected("no_room" if e.status == NO_ROOM else "denied", str(e)) from None
        try:
            writer = ChunkWriter(slab.payload, header.total_bytes)
            for chunk in chunks:
                writer.write(chunk)
            if not writer.done:
                raise ValueError(f"stream for task {header.task_id} ended early")
        except Exception as e:
            shm.release_segment(slab.handle(header.total_bytes))
            raise Rejected("invalid", f"bad delivery stream: {e}") from None
        return self.inbound.reply(slab, header)

    def cancel(self, task_ids: list, client_id: str) -> None:
        self.pool.cancel(task_ids, client_id)

    def rebalance(self, request, call):
        """Tier 2: ``request``'s batch into its round, held until the round closes (tier2/leader.py)."""
        why = bad_timeout(request.timeout_s, "RebalanceRequest.timeout_s")
        if why:
            raise Rejected("invalid", why)
        return self.rounds.rebalance(request, call)

    def leave_round(self, request):
        """Tier 2: who owns a batch whose call will not be answered."""
        why = bad_timeout(request.timeout_s, "LeaveRoundRequest.timeout_s")
        if why:
            raise Rejected("invalid", why)
        return self.rounds.leave(request)

    def ask_round(self, request):
        """Tier 2: a rank waits for a batch held in its round."""
        return self.rounds.ask(request)

    def exchange(self, request):
        """Tier 2 across hosts: this host's part of a round (tier2/crosshost.py)."""
        try:
            return self.member.serve(request)
        except (ClusterError, ValueError, OSError) as e:  # a peer gone, a slab reused or gone, bad input
            raise Rejected("aborted", str(e)) from None

    def reclaim(self) -> None:
        """Delivery slabs of clients that died come back; unused ones go."""
        self.slabs.reclaim()

    def stats(self) -> dict:
        """The worker pool's load (``WorkerPool.stats``)."""
        return self.pool.stats()

    def health(self) -> dict:
        """This server's health, as ``HealthReply``'s fields."""
        st = self.pool.stats()
        return {
            "server_id": self.server_id,
            "workers_alive": st["workers_alive"],
            "queue_depth": st["queue_depth"],
            "serving": st["workers_alive"] > 0,
            "worker_pids": st["worker_pids"],
            "pid": os.getpid(),
            "inflight": st["inflight"],
        }

    def close(self) -> None:
        """Close what it built (its channels on, Tier 2's rounds, its slab maps); not the pool
        nor the slabs, which are its caller's. After the calls stopped coming."""
        self.beats.close()
        self.outbound.close()
        self.rounds.close()
        self.reader.close()
