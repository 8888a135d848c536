"""Placement policies: which DataServer executes a batch request (pure: plain data in and out).

Each policy's ``choose(request, candidates) -> Decision`` sees descriptors' cost terms and the
servers' last heartbeat state, never a socket or a clock, so tests drive it with plain tuples.

``LeastRequest`` balances outstanding requests per worker. ``DeadlineAware`` is the paper's
Eq. 1: it predicts when the batch would be ready on each candidate,
``T_i = C_queue + C_cpu + C_io + C_net``, and the miss ``M_i = max(0, T_i - D)`` against the
requesting rank's deadline ``D`` (its predicted GPU window): all meet -> stay on the rank's own
server unless another gains enough; all miss -> earliest finish; otherwise the best candidate that
meets, scored by lateness, locality and backpressure.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import truediv

__all__ = ["Candidates", "DeadlineAware", "Decision", "LeastRequest", "POLICIES", "PlacementRequest", "make_policy"]


@dataclass(frozen=True)
class Candidates:
    """The live DataServers as the Coordinator sees them, as columns in cluster order (one entry
    per server; position = cluster index order, so ties can go to the lowest position). Columns,
    not one object per server: a decision over 64 servers stays well under 100 µs in Python.

    ``outstanding``: requests routed to a server and not yet completed; ``workers``: its worker
    processes; ``queue_depth`` / ``latency_per_cost`` (wall seconds of execution per predicted
    CPU second): its last heartbeat; ``queued_cpu_s``: predicted CPU seconds queued or running
    there; ``bandwidth_bps`` / ``link_latency_s``: a remote server's measured delivery link (0:
    unknown). Optional columns may be empty (= unknown). ``local``: the position of the requesting
    rank's own delivery server, None if it is not a candidate."""

    server_ids: tuple[str, ...]
    kinds: tuple[str, ...]
    workers: tuple[int, ...]
    outstanding: tuple[int, ...]
    queue_depth: tuple[int, ...] = ()
    latency_per_cost: tuple[float, ...] = ()
    local: int | None = None
    queued_cpu_s: tuple[float, ...] = ()
    bandwidth_bps: tuple[float, ...] = ()
    link_latency_s: tuple[float, ...] = ()

    def __post_init__(self):
        n = len(self.server_ids)
        optional = (self.queue_depth, self.latency_per_cost, self.queued_cpu_s, self.bandwidth_bps,
                    self.link_latency_s)
        if not (len(self.kinds) == len(self.workers) == len(self.outstanding) == n) or \
                any(len(col) not in (0, n) for col in optional):
            raise ValueError("Candidates: columns of different lengths")
        if n and min(self.workers) < 1:
            raise ValueError(f"Candidates: a server with {min(self.workers)} workers")
        if self.local is not None and not 0 <= self.local < n:
            raise ValueError(f"Candidates.local={self.local}: no such position among {n} servers")

    def __len__(self) -> int:
        return len(self.server_ids)

    @classmethod
    def from_rows(cls, rows: list[dict], local: str | None = None) -> Candidates:
        """From one dict per server (``server_id``, ``kind``, ``workers``, ``outstanding``, optional
        ``queue_depth``, ``latency_per_cost``, ``queued_cpu_s``, ``bandwidth_bps``,
        ``link_latency_s``); ``local`` names the rank's own server."""
        ids = tuple(r["server_id"] for r in rows)

        def col(key, default):
            return tuple(r.get(key, default) for r in rows)

        return cls(ids, col("kind", "local"), col("workers", 1), col("outstanding", 0), col("queue_depth", 0),
                   col("latency_per_cost", 1.0), None if local is None else ids.index(local),
                   col("queued_cpu_s", 0.0), col("bandwidth_bps", 0.0), col("link_latency_s", 0.0))


@dataclass(frozen=True)
class PlacementRequest:
    """One batch request: who asks, its predicted cost (CPU seconds on one core, input and output
    bytes, tokens) and its deadline (seconds from now until the rank needs it; None: unknown)."""

    rank: int
    task_id: int
    cpu_s: float = 0.0
    out_bytes: int = 0
    tokens: int = 0
    deadline_s: float | None = None
    io_bytes: int = 0


@dataclass(frozen=True)
class Decision:
    """The chosen server, why, and every candidate's score (lower is better), aligned with
    ``candidates`` (the servers' ids); ``finish_s``: each candidate's predicted ready time, seconds
    from now (deadline-aware policies; empty otherwise)."""

    server_id: str
    reason: str
    candidates: tuple[str, ...]
    scores: tuple[float, ...]
    finish_s: tuple[float, ...] = ()

    def scores_by_server(self) -> dict[str, float]:
        return dict(zip(self.candidates, self.scores))

    def finish_by_server(self) -> dict[str, float]:
        return dict(zip(self.candidates, self.finish_s))


class LeastRequest:
    """Fewest outstanding requests per worker; ties go to the rank's own server, then the
    lowest index (so an idle cluster keeps work local and deterministic)."""

    name = "least-request"

    def choose(self, request: PlacementRequest, candidates: Candidates) -> Decision:
        if not len(candidates):
            raise ValueError(f"no live DataServer to place task {request.task_id} of rank {request.rank}")
        scores = tuple(map(truediv, candidates.outstanding, candidates.workers))  # workers >= 1
        best, local = min(scores), candidates.local
        k = local if local is not None and scores[local] == best else scores.index(best)
        reason = "local-least-request" if k == local else "least-request"
        return Decision(candidates.server_ids[k], reason, candidates.server_ids, scores)


@dataclass(frozen=True)
class DeadlineAware:
    """Eq. 1: predicted ready time per candidate against the rank's deadline.

    ``T_i = queued_cpu_s_i * lpc_i / workers_i`` (work ahead of it) ``+ cpu_s * lpc_i`` (this
    batch on one worker; ``lpc``: measured wall seconds per predicted CPU second, 1 when unknown)
    ``+ io_bytes / io_bps`` ``+ C_net`` (remote servers only: ``out_bytes / bandwidth + latency``,
    with ``default_*`` until the link was measured). Same-host local servers deliver by shared
    memory, so their ``C_net`` is 0.

    Locality is the network: every local server delivers through shared memory on the rank's
    host, so among them the batch goes where it is ready soonest (the rank's own server wins near
    ties), while a remote sidecar costs a stream. Selection: no deadline, or every candidate
    misses -> earliest finish ("earliest-finish"); a local server meets -> the best local one by
    score ("local-meets"), unless a remote one is ready more than ``gain_threshold`` x D sooner
    ("remote-gain"); only remote servers meet -> the best of them ("meets-deadline"). Score =
    lateness ``10 * M_i / D`` + ``T_i / D`` + locality (0 own server, ``pool_penalty`` another
    local one, ``remote_penalty`` a remote one) + ``backpressure`` x outstanding per worker. Ties
    go to the lowest position. Units: seconds, bytes, bytes/s.
    """

    name = "deadline"
    gain_threshold: float = 0.5
    pool_penalty: float = 0.05
    remote_penalty: float = 0.2
    backpressure: float = 0.02
    io_bps: float = 2e9
    default_bandwidth_bps: float = 1e9
    default_link_latency_s: float = 2e-3

    def finish_times(self, request: PlacementRequest, c: Candidates) -> list[float]:
        """Predicted seconds from now until the batch is ready at the client, per candidate."""
        n = len(c)
        lpc = c.latency_per_cost or (1.0,) * n
        queued = c.queued_cpu_s or (0.0,) * n
        io = request.io_bytes / self.io_bps
        cpu = request.cpu_s
        out = []
        for k, (q, w, l, kind) in enumerate(zip(queued, c.workers, lpc, c.kinds)):
            l = l if l > 0 else 1.0
            t = q * l / w + cpu * l + io
            if kind == "remote":
                bw = c.bandwidth_bps[k] if c.bandwidth_bps and c.bandwidth_bps[k] > 0 else self.default_bandwidth_bps
                lat = c.link_latency_s[k] if c.link_latency_s and c.link_latency_s[k] > 0 else self.default_link_latency_s
                t += request.out_bytes / bw + lat
            out.append(t)
        return out

    def choose(self, request: PlacementRequest, candidates: Candidates) -> Decision:
        c = candidates
        if not len(c):
            raise ValueError(f"no live DataServer to place task {request.task_id} of rank {request.rank}")
        finish = self.finish_times(request, c)
        own, d = c.local, request.deadline_s
        if d is None:
            return self._earliest(c, finish, finish, own)
        d = max(float(d), 0.0)
        scale = 1.0 / max(d, 1e-3)
        scores = []
        for k, (t, kind, o, w) in enumerate(zip(finish, c.kinds, c.outstanding, c.workers)):
            place = 0.0 if k == own else (self.remote_penalty if kind == "remote" else self.pool_penalty)
            scores.append(10.0 * max(0.0, t - d) * scale + t * scale + place + self.backpressure * o / w)
        meets = [k for k, t in enumerate(finish) if t <= d]
        if not meets:
            return self._earliest(c, finish, tuple(scores), own)
        local = [k for k in meets if c.kinds[k] != "remote"]
        if local:
            k = min(local, key=lambda k: (scores[k], k))
            remote = [j for j in range(len(c)) if c.kinds[j] == "remote"]
            if remote:
                j = min(remote, key=lambda j: (finish[j], j))
                if finish[k] - finish[j] > self.gain_threshold * d:
                    return Decision(c.server_ids[j], "remote-gain", c.server_ids, tuple(scores), tuple(finish))
            return Decision(c.server_ids[k], "local-meets", c.server_ids, tuple(scores), tuple(finish))
        k = min(meets, key=lambda k: (scores[k], k))
        return Decision(c.server_ids[k], "meets-deadline", c.server_ids, tuple(scores), tuple(finish))

    @staticmethod
    def _earliest(c: Candidates, finish: list[float], scores, own) -> Decision:
        best = min(finish)
        k = own if own is not None and finish[own] == best else finish.index(best)
        return Decision(c.server_ids[k], "earliest-finish", c.server_ids, tuple(scores), tuple(finish))


POLICIES = {"deadline": DeadlineAware, "least-request": LeastRequest}


def make_policy(name: str):
    """A placement policy by its name (``POLICIES``); ``ValueError`` lists the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"scheduler={name!r}; valid: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()
