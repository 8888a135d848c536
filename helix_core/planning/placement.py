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

import numpy as np

#: A column of ``Candidates``: a tuple, or a numpy array the Coordinator keeps up to date.
Column = tuple[float, ...] | tuple[int, ...] | np.ndarray

__all__ = [
    "Candidates",
    "DeadlineAware",
    "Decision",
    "LeastRequest",
    "SCHEDULERS",
    "PlacementRequest",
    "make_scheduler",
]


@dataclass(frozen=True)
class Candidates:
    """The live DataServers as the Coordinator sees them, as columns in cluster order (one entry
    per server; position = cluster index order, so ties can go to the lowest position). Columns —
    tuples, or numpy arrays that the Coordinator keeps up to date — not one object per server, so a
    decision over 64 servers is a handful of vector operations.

    ``outstanding``: requests routed to a server and not yet completed; ``workers``: its worker
    processes; ``queue_depth`` / ``latency_per_cost`` (wall seconds of execution per predicted
    CPU second): its last heartbeat; ``queued_cpu_s``: predicted CPU seconds queued or running
    there; ``bandwidth_bps`` / ``link_latency_s``: a sidecar's measured delivery link (0:
    unknown); ``storage_bps`` / ``storage_latency_s``: what reading a sample from storage costs
    there — bytes/s and seconds per sample, measured by the server on the samples it fetched by URL
    (0: not measured: local files, or nothing read yet). Optional columns may be empty (= unknown).
    ``local``: the position of the requesting rank's own delivery server, None if it is not a
    candidate."""

    server_ids: tuple[str, ...]
    kinds: tuple[str, ...]
    workers: Column
    outstanding: Column
    queue_depth: Column = ()
    latency_per_cost: Column = ()
    local: int | None = None
    queued_cpu_s: Column = ()
    bandwidth_bps: Column = ()
    link_latency_s: Column = ()
    remote_mask: np.ndarray | None = None  # kinds == "remote", precomputed (the Coordinator caches it)
    # precomputed by the Coordinator (None: derived here): effective latency per cost (> 0), and the
    # network terms of Eq. 1 per server — seconds per output byte and seconds per delivery, 0 for local ones
    effective_lpc: np.ndarray | None = None
    net_s_per_byte: np.ndarray | None = None
    net_latency_s: np.ndarray | None = None
    storage_bps: Column = ()
    storage_latency_s: Column = ()

    def __post_init__(self):
        n = len(self.server_ids)
        optional = (
            self.queue_depth,
            self.latency_per_cost,
            self.queued_cpu_s,
            self.bandwidth_bps,
            self.link_latency_s,
            self.storage_bps,
            self.storage_latency_s,
        )
        if not (len(self.kinds) == len(self.workers) == len(self.outstanding) == n) or any(
            len(col) not in (0, n) for col in optional
        ):
            raise ValueError("Candidates: columns of different lengths")
        fewest = (self.workers.min() if isinstance(self.workers, np.ndarray) else min(self.workers)) if n else 1
        if fewest < 1:
            raise ValueError(f"Candidates: a server with {fewest} workers")
        if isinstance(self.kinds, np.ndarray):
            raise ValueError("Candidates.kinds must be a tuple of str")
        if self.local is not None and not 0 <= self.local < n:
            raise ValueError(f"Candidates.local={self.local}: no such position among {n} servers")

    def __len__(self) -> int:
        return len(self.server_ids)

    @classmethod
    def from_rows(cls, rows: list[dict], local: str | None = None) -> Candidates:
        """From one dict per server (``server_id``, ``kind``, ``workers``, ``outstanding``, optional
        ``queue_depth``, ``latency_per_cost``, ``queued_cpu_s``, ``bandwidth_bps``,
        ``link_latency_s``, ``storage_bps``, ``storage_latency_s``); ``local`` names the rank's own
        server."""
        ids = tuple(r["server_id"] for r in rows)

        def col(key, default):
            return tuple(r.get(key, default) for r in rows)

        return cls(
            ids,
            col("kind", "local"),
            col("workers", 1),
            col("outstanding", 0),
            col("queue_depth", 0),
            col("latency_per_cost", 1.0),
            None if local is None else ids.index(local),
            col("queued_cpu_s", 0.0),
            col("bandwidth_bps", 0.0),
            col("link_latency_s", 0.0),
            storage_bps=col("storage_bps", 0.0),
            storage_latency_s=col("storage_latency_s", 0.0),
        )


@dataclass(frozen=True)
class PlacementRequest:
    """One batch request: who asks, its predicted cost (CPU seconds on one core, input and output
    bytes, tokens), its deadline (seconds from now until the rank needs it; None: unknown) and its
    number of ``samples`` (each pays a storage read's fixed latency; 0: unknown, counted as 1)."""

    rank: int
    task_id: int
    cpu_s: float = 0.0
    out_bytes: int = 0
    tokens: int = 0
    deadline_s: float | None = None
    io_bytes: int = 0
    samples: int = 0


class Decision:
    """The chosen server, why, and every candidate's score (lower is better), aligned with
    ``candidates`` (the servers' ids); ``finish_s``: each candidate's predicted ready time, seconds
    from now (deadline-aware policies; empty otherwise); ``index``: the chosen one's position.
    ``scores`` may be given as a function computing them: a decision needs only the best
    candidates, the log shows every score when someone reads it."""

    __slots__ = ("server_id", "reason", "candidates", "_scores", "finish_s", "index")

    def __init__(self, server_id: str, reason: str, candidates: tuple[str, ...], scores, finish_s=(), index: int = -1):
        self.server_id, self.reason, self.candidates = server_id, reason, candidates
        self._scores, self.finish_s, self.index = scores, finish_s, index

    @property
    def scores(self):
        if callable(self._scores):
            self._scores = self._scores()
        return self._scores

    def scores_by_server(self) -> dict[str, float]:
        return dict(zip(self.candidates, map(float, self.scores)))

    def finish_by_server(self) -> dict[str, float]:
        return dict(zip(self.candidates, map(float, self.finish_s)))

    @property
    def finish(self) -> float:
        """The chosen server's predicted ready time (seconds from now); 0 when not predicted."""
        return float(self.finish_s[self.index]) if len(self.finish_s) and self.index >= 0 else 0.0

    def __repr__(self) -> str:
        return f"Decision({self.server_id!r}, {self.reason!r}, finish={self.finish:.4f})"


def _col(values, n: int, default: float) -> np.ndarray:
    return np.asarray(values, dtype=np.float64) if len(values) else np.full(n, default)


class LeastRequest:
    """Fewest outstanding requests per worker; ties go to the rank's own server, then the
    lowest index (so an idle cluster keeps work local and deterministic)."""

    name = "least-request"

    def choose(self, request: PlacementRequest, candidates: Candidates) -> Decision:
        c = candidates
        if not len(c):
            raise ValueError(f"no live DataServer to place task {request.task_id} of rank {request.rank}")
        scores = _col(c.outstanding, len(c), 0.0) / _col(c.workers, len(c), 1.0)  # workers >= 1
        k = int(scores.argmin())
        if c.local is not None and scores[c.local] == scores[k]:
            k = c.local
        reason = "local-least-request" if k == c.local else "least-request"
        return Decision(c.server_ids[k], reason, c.server_ids, scores, (), k)


@dataclass(frozen=True)
class DeadlineAware:
    """Eq. 1: predicted ready time per candidate against the rank's deadline.

    ``T_i = queued_cpu_s_i * lpc_i / workers_i`` (work ahead of it) ``+ cpu_s * lpc_i`` (this
    batch on one worker; ``lpc``: measured wall seconds per predicted CPU second, 1 when unknown)
    ``+ C_io + C_net``. ``C_io`` is what reading the batch's input costs on that server:
    ``io_bytes / storage_bps_i + samples * storage_latency_s_i`` where the server measured its
    storage (samples read by URL), else ``io_bytes / io_bps`` as for a local file — so a sidecar
    beside the bucket and one behind a slow link are priced apart, and a server that has read
    nothing remote keeps the default. ``C_net`` (sidecars only): ``out_bytes / bandwidth + latency``,
    with ``default_*`` until the link was measured. Same-host local servers deliver by shared
    memory, so their ``C_net`` is 0.

    Locality is the network: every local server delivers through shared memory on the rank's
    host, so among them the batch goes where it is ready soonest (the rank's own server wins near
    ties), while a remote sidecar costs a stream. Selection: no deadline, or every candidate
    misses -> earliest finish ("earliest-finish"); a local server meets -> the best local one by
    score ("local-meets"), unless a remote one is ready more than ``gain_threshold`` x D sooner
    ("remote-gain"); only sidecars meet -> the best of them ("meets-deadline"). Score =
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

    def network_terms(self, c: Candidates, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(seconds per output byte, seconds per delivery) of each candidate: 0 for local servers,
        the measured link (else the defaults) for remote ones."""
        if c.net_s_per_byte is not None and c.net_latency_s is not None:
            return c.net_s_per_byte, c.net_latency_s
        n = len(c)
        bw, lat = _col(c.bandwidth_bps, n, 0.0), _col(c.link_latency_s, n, 0.0)
        spb = np.where(remote, 1.0 / np.where(bw > 0, bw, self.default_bandwidth_bps), 0.0)
        return spb, np.where(remote, np.where(lat > 0, lat, self.default_link_latency_s), 0.0)

    def finish_times(self, request: PlacementRequest, c: Candidates, remote: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds from now until the batch is ready at the client, per candidate."""
        n = len(c)
        lpc = c.effective_lpc
        if lpc is None:
            lpc = _col(c.latency_per_cost, n, 1.0)
            lpc = np.where(lpc > 0, lpc, 1.0)
        spb, lat = self.network_terms(c, _remote(c) if remote is None else remote)
        t = (_col(c.queued_cpu_s, n, 0.0) / _col(c.workers, n, 1.0) + request.cpu_s) * lpc
        t += spb * request.out_bytes
        t += lat + self.io_seconds(request, c)
        return t

    def io_seconds(self, request: PlacementRequest, c: Candidates) -> float | np.ndarray:
        """``C_io`` per candidate (seconds): the measured storage terms where a server has them,
        ``io_bytes / io_bps`` elsewhere (a scalar when no candidate measured any). A request of
        unknown input (``io_bytes`` 0) reads nothing."""
        default = request.io_bytes / self.io_bps
        bw = c.storage_bps
        if not request.io_bytes or not len(bw):
            return default
        bw = np.asarray(bw, dtype=np.float64)
        measured = bw > 0
        if not measured.any():
            return default
        latency = _col(c.storage_latency_s, len(c), 0.0) * max(request.samples, 1)
        return np.where(measured, request.io_bytes / np.where(measured, bw, 1.0) + latency, default)

    def scores(self, request: PlacementRequest, c: Candidates, finish: np.ndarray, outstanding=None) -> np.ndarray:
        """Every candidate's score (lower is better; see the class docstring)."""
        n, d = len(c), max(float(request.deadline_s or 0.0), 0.0)
        inv = 1.0 / max(d, 1e-3)
        remote = _remote(c)
        out = _col(c.outstanding if outstanding is None else outstanding, n, 0.0)
        scores = (
            np.maximum(finish - d, 0.0) * (10.0 * inv)
            + finish * inv
            + np.where(remote, self.remote_penalty, self.pool_penalty)
            + self.backpressure * out / _col(c.workers, n, 1.0)
        )
        if c.local is not None:
            scores[c.local] -= (
                self.remote_penalty if remote[c.local] else self.pool_penalty
            )  # the rank's own: no penalty
        return scores

    def choose(self, request: PlacementRequest, candidates: Candidates) -> Decision:
        c = candidates
        if not len(c):
            raise ValueError(f"no live DataServer to place task {request.task_id} of rank {request.rank}")
        remote = _remote(c)
        finish = self.finish_times(request, c, remote)
        own, d = c.local, request.deadline_s
        if d is None:
            return self._earliest(c, finish, finish, own)
        d = max(float(d), 0.0)
        outstanding = np.array(c.outstanding, dtype=np.float64)  # a snapshot: the Coordinator's columns move on
        lazy = lambda: self.scores(request, c, finish, outstanding)
        kinds = c.kinds
        n_local = kinds.index("remote") if "remote" in kinds else len(kinds)
        if kinds.count("remote") == len(kinds) - n_local:  # locals first (the Coordinator's order): no masks
            local_ok = [k for k, t in enumerate(finish[:n_local].tolist()) if t <= d]
            j = n_local + int(finish[n_local:].argmin()) if n_local < len(kinds) else None
        else:
            local_ok = np.flatnonzero((finish <= d) > remote).tolist()
            j = int((finish + np.where(remote, 0.0, np.inf)).argmin()) if remote.any() else None
        if local_ok:  # few (one per rank at most): scored in plain Python
            inv, best = 1.0 / max(d, 1e-3), None
            for k in local_ok:
                score = (
                    finish.item(k) * inv
                    + (0.0 if k == own else self.pool_penalty)
                    + self.backpressure * outstanding.item(k) / float(c.workers[k])
                )
                if best is None or score < best[0]:
                    best = (score, k)
            assert best is not None  # every server is a candidate here, and there is at least one
            k = best[1]
            if j is not None and finish.item(k) - finish.item(j) > self.gain_threshold * d:
                return Decision(c.server_ids[j], "remote-gain", c.server_ids, lazy, finish, j)
            return Decision(c.server_ids[k], "local-meets", c.server_ids, lazy, finish, k)
        meets = finish <= d
        if not meets.any():
            return self._earliest(c, finish, lazy, own)
        k = int(np.where(meets, self.scores(request, c, finish, outstanding), np.inf).argmin())
        return Decision(c.server_ids[k], "meets-deadline", c.server_ids, lazy, finish, k)

    @staticmethod
    def _earliest(c: Candidates, finish: np.ndarray, scores, own) -> Decision:
        k = int(finish.argmin())
        if own is not None and finish[own] == finish[k]:
            k = own
        return Decision(c.server_ids[k], "earliest-finish", c.server_ids, scores, finish, k)


def _remote(c: Candidates) -> np.ndarray:
    remote = getattr(c, "remote_mask", None)
    return remote if remote is not None else np.array([k == "remote" for k in c.kinds], dtype=bool)


#: Placement policies by the name a loader's ``scheduler=`` gives them.
SCHEDULERS = {"deadline": DeadlineAware, "least-request": LeastRequest}


def make_scheduler(name: str):
    """A placement policy by its scheduler name (``SCHEDULERS``); ``ValueError`` lists the valid ones."""
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler={name!r}; valid: {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name]()
