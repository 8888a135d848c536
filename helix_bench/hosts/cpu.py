"""Where the emulated hosts' CPU went during a point's measured steps (``helix bench --hosts``).

A sampler thread reads, twice a second, each host's counters (``EmulatedHosts.cpu_seconds``: the
CPU its processes used and how often its quota held them back) and the CPU time of the processes
of each role on it (the DataServer, the ranks, the Coordinator; the children of a DataServer or a
rank count as ``decode``: its decode workers, or a native rank's DataLoader workers).
``window(t0, t1)`` interpolates them at the measured steps' start and end (``time.monotonic``,
which the ranks share), so start-up and imports stay out. What a host used beyond its roles is
``other``: processes not tracked, children that exited after their last sample, and the skew of
reading the counters a moment before the processes. Kernel work done in a process's own context
(sending and receiving through the namespaces' veths, mostly) counts in its role; work in
``ksoftirqd`` counts in no host's.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left

__all__ = ["HostCpuSampler", "summarize"]

PERIOD_S = 0.5
_COUNTERS = ("used_s", "throttled_s", "periods", "throttled_periods")  # EmulatedHosts.cpu_seconds


def _cpu(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


class HostCpuSampler:
    """``roles``: ``{host: {role: [pid, ...]}}``; ``children_as``: ``{role: role}`` counts the
    children of a role's processes as another role (a DataServer's workers as ``decode``)."""

    def __init__(
        self,
        hosts,
        roles: dict[str, dict[str, list[int]]],
        quotas: dict[str, float],
        children_as: dict[str, str] | None = None,
    ):
        self.hosts, self.roles, self.quotas = hosts, roles, quotas
        self.children_as = children_as or {}
        self.samples: list[tuple[float, dict]] = []
        self._seen: dict[tuple[str, str, int], float] = {}  # (host, role, pid) -> its last CPU time
        self._procs: dict[int, object] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None  # what stopped the sampling early (window() is then empty)
        self._thread = threading.Thread(target=self._run, name="helix-hostcpu", daemon=True)

    def __enter__(self) -> HostCpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive() and self.error is None:
            self._run_once()  # the last reading: the measured steps' end lies before it

    def _run(self) -> None:
        while self._run_once() and not self._stop.wait(PERIOD_S):
            pass

    def _run_once(self) -> bool:
        try:
            self._sample()
            return True
        except Exception as e:  # a counter that can't be read: no figures, rather than wrong ones
            self.error = e
            return False

    def _proc(self, pid: int):
        import psutil

        if pid not in self._procs:
            self._procs[pid] = psutil.Process(pid)
        return self._procs[pid]

    def _sample(self) -> None:
        import psutil

        t = time.monotonic()
        row = {}
        for host in self.roles:
            counters = self.hosts.cpu_seconds(host)
            for role, pids in self.roles[host].items():
                for pid in pids:
                    try:
                        proc = self._proc(pid)
                        self._seen[(host, role, pid)] = _cpu(proc)
                        kids = proc.children(recursive=True) if role in self.children_as else []
                    except psutil.Error:  # gone: its last reading stays
                        continue
                    for kid in kids:
                        try:
                            self._seen[(host, self.children_as[role], kid.pid)] = _cpu(kid)
                        except psutil.Error:
                            pass
            by_role: dict[str, float] = {}
            for (h, role, _), cpu in self._seen.items():
                if h == host:
                    by_role[role] = by_role.get(role, 0.0) + cpu
            row[host] = {**counters, "roles": by_role}
        self.samples.append((t, row))

    def window(self, t0: float, t1: float) -> dict[str, dict]:
        """Per host over ``[t0, t1]``: ``window_s`` (``t1 - t0``), ``quota_s`` (its quota times the window; None without one),
        the counters' growth (``EmulatedHosts.cpu_seconds``), ``roles`` (CPU-s per role) and ``other_s``."""
        if self.error is not None or len(self.samples) < 2 or t1 <= t0:
            return {}
        a, b = self._at(t0), self._at(t1)
        out = {}
        for host in b:
            roles = {
                r: b[host]["roles"].get(r, 0.0) - a.get(host, {}).get("roles", {}).get(r, 0.0) for r in b[host]["roles"]
            }
            if b[host]["used_s"] is None:  # no cpuacct controller here
                continue
            used = b[host]["used_s"] - a[host]["used_s"]
            quota = self.quotas.get(host)
            out[host] = {
                "window_s": t1 - t0,
                "quota_s": quota * (t1 - t0) if quota else None,
                "used_s": used,
                **{k: b[host][k] - a[host][k] for k in _COUNTERS[1:]},
                "roles": roles,
                "other_s": used - sum(roles.values()),
            }
        return out

    def _at(self, t: float) -> dict:
        """The counters at ``t``, linearly between the samples around it."""
        times = [s[0] for s in self.samples]
        k = min(max(bisect_left(times, t), 1), len(times) - 1)
        (ta, ra), (tb, rb) = self.samples[k - 1], self.samples[k]
        w = min(1.0, max(0.0, (t - ta) / (tb - ta))) if tb > ta else 1.0

        def mix(x: float | None, y: float | None) -> float | None:
            return None if x is None or y is None else x + w * (y - x)

        return {
            h: {
                **{k: mix(ra[h][k], rb[h][k]) for k in _COUNTERS},
                "roles": {r: mix(ra[h]["roles"].get(r, 0.0), v) for r, v in rb[h]["roles"].items()},
            }
            for h in rb
            if h in ra
        }


def summarize(per_host: dict[str, dict], kind: str) -> dict | None:
    """The hosts of one kind (``h``: GPU hosts, ``s``: sidecars) added up: window (host-seconds),
    quota, used, throttled and the roles, in CPU-s over the measured steps."""
    hosts = [v for h, v in per_host.items() if h.startswith(kind)]
    if not hosts:
        return None
    total: dict = {"hosts": len(hosts), "roles": {}}
    for key in ("window_s", "quota_s", "other_s", *_COUNTERS):
        values = [v[key] for v in hosts if v[key] is not None]
        total[key] = sum(values) if values else None
    for v in hosts:
        for role, cpu in v["roles"].items():
            total["roles"][role] = total["roles"].get(role, 0.0) + cpu
    return total
