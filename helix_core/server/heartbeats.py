"""A DataServer's heartbeats to its Coordinator: its load and what its storage reads cost, for
placement, and its liveness.

They follow the server's state: every ``heartbeat_interval_s`` while it changes; idle, ever
further apart (``Beats``), each beat promising the next, until work arrives. No thread follows
the channel's connectivity. A beat goes to a loopback Coordinator only while this user listens
there (``rpc.connect``'s guard, asked before every call, so after every reconnect).
"""

from __future__ import annotations

import logging
import threading

import grpc

from helix_core.config import ClusterConfig
from helix_core.security.auth import call_metadata
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["Beats", "heartbeats"]

log = logging.getLogger("helix.dataserver")


class Beats:
    """When a DataServer's next heartbeat goes. While its state changes: every
    ``heartbeat_interval_s``. Idle, the wait doubles up to ``2 * heartbeat_timeout_s`` and each
    beat promises the next (``next_beat_s``; the Coordinator believes it, ``Registry.heartbeat``),
    so an idle cluster costs next to nothing. Work that arrives (``kick``: an Execute, a delivery)
    ends a long wait at once, since the Coordinator expects a server it routed to within the
    timeout. ``close`` ends the wait for good."""

    def __init__(self, config: ClusterConfig):
        self.base = config.heartbeat_interval_s
        self.longest = max(self.base, 2 * config.heartbeat_timeout_s)
        self.wait_s = self.base
        self._woken = threading.Event()
        self._kicked = self._closed = False

    def kick(self) -> None:
        if self.wait_s > self.base and not self._kicked:  # cheap on the busy path: one attribute read
            self._kicked = True
            self._woken.set()

    def close(self) -> None:
        self._closed = True
        self._woken.set()

    def next(self, changed: bool) -> float:
        """The wait after this beat (the beat carries it): the interval if ``changed`` (the state
        changed since the last beat) or work arrived since, else twice the last, up to the longest."""
        changed, self._kicked = changed or self._kicked, False
        self.wait_s = self.base if changed else min(self.longest, self.wait_s * 2)
        return self.wait_s

    def failed(self) -> None:
        """The beat did not arrive (its Coordinator is away): the next goes at the interval, so a
        restarted Coordinator learns of this server within about a second."""
        self.wait_s = self.base

    def sleep(self) -> bool:
        """Wait out ``wait_s`` or a kick; False once closed."""
        self._woken.wait(self.wait_s)
        if self._closed:
            return False
        self._woken.clear()
        return True


def heartbeats(server, coord, token, config: ClusterConfig, stop: threading.Event, register) -> None:
    """The heartbeat thread of a ``DataServer`` (``server``): until ``stop`` or ``Beats.close``.
    ``register``: registers it again, where the Coordinator no longer knows it."""
    beats, last = server.beats, None
    while beats.sleep() and not stop.is_set():
        server.reclaim()  # delivery slabs of clients that died come back; unused ones go
        st = server.stats()
        req = pb.HeartbeatRequest(
            server_id=server.server_id,
            queue_depth=st["queue_depth"],
            inflight=st["inflight"],
            workers_alive=st["workers_alive"],
            latency_per_cost=st["latency_per_cost"],
            completed=st["completed"],
            queued_cpu_s=st["queued_cpu_s"],
            storage_bandwidth_bps=st["storage_bandwidth_bps"],
            storage_latency_s=st["storage_latency_s"],
            **server.outbound.counters(),
        )
        changed, last = req != last, pb.HeartbeatRequest()
        last.CopyFrom(req)
        req.next_beat_s = beats.next(changed)
        try:  # (a port another user took once the Coordinator stopped gets no token: rpc.connect's guard)
            reply = coord.Heartbeat(req, timeout=config.rpc_timeout_s, metadata=call_metadata(token))
            if not reply.known:
                register()
        except grpc.RpcError as e:
            log.debug("heartbeat failed: %s", e.code())
            beats.failed()
