"""The Coordinator: metadata-only control plane (registry, heartbeats, placement, telemetry).

``Registry`` (``registry.py``) is the state and logic; ``CoordinatorServicer`` only converts
messages. No tensor and no decoded byte ever reaches this process.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import threading
import time
import uuid

import grpc

from helix_core.config import PROTOCOL_VERSION, ClusterConfig
from helix_core.coordinator.registry import NoDeliveryServer, Registry, ServerState
from helix_core.tier2.fates import RoundFates
from helix_core.wire.messages import slab_handle, slab_handle_pb
from helix_core.wire.proto import helix_pb2 as pb
from helix_core.wire.proto import helix_pb2_grpc as pbg

__all__ = ["CoordinatorServicer", "Registry", "ServerState", "serve_coordinator"]

log = logging.getLogger("helix.coordinator")


class CoordinatorServicer(pbg.CoordinatorServicer):
    """Thin: converts messages and calls ``Registry``; errors go back as status codes. Its
    handlers are coroutines on one asyncio loop (grpc.aio): every one is short and never blocks,
    so decisions never wait for the GIL behind another handler thread."""

    def __init__(self, registry: Registry, stop: threading.Event, pickle_allowed: bool):
        self.registry, self.stop, self.pickle_allowed = registry, stop, pickle_allowed
        self.fates = RoundFates()  # Tier 2: moved rounds, for ranks whose round leader died

    async def Hello(self, request, context):
        return pb.HelloReply(
            protocol_version=PROTOCOL_VERSION, cluster_id=self.registry.cluster_id, pickle_allowed=self.pickle_allowed
        )

    async def RegisterServer(self, request, context):
        try:
            st = self.registry.register_server(
                request.address, request.kind, request.local_rank, request.host, request.workers
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RegisterServerReply(
            server_id=st.server_id,
            cluster_id=self.registry.cluster_id,
            heartbeat_interval_s=self.registry.config.heartbeat_interval_s,
        )

    async def RegisterClient(self, request, context):
        cid, base = self.registry.register_client(
            request.rank, request.world_size, request.host, request.local_rank, request.client_id, request.task_id_base
        )
        return pb.RegisterClientReply(client_id=cid, cluster_id=self.registry.cluster_id, task_id_base=base)

    async def Heartbeat(self, request, context):
        known = self.registry.heartbeat(
            request.server_id,
            healthy=request.workers_alive > 0,
            queue_depth=request.queue_depth,
            inflight=request.inflight,
            latency_per_cost=request.latency_per_cost or 1.0,
            completed=request.completed,
            cross_ds_bytes=request.cross_ds_bytes,
            bulk_bytes=request.bulk_bytes,
            queued_cpu_s=request.queued_cpu_s,
            link_bandwidth_bps=request.link_bandwidth_bps,
            link_latency_s=request.link_latency_s,
            storage_bandwidth_bps=request.storage_bandwidth_bps,
            storage_latency_s=request.storage_latency_s,
            next_beat_s=request.next_beat_s,
        )
        return pb.HeartbeatReply(known=known)

    async def Route(self, request, context):
        t_arrival = time.perf_counter()  # the decision's time counts from here: the handler's whole work
        c = request.cost
        cost = {
            "cpu_s": c.cpu_s,
            "io_bytes": c.io_bytes,
            "out_bytes": c.out_bytes,
            "tokens": c.tokens,
            "samples": c.samples,
            "deadline_s": request.deadline_s if request.has_deadline else None,
        }
        try:
            policy = self.registry.scheduler_for(request.scheduler)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.completed:  # the client's completions ride on its next Route
            self.registry.complete(request.completed)
        try:
            chosen, delivery, decision, us = self.registry.route(
                request.rank,
                request.task_id,
                cost,
                set(request.exclude),
                policy.name,
                t_arrival,
                host=request.host,
                local_rank=request.local_rank,
                client_id=request.client_id,
            )
        except NoDeliveryServer as e:  # none on the rank's host (yet): the client retries, then names the host
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.RouteReply(
            exec_server_id=chosen.server_id,
            exec_address=chosen.address,
            delivery_server_id=delivery.server_id,
            delivery_address=delivery.address,
            reason=decision.reason,
            decision_us=us,
            exec_kind=chosen.kind,
            delivery_host=delivery.host,
        )

    async def ReportCompletion(self, request, context):  # also a client's lease renewal (with no task ids)
        self.registry.seen(request.client_id)
        self.registry.complete(request.task_ids)
        return pb.Ack(ok=True)

    async def RoundLeader(self, request, context):
        try:
            st = self.registry.round_leader(request.rank)
        except LookupError as e:  # not registered yet (or no live server on its host): the client retries
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.RoundLeaderReply(server_id=st.server_id, address=st.address, host=st.host)

    async def CommitRound(self, request, context):
        moved = {r.rank: list(r.indices) for r in request.ranks}
        release = {r.rank: [slab_handle(h) for h in r.release] for r in request.ranks}
        key = (request.group, request.run, request.step)
        return pb.CommitRoundReply(committed=self.fates.commit(key, moved, release, request.age_s or math.inf))

    async def RoundFate(self, request, context):
        got = self.fates.fate((request.group, request.run, request.step), request.rank, request.age_s or math.inf)
        if got is None:
            return pb.RoundFateReply(moved=False)
        return pb.RoundFateReply(moved=True, indices=got[0], release=[slab_handle_pb(h) for h in got[1]])

    async def Telemetry(self, request, context):
        return pb.TelemetryReply(json=json.dumps(self.registry.telemetry(request.last_decisions)))

    async def Shutdown(self, request, context):
        self.stop.set()
        return pb.Ack(ok=True)


def serve_coordinator(
    host: str,
    port: int,
    token: str | None,
    config: ClusterConfig,
    scheduler: str,
    stop: threading.Event,
    on_ready=None,
    cluster_id: str | None = None,
    tls=None,
    insecure: bool = False,
) -> None:
    """Run a Coordinator until ``stop`` is set (blocking). ``on_ready(address)`` after binding;
    ``tls``: a ``Tls`` for its port; ``insecure``: beyond loopback without TLS.

    ``token`` None on loopback: reuse the token this user's Coordinator on the same fixed port left
    (a restart keeps its servers and clients), else make one. The token is written to the user's
    private folder for the address (``tokenfiles``); it is removed at exit, except a made one on a
    fixed port, which the next Coordinator there reuses."""
    import asyncio

    asyncio.run(_serve(host, port, token, config, scheduler, stop, on_ready, cluster_id, tls, insecure))


async def _serve(host, port, token, config, scheduler, stop, on_ready, cluster_id, tls, insecure) -> None:
    import asyncio

    from helix_core.security.auth import is_loopback, new_token, pickle_allowed
    from helix_core.security.tokenfiles import find_token, remove_token, write_token
    from helix_core.wire.rpc import create_aio_server

    token = token or None
    made = token is None and is_loopback(host)  # beyond loopback, create_aio_server asks for one
    if made:
        token = (find_token(f"{host}:{port}") if port else None) or new_token()
    registry = Registry(config, scheduler, cluster_id=cluster_id or uuid.uuid4().hex[:12])
    server, bound = create_aio_server(host, port, token, config, tls, insecure)
    address = f"{host}:{bound}"
    try:
        write_token(address, token)
    except (OSError, ValueError) as e:  # a made token nobody can find would lock everyone out
        if made:
            await server.stop(0)
            raise ValueError(
                f"cannot leave this Coordinator's token for its user: {e} (set HELIX_RUNTIME_DIR to a "
                "private folder, or pass --token-file)"
            ) from None
        log.warning("token not written to the user's Helix folder (%s); clients need it passed", e)
    # A long-lived service with a stable heap: keep startup objects out of collections and collect
    # the young generation rarely, so a collection lands in fewer than 1 in 1,000 routing decisions.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    servicer = CoordinatorServicer(registry, stop, pickle_allowed(host, token, tls, config.allow_pickle))
    pbg.add_CoordinatorServicer_to_server(servicer, server)
    link = None
    try:
        await server.start()
        if config.local_link:  # the ranks of its host Route over a Unix socket (wire/locallink/link.py)
            from helix_core.wire.locallink.link import link_name
            from helix_core.wire.locallink.server import serve_call_link

            try:
                link = await serve_call_link(
                    link_name(registry.cluster_id, f"coordinator:{bound}"), token, servicer.Route, pb.RouteRequest
                )
            except OSError as e:  # its name taken: the ranks use gRPC
                log.warning("no local link for the Coordinator at %s: %s", address, e)
        if on_ready is not None:
            on_ready(address, registry.cluster_id)
        while not stop.is_set():
            # a dead server is found within a fifth of the timeout of its due time (Registry.sweep)
            await asyncio.sleep(config.heartbeat_timeout_s / 5)
            registry.sweep()
    finally:
        if link is not None:
            link.close()
        await server.stop(grace=min(1.0, config.stop_timeout_s))
        if not (made and port):
            remove_token(address, token)
