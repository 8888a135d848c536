"""Placement policies: which DataServer executes a batch request (pure: plain data in and out).

Each policy's ``choose(request, candidates) -> Decision`` sees descriptors' cost terms and the
servers' last heartbeat state, never a socket or a clock, so tests drive it with plain tuples.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import truediv

__all__ = ["Candidates", "Decision", "LeastRequest", "POLICIES", "PlacementRequest", "make_policy"]


@dataclass(frozen=True)
class Candidates:
    """The live DataServers as the Coordinator sees them, as columns in cluster order (one entry
    per server; position = cluster index order, so ties can go to the lowest position). Columns,
    not one object per server: a decision over 64 servers stays well under 100 µs in Python.

    ``outstanding``: requests routed to a server and not yet completed; ``workers``: its worker
    processes; ``queue_depth`` / ``latency_per_cost``: its last heartbeat (empty = unknown);
    ``local``: the position of the requesting rank's own delivery server, None if it is not a
    candidate."""

    server_ids: tuple[str, ...]
    kinds: tuple[str, ...]
    workers: tuple[int, ...]
    outstanding: tuple[int, ...]
    queue_depth: tuple[int, ...] = ()
    latency_per_cost: tuple[float, ...] = ()
    local: int | None = None

    def __post_init__(self):
        n = len(self.server_ids)
        if not (len(self.kinds) == len(self.workers) == len(self.outstanding) == n) or \
                len(self.queue_depth) not in (0, n) or len(self.latency_per_cost) not in (0, n):
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
        ``queue_depth`` / ``latency_per_cost``); ``local`` names the rank's own server."""
        ids = tuple(r["server_id"] for r in rows)
        return cls(ids, tuple(r["kind"] for r in rows), tuple(r["workers"] for r in rows),
                   tuple(r["outstanding"] for r in rows), tuple(r.get("queue_depth", 0) for r in rows),
                   tuple(r.get("latency_per_cost", 1.0) for r in rows), None if local is None else ids.index(local))


@dataclass(frozen=True)
class PlacementRequest:
    """One batch request: who asks, and its predicted cost (CPU seconds, bytes, tokens)."""

    rank: int
    task_id: int
    cpu_s: float = 0.0
    out_bytes: int = 0
    tokens: int = 0
    deadline_s: float = 0.0


@dataclass(frozen=True)
class Decision:
    """The chosen server, why, and every candidate's score (lower is better), aligned with
    ``candidates`` (the servers' ids)."""

    server_id: str
    reason: str
    candidates: tuple[str, ...]
    scores: tuple[float, ...]

    def scores_by_server(self) -> dict[str, float]:
        return dict(zip(self.candidates, self.scores))


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


POLICIES = {"least-request": LeastRequest}


def make_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"scheduler={name!r}; valid: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()
