"""The Coordinator's state and logic (pure Python, an injected clock, no gRPC): membership,
liveness, hosts and routing. ``service.py`` is the thin servicer in front of it.

Routing places a request among its rank's candidates (its host's live local servers, then the live
remote ones), keeps a ledger of the load each routed task puts on its server until it completes (or
its client's lease runs out), and records the decisions' telemetry. One lock guards it all: a
decision reads the same servers that heartbeats, completions and sweeps update.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

from helix_core.config import ClusterConfig
from helix_core.planning.columns import ServerColumns
from helix_core.planning.placement import Candidates, PlacementRequest, make_scheduler
from helix_core.telemetry import percentile
from helix_core.wire.messages import TASK_ID_BITS

__all__ = ["NoDeliveryServer", "Registry", "ServerState"]

log = logging.getLogger("helix.coordinator")


class NoDeliveryServer(LookupError):
    """A rank's host has no live local server to deliver through (yet)."""


@dataclass
class ServerState:
    server_id: str
    address: str
    kind: str
    local_rank: int
    host: str
    workers: int
    registered_at: float
    last_seen: float
    alive: bool = True
    outstanding: int = 0
    queue_depth: int = 0
    inflight: int = 0
    latency_per_cost: float = 1.0
    completed: int = 0
    cross_ds_bytes: int = 0
    bulk_bytes: int = 0  # of cross_ds_bytes, sent by the bulk path
    queued_cpu_s: float = 0.0  # its last heartbeat: predicted CPU seconds queued or running there
    pending_cpu_s: float = 0.0  # predicted CPU seconds routed to it since that heartbeat, not yet completed
    link_bandwidth_bps: float = 0.0
    link_latency_s: float = 0.0
    storage_bandwidth_bps: float = 0.0  # its last heartbeat: bytes/s of its samples' reads by URL (0: unmeasured)
    storage_latency_s: float = 0.0  # ... and seconds per sample beyond the bytes
    load_cpu_s: float = 0.0  # queued + pending: predicted CPU seconds of work ahead of a new task here
    due: float = float("inf")  # silent past this (a monotonic time): dead (``Registry.sweep``)


@dataclass
class Registry:
    """Servers, clients, heartbeat state and routing. Thread-safe (one lock); ``clock`` is
    injectable. ``scheduler`` is the policy of requests that name none; each request may name its own."""

    config: ClusterConfig
    scheduler: str = "deadline"  # the loader's default too
    clock: callable = time.monotonic
    cluster_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self):
        self.default = make_scheduler(self.scheduler)
        self._schedulers = {self.scheduler: self.default}
        self.servers: dict[str, ServerState] = {}
        self.clients: dict[str, dict] = {}
        self.decisions: collections.deque = collections.deque(maxlen=10_000)
        self.decision_us: collections.deque = collections.deque(maxlen=10_000)
        self.routed = 0
        # task_id -> (server id, predicted cpu_s, routed at, client id) until completed
        self._owner: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self._order: tuple[dict, list[ServerState]] | None = None  # (locals by host, all), cached
        self._live: dict[str, ServerColumns] = {}  # host -> its ranks' live candidates' columns
        self._hosts: dict[str, int] = {}  # host -> order of its first local server's registration

    # ---- membership ----------------------------------------------------------------------------
    def register_server(self, address: str, kind: str, local_rank: int, host: str, workers: int) -> ServerState:
        if kind not in ("local", "remote"):
            raise ValueError(f"server kind {kind!r}; valid: local, remote")
        with self._lock:
            now = self.clock()
            for s in self.servers.values():  # a restarted server on the same address replaces the old
                if s.address == address:
                    s.alive = False
            remotes = sum(s.kind == "remote" for s in self.servers.values())
            sid = f"{kind[0]}{local_rank if kind == 'local' else remotes}-{uuid.uuid4().hex[:6]}"
            st = ServerState(
                sid,
                address,
                kind,
                local_rank if kind == "local" else -1,
                host,
                max(workers, 1),
                now,
                now,
                due=now + self.config.heartbeat_timeout_s,
            )
            self.servers[sid] = st
            if kind == "local":
                self._hosts.setdefault(host, len(self._hosts))
            self._order, self._live = None, {}
            log.info("registered %s server %s at %s (%d workers)", kind, sid, address, workers)
            return st

    def register_client(
        self, rank: int, world_size: int, host: str, local_rank: int = -1, client_id: str = "", task_id_base: int = 0
    ) -> tuple[str, int]:
        """A client's id and task-id base: its task ids are ``base + 1, base + 2, ...``. A client
        makes both itself (a uuid; a random base, ``ClusterClient``), so they survive a Coordinator
        restart and a re-registration keeps them; servers key tasks by (client id, task id), so two
        clients never collide there even if their bases did. Without them (an older client) the
        Coordinator makes them: unique among the clients it has seen."""
        cid = client_id or f"c{rank}-{uuid.uuid4().hex[:6]}"
        with self._lock:
            base = task_id_base or (len(self.clients) + 1) << TASK_ID_BITS
            self.clients[cid] = {
                "rank": rank,
                "world_size": world_size,
                "host": host,
                "local_rank": local_rank,
                "task_id_base": base,
                "last_seen": self.clock(),
            }
        return cid, base

    # ---- liveness ------------------------------------------------------------------------------
    def heartbeat(self, server_id: str, healthy: bool = True, next_beat_s: float = 0.0, **stats) -> bool:
        """A server's heartbeat; ``healthy`` False (it has no live worker: it cannot keep them)
        takes it out of placement like a dead one until a healthy heartbeat comes. ``next_beat_s``:
        an idle server's promise of its next beat (its beats slow down while nothing changes); it is
        dead once silent that long plus the part of the timeout beyond one interval — or within the
        timeout once work is routed to it, since work wakes its beats (``route``)."""
        with self._lock:
            st = self.servers.get(server_id)
            if st is None:
                return False
            if st.alive != healthy:
                self._live = {}
            st.last_seen, st.alive = self.clock(), bool(healthy)
            c = self.config
            st.due = (
                st.last_seen
                + c.heartbeat_timeout_s
                + max(0.0, min(next_beat_s, self.longest_beat_s) - c.heartbeat_interval_s)
            )
            for k, v in stats.items():
                setattr(st, k, v)
            if "queued_cpu_s" in stats:  # the server's own count now covers what was routed before it
                st.pending_cpu_s = 0.0
            st.load_cpu_s = st.queued_cpu_s + st.pending_cpu_s
            self._sync(st)
            return True

    @property
    def longest_beat_s(self) -> float:
        """The longest wait between an idle server's heartbeats that the Coordinator believes."""
        return max(self.config.heartbeat_interval_s, 2 * self.config.heartbeat_timeout_s)

    @property
    def lease_s(self) -> float:
        """A client silent this long (no Route, completion or lease renewal) is gone: its load is released."""
        return 3 * self.config.heartbeat_timeout_s

    def seen(self, client_id: str) -> None:
        """A client's lease renewal (every RPC of it renews it)."""
        with self._lock:
            c = self.clients.get(client_id)
            if c is not None:
                c["last_seen"] = self.clock()

    def sweep(self) -> list[str]:
        """Mark servers dead whose last heartbeat is older than the timeout, and drop clients whose
        lease ran out, releasing the load they left on servers; return the dead servers' ids."""
        dead = []
        with self._lock:
            now = self.clock()
            gone = [cid for cid, c in self.clients.items() if now - c["last_seen"] > self.lease_s]
            for cid in gone:
                del self.clients[cid]
            if gone:
                lost = set(gone)
                for task_id in [t for t, owner in self._owner.items() if owner[3] in lost]:
                    self._release(self._owner.pop(task_id))
                log.warning("clients %s stopped renewing their lease: their load is released", gone)
            for st in self.servers.values():
                if st.alive and now > st.due:
                    st.alive = False
                    dead.append(st.server_id)
            if dead:
                self._live = {}
        for sid in dead:
            log.warning("server %s missed heartbeats: marked dead", sid)
        return dead

    # ---- placement candidates ------------------------------------------------------------------
    def _ordering(self) -> tuple[dict[str, list[ServerState]], list[ServerState]]:
        """(each host's local servers by slot, all servers: locals host by host, then remotes),
        recomputed on registration. A host's slot holds the server that registered it last."""
        if self._order is None:
            latest: dict[tuple[str, int], ServerState] = {}
            for s in self.servers.values():
                key = (s.host, s.local_rank)
                if s.kind == "local" and (key not in latest or s.registered_at >= latest[key].registered_at):
                    latest[key] = s
            by_host: dict[str, list[ServerState]] = {h: [] for h in self._hosts}
            for key in sorted(latest, key=lambda k: (self._hosts[k[0]], k[1])):
                by_host[key[0]].append(latest[key])
            remotes = sorted((s for s in self.servers.values() if s.kind == "remote"), key=lambda s: s.registered_at)
            self._order = (by_host, [s for locals_ in by_host.values() for s in locals_] + remotes)
        return self._order

    def _live_table(self, host: str) -> ServerColumns:
        """The placement candidates of a rank on ``host`` — that host's live local servers, then
        the live remote ones — as numpy columns, rebuilt when membership or liveness changes and
        updated in place by routing, completions and heartbeats (never per decision)."""
        table = self._live.get(host)
        if table is None:
            table = self._live[host] = ServerColumns(
                [s for s in self._ordering()[1] if s.alive and (s.kind == "remote" or s.host == host)]
            )
        return table

    def _sync(self, st: ServerState) -> None:
        """Copy a server's changed state into the live tables (caller holds the lock)."""
        for table in self._live.values():
            table.sync(st)

    def _candidates(self, delivery: ServerState, exclude: set[str]) -> Candidates:
        table = self._live_table(delivery.host)
        if exclude and any(sid not in exclude for sid in table.ids):  # exclusions are hints, never fatal
            table = ServerColumns([s for s in table.servers if s.server_id not in exclude])
        return table.candidates(table.position.get(delivery.server_id))

    def ordered(self) -> list[ServerState]:
        """Local servers host by host (in the order hosts first registered one) and by slot, then
        remote ones by registration: ``cluster.servers`` order."""
        with self._lock:
            return list(self._ordering()[1])

    # ---- hosts and delivery ---------------------------------------------------------------------
    def delivery_server(self, rank: int, exclude: set[str], host: str, local_rank: int | None = None) -> ServerState:
        """A rank on ``host`` delivers through that host's local server ``local_rank % L`` (default
        ``rank``); if it is dead (or excluded by the client), the host's next live one takes over.
        Exclusions are hints: if they leave none, they are ignored. Never another host's server:
        its shared memory is not the rank's."""
        locals_ = self._ordering()[0].get(host, [])
        if not locals_:
            raise NoDeliveryServer(
                f"no local DataServer registered on host {host!r} (rank {rank}); hosts with one: "
                f"{sorted(h for h, s in self._ordering()[0].items() if s) or 'none'} — start "
                "'helix dataserver --local-rank 0' on that host"
            )
        n, slot = len(locals_), rank if local_rank is None or local_rank < 0 else local_rank
        for skip in (exclude, set()):
            for k in range(n):
                s = locals_[(slot + k) % n]
                if s.alive and s.server_id not in skip:
                    return s
        raise NoDeliveryServer(
            f"no live local DataServer on host {host!r} can deliver to rank {rank} ({n} registered there, all dead)"
        )

    def round_leader(self, rank: int) -> ServerState:
        """Tier 2: the server that leads the rounds of a group whose lowest rank is ``rank`` — that
        rank's delivery server (``LookupError`` until a client of that rank registered)."""
        with self._lock:
            mine = [c for c in self.clients.values() if c["rank"] == rank]
        if not mine:
            raise LookupError(f"rank {rank} has not registered with the Coordinator yet")
        c = max(mine, key=lambda c: c["last_seen"])
        return self.delivery_server(rank, set(), c["host"], c["local_rank"])

    def hosts(self) -> dict[str, list[str]]:
        """Each host's local servers (ids, by slot), hosts in the order they first registered one."""
        with self._lock:
            return {h: [s.server_id for s in locals_] for h, locals_ in self._ordering()[0].items()}

    # ---- routing: placement and the load ledger ------------------------------------------------
    def scheduler_for(self, scheduler: str | None):
        """The policy a request names (``ValueError`` listing the valid ones), else the default."""
        if not scheduler:
            return self.default
        chosen = self._schedulers.get(scheduler)
        if chosen is None:
            chosen = self._schedulers[scheduler] = make_scheduler(scheduler)
        return chosen

    def route(
        self,
        rank: int,
        task_id: int,
        cost: dict,
        exclude: set[str],
        scheduler: str | None = None,
        t_arrival: float | None = None,
        *,
        host: str,
        local_rank: int | None = None,
        client_id: str = "",
    ):
        """Place one request of a rank on ``host`` (its ``local_rank`` picks its delivery server):
        the candidates are that host's local servers and the remote ones. ``cost``:
        ``PlacementRequest`` fields (cpu_s, io_bytes, out_bytes, tokens, samples, deadline_s). Returns
        ``(chosen, delivery, decision, us)``; ``us`` counts from
        ``t_arrival`` (a ``time.perf_counter`` value: the request's arrival, so waiting for the
        lock counts) or else from the start of the decision."""
        policy = self.scheduler_for(scheduler)
        request = PlacementRequest(rank, task_id, **cost)
        with self._lock:
            t0 = time.perf_counter() if t_arrival is None else t_arrival
            delivery = self.delivery_server(rank, exclude, host, local_rank)
            decision = policy.choose(request, self._candidates(delivery, exclude))
            chosen = self.servers[decision.server_id]
            prev = self._owner.get(task_id)
            if prev is not None:  # a resubmission: the first routing is void
                self._release(prev)
            chosen.outstanding += 1
            chosen.pending_cpu_s += request.cpu_s
            chosen.load_cpu_s += request.cpu_s
            now = self.clock()  # the work wakes an idle server's beats: from now on it is due within the timeout
            for st in (chosen, delivery) if chosen.kind == "remote" else (chosen,):
                st.due = min(st.due, now + self.config.heartbeat_timeout_s)
            self._sync(chosen)
            self._owner[task_id] = (chosen.server_id, request.cpu_s, chosen.last_seen, client_id)
            c = self.clients.get(client_id)
            if c is not None:
                c["last_seen"] = now
            self.routed += 1
            us = (time.perf_counter() - t0) * 1e6
        self.decision_us.append(us)
        self.decisions.append((task_id, rank, delivery.server_id, decision, us, policy.name, request.deadline_s))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s", _decision_entry(self.decisions[-1]))
        return chosen, delivery, decision, us

    def _release(self, owner: tuple) -> None:
        """A routed task is done (or void): it no longer loads its server (caller holds the lock)."""
        server_id, cpu_s, beat, _ = owner
        st = self.servers.get(server_id)
        if st is None:
            return
        st.outstanding = max(0, st.outstanding - 1)
        if st.last_seen == beat:  # routed since the last heartbeat: still counted as pending
            st.pending_cpu_s = max(0.0, st.pending_cpu_s - cpu_s)
            st.load_cpu_s = st.queued_cpu_s + st.pending_cpu_s
        self._sync(st)

    def complete(self, task_ids) -> None:
        """Tasks whose replies landed (or that were given up): they no longer load their servers."""
        with self._lock:
            for task_id in task_ids:
                owner = self._owner.pop(task_id, None)
                if owner is not None:
                    self._release(owner)

    # ---- telemetry -----------------------------------------------------------------------------
    def telemetry(self, last: int = 100) -> dict:
        us = list(self.decision_us)
        return {
            "cluster_id": self.cluster_id,
            "routed": self.routed,
            "scheduler": self.scheduler,
            "scheduler_overhead_us_p50": percentile(us, 50),
            "scheduler_overhead_us_p99": percentile(us, 99),
            "servers": [asdict(s) for s in self.ordered()],
            "clients": dict(self.clients),
            "hosts": self.hosts(),
            "decisions": [_decision_entry(d) for d in list(self.decisions)[-last:]] if last else [],
        }


def _decision_entry(record: tuple) -> dict:
    task_id, rank, delivery, decision, us, scheduler, deadline_s = record
    entry = {
        "task_id": task_id,
        "rank": rank,
        "server": decision.server_id,
        "delivery": delivery,
        "scheduler": scheduler,
        "deadline_s": deadline_s,
        "reason": decision.reason,
        "scores": decision.scores_by_server(),
        "us": round(us, 1),
    }
    if len(decision.finish_s):
        entry["finish_s"] = decision.finish_by_server()
    return entry
