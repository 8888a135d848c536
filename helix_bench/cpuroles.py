"""Where the CPU goes: CPU-seconds by role over the measured steps of a benchmark run.

Take a :func:`snapshot` of every process of the run when the measured steps start and another
when they end; :func:`cpu_by_role` subtracts them per role; :func:`split_decode` moves the
decode's own CPU (thread CPU of the decode calls, from ``timed.read_decode_log``) out of the
role of the processes that decoded into ``"decode"``; :func:`decode_efficiency` is the
yardstick's decode CPU-seconds of the measured samples over all CPU-seconds used.

Roles are plain strings. Explicit pids get theirs (``"ranks"``, ``"dataservers"``,
``"coordinator"``, ``"ray-decoders"``, ...); their descendants inherit it through ``child_roles``
(children of ``"ranks"`` are ``"loader-workers"``, children of ``"dataservers"`` are
``"workers"``); every other descendant of the run's root process is ``"other"``.
Only :func:`snapshot` reads processes; the rest is pure.
"""

from __future__ import annotations

__all__ = ["CpuSnapshot", "assign_roles", "cpu_by_role", "decode_efficiency", "snapshot", "split_decode"]

#: pid -> (role, user + system CPU-seconds of that process alone, children not included)
CpuSnapshot = dict[int, tuple[str, float]]

OTHER = "other"
DECODE = "decode"


def assign_roles(
    parents: dict[int, int | None], roles: dict[str, list[int]], child_roles: dict[str, str], root_pid: int
) -> dict[int, str]:
    """Role of every pid of ``parents`` (pid -> parent pid) under the rules of the module docstring.

    A pid is explicit (its role), else inherits from its nearest explicit ancestor — mapped by
    ``child_roles`` one generation at a time (``child_roles.get(parent_role, parent_role)``) — else
    is ``"other"`` when ``root_pid`` is an ancestor. Pids that fit none of these are left out."""
    explicit = {pid: role for role, pids in roles.items() for pid in pids}
    out: dict[int, str] = {}

    def role_of(pid: int, seen: frozenset) -> str | None:
        if pid in out:
            return out[pid]
        if pid in explicit:
            return explicit[pid]
        parent = parents.get(pid)
        if parent is None or parent in seen:
            return None
        if parent == root_pid and parent not in explicit:
            return OTHER
        up = role_of(parent, seen | {pid})
        if up is None:
            return None
        return OTHER if up == OTHER else child_roles.get(up, up)

    for pid in parents:
        role = role_of(pid, frozenset())
        if role is not None:
            out[pid] = role
    return out


def snapshot(roles: dict[str, list[int]], root_pid: int, child_roles: dict[str, str] | None = None) -> CpuSnapshot:
    """CPU-seconds (user + system) and role of every explicit pid, every descendant of one and
    every descendant of ``root_pid`` (``root_pid`` itself only if it is explicit). Processes that
    vanish while being read are skipped."""
    import psutil

    parents: dict[int, int | None] = {}
    procs: dict[int, psutil.Process] = {}
    tops = {int(root_pid)} | {int(p) for pids in roles.values() for p in pids}
    for top in tops:
        try:
            proc = psutil.Process(top)
            family = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        for p in family:
            try:
                parents.setdefault(p.pid, p.ppid())
                procs.setdefault(p.pid, p)
            except psutil.Error:
                continue
    out: CpuSnapshot = {}
    for pid, role in assign_roles(parents, roles, child_roles or {}, int(root_pid)).items():
        try:
            t = procs[pid].cpu_times()
        except psutil.Error:
            continue
        out[pid] = (role, float(t.user + t.system))
    return out


def cpu_by_role(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """CPU-seconds per role between two snapshots.

    A process in both counts its difference; one born in between (or whose pid was reused: another
    role, or less CPU than before) counts its whole CPU from ``after``. A process that exited in
    between is not in ``after`` and its CPU in the window is lost — take ``after`` while the
    system still runs."""
    out: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        prev = before.get(pid)
        used = cpu - prev[1] if prev is not None and prev[0] == role and prev[1] <= cpu else cpu
        out[role] = out.get(role, 0.0) + used
    return out


def split_decode(by_role: dict[str, float], decode_cpu_s: float, worker_role: str) -> dict[str, float]:
    """A copy of ``by_role`` with ``decode_cpu_s`` moved from ``worker_role`` (the processes that
    decoded) into ``"decode"``; the worker role keeps the rest (collate, shared-memory writes,
    IPC), at least 0."""
    if decode_cpu_s < 0:
        raise ValueError(f"decode_cpu_s must be >= 0 CPU-seconds, got {decode_cpu_s}")
    out = dict(by_role)
    out[worker_role] = max(0.0, out.get(worker_role, 0.0) - decode_cpu_s)
    out[DECODE] = out.get(DECODE, 0.0) + decode_cpu_s
    return out


def decode_efficiency(yardstick_s: float, by_role: dict[str, float]) -> float | None:
    """Yardstick decode CPU-seconds of the measured samples / all CPU-seconds used (every role):
    1.0 would mean every CPU-second went into decoding at single-decoder speed. None when no CPU
    was measured."""
    total = sum(by_role.values())
    return yardstick_s / total if total > 0 else None
