"""The live servers' columns that placement scores (paper Eq. 1's terms), kept current in place.

``ServerColumns`` holds static columns (ids, kinds, workers) and dynamic ones (outstanding
requests, queued load, latency per unit of predicted cost, link terms, storage terms) as numpy
arrays; ``sync`` copies one server's changed state in, working Eq. 1's terms out once per change
(never per decision); ``candidates(local)`` views them as the ``Candidates`` a rank's decision takes. Pure:
server states are plain objects with the ``ServerState`` fields.
"""

from __future__ import annotations

import numpy as np

from helix_core.planning.placement import Candidates, DeadlineAware

__all__ = ["ServerColumns"]


class ServerColumns:
    """The live servers' columns for placement: static ones (ids, kinds, workers) and dynamic ones
    (outstanding, load, heartbeat terms) as numpy arrays that ``sync`` updates in place."""

    def __init__(self, live: list):
        self.servers = live
        self.ids = tuple(s.server_id for s in live)
        self.kinds = tuple(s.kind for s in live)
        self.position = {sid: k for k, sid in enumerate(self.ids)}
        self.workers = np.array([s.workers for s in live], dtype=np.float64)
        self.remote = np.array([s.kind == "remote" for s in live], dtype=bool)
        n = len(live)
        self.outstanding, self.load, self.lpc, self.bw, self.lat, self.spb, self.net_lat = (
            np.zeros(n) for _ in range(7)
        )
        self.storage_bps, self.storage_lat = np.zeros(n), np.zeros(n)  # 0: not measured
        self.depth = np.zeros(n, dtype=np.int64)
        self._candidates: dict = {}
        for s in live:
            self.sync(s)

    def sync(self, st) -> None:
        k = self.position.get(st.server_id)
        if k is None or self.servers[k] is not st:
            return
        self.outstanding[k], self.load[k], self.depth[k] = st.outstanding, st.load_cpu_s, st.queue_depth
        self.lpc[k], self.bw[k], self.lat[k] = st.latency_per_cost, st.link_bandwidth_bps, st.link_latency_s
        self.storage_bps[k], self.storage_lat[k] = st.storage_bandwidth_bps, st.storage_latency_s
        # Eq. 1's terms in effective form, worked out here once per change rather than per decision
        self.lpc[k] = st.latency_per_cost if st.latency_per_cost > 0 else 1.0
        if st.kind == "remote":
            bw = st.link_bandwidth_bps if st.link_bandwidth_bps > 0 else DeadlineAware.default_bandwidth_bps
            self.spb[k] = 1.0 / bw
            self.net_lat[k] = st.link_latency_s if st.link_latency_s > 0 else DeadlineAware.default_link_latency_s

    def candidates(self, local: int | None) -> Candidates:
        """The columns as ``Candidates`` for a rank whose own server sits at ``local``: one object
        per position, made once — its arrays are this table's, which ``sync`` keeps current."""
        got = self._candidates.get(local)
        if got is None:
            got = self._candidates[local] = Candidates(
                self.ids,
                self.kinds,
                self.workers,
                self.outstanding,
                self.depth,
                self.lpc,
                local,
                self.load,
                self.bw,
                self.lat,
                self.remote,
                self.lpc,
                self.spb,
                self.net_lat,
                self.storage_bps,
                self.storage_lat,
            )
        return got
