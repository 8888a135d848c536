"""The Coordinator's routing (pure Python, no gRPC): placing a request, the ledger of the load
routed tasks put on their servers until they complete, and the decisions' telemetry. A mixin of
``Registry`` (``registry.py``), whose state it reads and updates under its lock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from helix_core.planning.placement import PlacementRequest, make_scheduler
from helix_core.telemetry import percentile

__all__ = ["Routing"]

log = logging.getLogger("helix.coordinator")


class Routing:
    """``Registry``'s routing methods. They use its ``config``, ``clock``, ``cluster_id``,
    ``scheduler``, ``default``, ``servers``, ``clients``, ``decisions``, ``decision_us``, ``routed``,
    ``_owner``, ``_schedulers`` and ``_lock``, and its host methods (``delivery_server``,
    ``_candidates``, ``_sync``, ``ordered``, ``hosts``)."""

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
        ``PlacementRequest`` fields (cpu_s, io_bytes, out_bytes, tokens, deadline_s). Returns
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
