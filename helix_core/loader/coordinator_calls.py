"""A client's line to its Coordinator: the channel, registering, routing (by itself among the
servers it knows while the Coordinator is away), renewing the lease, reporting completions,
telemetry, and Tier 2's questions (who leads a group's rounds, what became of a round).

``ClusterClient`` (``loader/cluster_client.py``) holds one as ``coordinator``; the
DataServers' side (Execute, Tier-2 rounds) stays there.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from helix_core.config import ClusterConfig
from helix_core.errors import ClusterError
from helix_core.loader.fallback import KnownServers
from helix_core.security.auth import call_metadata
from helix_core.security.tls import Tls
from helix_core.wire.locallink.link import CallLink, link_name
from helix_core.wire.messages import TASK_ID_BITS, Route, route_request
from helix_core.wire.proto import helix_pb2 as pb
from helix_core.wire.proto import helix_pb2_grpc as pbg
from helix_core.wire.rpc import check_hello, connect

__all__ = ["CoordinatorCalls"]


class CoordinatorCalls:
    """One rank's calls to its Coordinator. Thread-safe.

    Connecting checks the protocol (``Hello``) and registers; a thread then renews the lease while
    the rank routes nothing. ``fire(method, request)`` sends the reports that need no answer (its
    owner lets them land before it closes)."""

    def __init__(
        self,
        address: str,
        token: str | None,
        config: ClusterConfig,
        tls: Tls | None,
        rank: int,
        world_size: int,
        host: str,
        local_rank: int,
        fire: Callable[[Any, Any], None],
    ):
        self.address, self.token, self.config = address, token, config
        self.rank, self.world_size, self.host, self.local_rank = rank, world_size, host, local_rank
        self.metadata = call_metadata(token)
        self._fire = fire
        self.channel = connect(address, config, tls)
        self.stub = pbg.CoordinatorStub(self.channel)
        hello = check_hello(self.stub, "client", token, config.rpc_timeout_s, f"the Coordinator at {address}", tls)
        # the cluster's id (it names its shared memory and local links), and whether the Coordinator
        # lets pickles travel (the client also asks that the wire can't be read: loopback or TLS)
        self.cluster_id, self.pickle_allowed = hello.cluster_id, hello.pickle_allowed
        # its own id and task-id base, so both survive a Coordinator restart (servers key tasks by
        # client id and task id; the random base keeps ids apart in the Coordinator's books too)
        self.client_id = f"c{rank}-{uuid.uuid4().hex[:12]}"
        self.task_id_base = (secrets.randbits(23) + 1) << TASK_ID_BITS
        self._register()
        self._lock = threading.Lock()
        self.servers = KnownServers()  # learnt from routes; routes by itself while the Coordinator is away
        self._completed: list[int] = []  # task ids whose replies landed, for the next Route to carry
        self._outage: float | None = None  # monotonic time the Coordinator became unreachable (None: it answers)
        self._watching, self._state = False, None  # the channel's connectivity, followed from the first outage
        self._route_link = False  # Route to a Coordinator of this host (None: gRPC; False: not looked for yet)
        self._last_rpc = time.monotonic()
        self._closing = threading.Event()
        threading.Thread(target=self._keep_lease, name="helix-lease", daemon=True).start()

    def _call(self, method, request, timeout: float | None = None, stop=None):
        """A Coordinator RPC, retried while it is unavailable, up to ``coordinator_timeout_s``;
        ``stop`` (anything with ``sleep(seconds) -> stopped``) cuts the waits between tries short."""
        deadline = time.monotonic() + self.config.coordinator_timeout_s
        delay = 0.05
        while True:
            try:
                return method(request, timeout=timeout or self.config.rpc_timeout_s, metadata=self.metadata)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise ClusterError(
                        f"the Coordinator at {self.address} refused this client: {e.details()}"
                    ) from None
                retry = (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
                if e.code() not in retry or time.monotonic() + delay > deadline:
                    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # it answered: no delivery server on our host
                        raise ClusterError(
                            f"the Coordinator at {self.address} cannot serve rank {self.rank} "
                            f"on host {self.host!r}: {e.details()}"
                        ) from None
                    raise ClusterError(
                        f"lost the Coordinator at {self.address}: {e.code().name} {e.details()}"
                    ) from None
            if stop.sleep(delay) if stop is not None else time.sleep(delay):
                raise ClusterError("loader stopped")
            delay = min(delay * 2, 0.5)

    def _register(self) -> None:
        reply = self._call(
            self.stub.RegisterClient,
            pb.RegisterClientRequest(
                rank=self.rank,
                world_size=self.world_size,
                host=self.host,
                local_rank=self.local_rank,
                client_id=self.client_id,
                task_id_base=self.task_id_base,
            ),
        )
        if reply.client_id != self.client_id:  # an older Coordinator: take what it made
            self.client_id, self.task_id_base = reply.client_id, reply.task_id_base

    def route(self, part, deadline_s: float | None = None, scheduler: str = "", stop=None) -> Route:
        """Where to run one ``Part``: its cost, ``deadline_s`` (seconds from now; None: unknown)
        and the placement policy by name (empty: the Coordinator's). The tasks completed since
        the last Route ride along (no RPC of their own).

        While the Coordinator is unreachable (after it answered once), the data keeps flowing:
        the client routes by itself among the servers it knows (``_fallback``) and tries the
        Coordinator again whenever its channel is ready; when one answers (restarted on the same
        address, or back from a stall), the client registers again and placement resumes."""
        # (a Coordinator "back" on a loopback port another user took gets no token: the channel's
        # guard fails the call as UNAVAILABLE, and the outage goes on)
        if self._outage is not None and self._state != grpc.ChannelConnectivity.READY:
            return self._fallback(part)
        with self._lock:
            done, self._completed = self._completed, []
        request = route_request(
            self.client_id, self.rank, part, deadline_s, scheduler, done, self.host, self.local_rank
        )
        self._last_rpc = time.monotonic()
        try:
            if self.servers.delivery is None:  # never answered yet: wait for it (coordinator_timeout_s), then fail
                reply = self._call(self.stub.Route, request, stop=stop)
            else:
                reply = self._route_call(request)
        except grpc.RpcError as e:
            with self._lock:
                self._completed[:0] = done[-100_000:]  # for the Coordinator, if this one comes back
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ClusterError(f"the Coordinator at {self.address} refused this client: {e.details()}") from None
            if e.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.CANCELLED,
            ):
                raise ClusterError(f"the Coordinator at {self.address}: {e.code().name} {e.details()}") from None
            if self._outage is None:
                self._outage = time.monotonic()
                self._watch_channel()
            return self._fallback(part)
        except BaseException:
            with self._lock:
                self._completed[:0] = done
            raise
        if reply.delivery_host != self.host:  # never map another host's shared memory
            raise ClusterError(
                f"the Coordinator at {self.address} routed rank {self.rank} of host {self.host!r} "
                f"through {reply.delivery_server_id} of host {reply.delivery_host!r}"
            )
        if self._outage is not None:  # it is back (maybe a new one that knows nothing): be known again
            self._outage = None
            if self._route_link is None:
                self._route_link = False  # a new Coordinator may have a link: look again
            try:
                self._register()
            except ClusterError:
                pass
        with self._lock:
            self.servers.learn(
                reply.exec_server_id,
                reply.exec_address,
                reply.exec_kind,
                reply.delivery_server_id,
                reply.delivery_address,
            )
        return Route.from_pb(reply)

    def _route_call(self, request):
        """One Route: over the local link where the Coordinator is on this host, else gRPC (the
        link's errors are gRPC's: a broken link is an unreachable Coordinator, and the next
        Route after the outage connects again)."""
        link = self._route_link
        if link is False or (link is not None and link.broken):
            with self._lock:  # the sender and the fetcher (a resubmit) may both find it broken
                link = self._route_link
                if link is False or (link is not None and link.broken):
                    link = self._route_link = (
                        CallLink.connect(
                            link_name(self.cluster_id, f"coordinator:{self.address.rsplit(':', 1)[1]}"), self.token
                        )
                        if self.config.local_link and self.token
                        else None
                    )
        if link is not None:
            return link.call(request, pb.RouteReply, self.config.rpc_timeout_s)
        return self.stub.Route(request, timeout=self.config.rpc_timeout_s, metadata=self.metadata)

    def _watch_channel(self) -> None:
        """Follow the channel's connectivity from the first outage on (gRPC keeps reconnecting,
        ``max_reconnect_backoff_ms`` apart), so an outage costs no RPC per request."""
        if self._watching:
            return
        self._watching, self._state = True, None

        def seen(state):
            self._state = state

        self.channel.subscribe(seen, try_to_connect=True)

    def _fallback(self, part) -> Route:
        """A Route without the Coordinator (``KnownServers.route``)."""
        with self._lock:
            return self.servers.route(part, self.address, self.host)

    def _keep_lease(self) -> None:
        """Renew this client's lease with the Coordinator while it routes nothing (validation, a
        checkpoint, a slow step): a client that dies stops renewing, and its load is released."""
        every = self.config.heartbeat_interval_s
        while not self._closing.wait(every):
            if time.monotonic() - self._last_rpc >= every:
                with self._lock:
                    done, self._completed = self._completed, []
                self._last_rpc = time.monotonic()
                self._fire(self.stub.ReportCompletion, pb.Completions(client_id=self.client_id, task_ids=done))

    def completed(self, task_id: int) -> None:
        """A request's reply landed (or it failed or was given up): the next Route tells the Coordinator."""
        with self._lock:
            self._completed.append(task_id)
            self.servers.done(task_id)

    def flush_completions(self) -> None:
        """Tell the Coordinator now of the completions no Route has carried yet (fire and forget)."""
        with self._lock:
            done, self._completed = self._completed, []
        if done:
            self._fire(self.stub.ReportCompletion, pb.Completions(client_id=self.client_id, task_ids=done))

    def telemetry(self, last_decisions: int = 0) -> dict:
        reply = self._call(self.stub.Telemetry, pb.TelemetryRequest(last_decisions=last_decisions))
        return json.loads(reply.json)

    def round_leader(self, rank: int, stop=None) -> str:
        """Tier 2: the address of the DataServer leading the rounds of the group whose lowest rank is ``rank``."""
        return self._call(
            self.stub.RoundLeader, pb.RoundLeaderRequest(client_id=self.client_id, rank=rank), stop=stop
        ).address

    def round_fate(self, ask: pb.RoundFateRequest, sent: float, stop, retry: bool) -> pb.RoundFateReply:
        """Tier 2: what became of a round whose leader cannot answer, the round's age (since
        ``sent``, monotonic) stated afresh at each try. ``retry``: as any call (``ClusterError``
        once it gives up); else one try (``grpc.RpcError`` when it fails)."""

        def fate_now(req, **kw):
            req.age_s = time.monotonic() - sent
            return self.stub.RoundFate(req, **kw)

        if retry:
            return self._call(fate_now, ask, stop=stop)
        return fate_now(ask, timeout=self.config.rpc_timeout_s, metadata=self.metadata)

    def stop(self) -> None:
        """The client is closing: no more lease renewals; the completions no Route carried are reported."""
        self._closing.set()
        self.flush_completions()

    def close(self) -> None:
        """Close the channel and the local link (after ``stop``, once the reports landed)."""
        self.channel.close()
        if self._route_link:
            self._route_link.close()
