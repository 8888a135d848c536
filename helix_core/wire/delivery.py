"""Payload between DataServers: a sidecar's batch into the rank's delivery server.

``Outbound``, on the executing server, sends a worker's batch by the bulk path when the delivering
server offers one (``wire/bulk/common.py``: straight into its slab, a fraction of gRPC's receive CPU)
and by gRPC's ``Deliver`` stream otherwise — or when the bulk connection cannot even be made — and
keeps what placement prices (paper Eq. 1's C_net: the link's bandwidth and a small transfer's
latency) and the bytes it moved. ``Inbound``, on the delivery server, takes a batch into one of
its slabs under the same rules on both paths: no pickled structure where the server takes no
pickles, and a full ``/dev/shm`` refused (never SIGBUS).
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from helix_core.config import PROTOCOL_VERSION
from helix_core.errors import PICKLING
from helix_core.memory import shm
from helix_core.memory.slabpool import SlabPool
from helix_core.security.auth import call_metadata
from helix_core.wire.bulk.protocol import MAX_HEADER, NO_ROOM, OK, REFUSED, BulkError
from helix_core.wire.bulk.send import BulkSender
from helix_core.wire.chunks import iter_chunks
from helix_core.wire.frames import deliver_callable
from helix_core.wire.messages import metas_to_pb, slab_handle_pb
from helix_core.wire.proto import helix_pb2 as pb
from helix_core.wire.proto import helix_pb2_grpc as pbg
from helix_core.wire.rpc import connect

log = logging.getLogger("helix.delivery")
_BULK_RETRY_S = 60.0  # a bulk port that could not be reached is tried again after this

__all__ = ["DeliveryFailed", "Inbound", "Outbound", "Refused", "moved_bytes"]


def moved_bytes(result) -> int:
    """What a delivery of ``result`` (a worker's batch, as ``Outbound.send`` takes it) moves between
    servers: the payload plus the small tensors sent inline, in bytes."""
    return result.handle.nbytes + sum(len(m.get("inline_data") or b"") for m in result.metas)


class DeliveryFailed(Exception):
    """The batch did not reach the delivery server: it has no room (final) or is gone / refused."""

    def __init__(self, message: str, no_room: bool = False):
        super().__init__(message)
        self.no_room = no_room


class Refused(Exception):
    """``Inbound`` will not take a batch: ``status`` is ``bulk.NO_ROOM`` or ``bulk.REFUSED``."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class Outbound:
    """The executing side. ``reader`` maps the workers' slabs (``SlabReader``)."""

    def __init__(self, token: str | None, config, tls, reader):
        self.token, self.config, self.tls, self.reader = token, config, tls, reader
        self._sender = BulkSender(token, config, tls) if config.bulk_delivery and token else None
        self._peers: dict[str, tuple] = {}  # address -> (Deliver callable, bulk port or 0, channel)
        self._bulk_off: dict[str, float] = {}  # address -> monotonic time until which its bulk port is not tried
        self._lock = threading.Lock()
        self.cross_ds_bytes = 0  # payload bytes moved to other servers, by either path
        self.bulk_bytes = 0  # ... of them by the bulk path
        self.link_bandwidth_bps = 0.0  # EWMA over deliveries of >= 1 MiB
        self.link_latency_s = 0.0  # EWMA of small deliveries' duration

    def _peer(self, address: str) -> tuple:
        with self._lock:
            peer = self._peers.get(address)
        if peer is None:
            channel = connect(address, self.config, self.tls)
            port = 0
            if self._sender is not None:  # the peer's bulk port, once (0: it offers none)
                try:  # as long as keepalive gives a peer: a stopped one costs no more here than on a call
                    hello = pbg.DataServerStub(channel).Hello(
                        pb.HelloRequest(protocol_version=PROTOCOL_VERSION, role="dataserver"),
                        timeout=self.config.keepalive_s + self.config.keepalive_timeout_s,
                        metadata=call_metadata(self.token),
                    )
                except grpc.RpcError as e:
                    channel.close()
                    raise DeliveryFailed(f"delivery server {address}: {e.code().name} {e.details()}") from None
                port = hello.bulk_port
            with self._lock:
                peer = self._peers.setdefault(address, (deliver_callable(channel), port, channel))
            if peer[2] is not channel:  # another thread connected first
                channel.close()
        return peer

    def channel(self, address: str) -> grpc.Channel:
        """The channel to the server at ``address`` (made once)."""
        return self._peer(address)[2]

    def send(self, task_id: int, result, address: str) -> pb.DeliverReply:
        """Deliver a worker's batch to ``address``. ``result`` (the server's ``TaskResult``) names
        it: its ``handle`` (``SlabHandle``), ``tree_json`` / ``tree_pickle`` and tensors' ``metas``."""
        header = pb.StreamHeader(
            task_id=task_id,
            tree_json=result.tree_json,
            tree_pickle=result.tree_pickle,
            tensors=metas_to_pb(result.metas),
            total_bytes=result.handle.nbytes,
        )
        payload = self.reader.view(result.handle)
        try:
            return self.push(header, payload, address)
        finally:
            payload.release()

    def push(self, header: pb.StreamHeader, payload: memoryview, address: str) -> pb.DeliverReply:
        """A batch given as its header and raw payload into a slab of the server at ``address``."""
        deliver, port, _ = self._peer(address)
        total = header.total_bytes
        t0, reply, bulk = time.perf_counter(), None, False
        # (a header over the bulk path's bound, rare: many small tensors inline, goes by gRPC alone)
        if port and time.monotonic() >= self._bulk_off.get(address, 0.0) and header.ByteSize() <= MAX_HEADER:
            try:
                reply, bulk = self._sender.send(address.rsplit(":", 1)[0].strip("[]"), port, header, payload), True
            except BulkError as e:
                if e.status is not None or e.connected:  # refused, or lost mid-transfer: final here
                    raise DeliveryFailed(f"delivery server {address}: {e}", no_room=e.status == NO_ROOM) from None
                # the bulk connection could not be made (a firewall, full slots, TLS): gRPC's own
                # channel decides, and for a while every batch to this peer goes that way at once
                self._bulk_off[address] = time.monotonic() + _BULK_RETRY_S
                log.warning(
                    "bulk path to %s unavailable (%s): delivering by gRPC for %.0f s", address, e, _BULK_RETRY_S
                )
        if reply is None:

            def chunks():
                yield pb.StreamChunk(header=header)
                yield from iter_chunks(payload, total, self.config.stream_chunk_bytes)  # raw: one copy each

            try:
                reply = deliver(chunks(), timeout=self.config.execute_timeout_s, metadata=call_metadata(self.token))
            except grpc.RpcError as e:
                raise DeliveryFailed(
                    f"delivery server {address}: {e.code().name} {e.details()}",
                    no_room=e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED,
                ) from None
        self._account(total + sum(len(m.inline_data) for m in header.tensors), time.perf_counter() - t0, bulk)
        return reply

    def _account(self, total: int, seconds: float, bulk: bool) -> None:
        with self._lock:
            self.cross_ds_bytes += total
            self.bulk_bytes += total if bulk else 0
            if total >= 1 << 20:  # the link's bandwidth for placement (paper Eq. 1: C_net)
                bw = total / max(seconds, 1e-6)
                self.link_bandwidth_bps = (
                    bw if not self.link_bandwidth_bps else 0.8 * self.link_bandwidth_bps + 0.2 * bw
                )
            else:
                self.link_latency_s = seconds if not self.link_latency_s else 0.8 * self.link_latency_s + 0.2 * seconds

    def counters(self) -> dict:
        """What heartbeats report, read together: ``cross_ds_bytes``, ``bulk_bytes``, link terms."""
        with self._lock:
            return {
                "cross_ds_bytes": self.cross_ds_bytes,
                "bulk_bytes": self.bulk_bytes,
                "link_bandwidth_bps": self.link_bandwidth_bps,
                "link_latency_s": self.link_latency_s,
            }

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for _, _, channel in peers:
            channel.close()


class Inbound:
    """The delivering side: ``take(header)`` a slab for a batch (``Refused``), ``reply`` its handle;
    ``bulk(header)`` is ``BulkListener``'s ``receive``."""

    def __init__(self, slabs: SlabPool, pickle_allowed: bool, no_pickle_why: str, server_id):
        self.slabs, self.pickle_allowed, self.no_pickle_why = slabs, pickle_allowed, no_pickle_why
        self.server_id = server_id  # a callable: the id the Coordinator gave (it changes on re-registration)

    def take(self, header: pb.StreamHeader):
        if header.tree_pickle and not self.pickle_allowed:
            raise Refused(REFUSED, f"a pickled batch structure needs {PICKLING}; this DataServer {self.no_pickle_why}")
        try:
            return self.slabs.acquire(header.total_bytes)
        except shm.ShmCapacityError as e:
            raise Refused(NO_ROOM, f"{shm.NO_ROOM} a {header.total_bytes}-byte batch: {e}") from None

    def reply(self, slab, header: pb.StreamHeader) -> pb.DeliverReply:
        return pb.DeliverReply(
            server_id=self.server_id(),
            batch=pb.BatchHandle(
                slab=slab_handle_pb(slab.handle(header.total_bytes)),
                tree_json=header.tree_json,
                tree_pickle=header.tree_pickle,
                tensors=header.tensors,
            ),
        )

    def bulk(self, header: pb.StreamHeader):
        try:
            slab = self.take(header)
        except Refused as e:
            return e.status, str(e), None, None, None
        return (
            OK,
            "",
            slab.payload,
            lambda: self.reply(slab, header).SerializeToString(),
            lambda: shm.release_segment(slab.handle(header.total_bytes)),
        )
