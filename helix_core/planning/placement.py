"""Placement policies: which DataServer executes a batch request (pure: plain data in and out).

Each policy's ``choose(request, candidates) -> Decision`` sees descriptors' cost terms and the
servers' last heartbeat state, never a socket or a clock, so tests drive it with plain lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Candidate", "Decision", "LeastRequest", "POLICIES", "PlacementRequest", "make_policy"]


class Candidate(NamedTuple):
    """A live DataServer as the Coordinator sees it. ``outstanding``: requests routed to it and
    not yet completed; ``workers``: its worker processes; ``local``: it is the requesting rank's
    own delivery server. (A NamedTuple: the Coordinator builds one per server per decision.)"""

    server_id: str
    kind: str  # "local" | "remote"
    index: int
    workers: int
    outstanding: int
    queue_depth: int = 0
    latency_per_cost: float = 1.0
    local: bool = False


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
    """The chosen server, why, and every candidate's score (lower is better)."""

    server_id: str
    reason: str
    scores: tuple[tuple[str, float], ...]


class LeastRequest:
    """Fewest outstanding requests per worker; ties go to the rank's own server, then the
    lowest index (so an idle cluster keeps work local and deterministic)."""

    name = "least-request"

    def choose(self, request: PlacementRequest, candidates: list[Candidate]) -> Decision:
        if not candidates:
            raise ValueError(f"no live DataServer to place task {request.task_id} of rank {request.rank}")
        scores = [c.outstanding / (c.workers or 1) for c in candidates]
        k = min(range(len(candidates)), key=lambda j: (scores[j], not candidates[j].local, candidates[j].index))
        best = candidates[k]
        reason = "local-least-request" if best.local else "least-request"
        return Decision(best.server_id, reason, tuple(zip((c.server_id for c in candidates), scores)))


POLICIES = {"least-request": LeastRequest}


def make_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"scheduler={name!r}; valid: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()
