"""Emulated hosts: several machines on this one, for tests and the bench of what crosses hosts.

Each host is a Linux network + mount + UTS namespace: its own address on a bridge that lives in a
namespace of its own (no route out of it: the addresses exist only inside namespaces made here),
its own loopback, its own hostname and its own /dev/shm (a private tmpfs), while the file system
is shared as NFS would share it. A host may have a CPU quota (cgroup v1 ``cpu.cfs_quota_us``) and
a link rate (``tc tbf`` on both ends of its veth). Processes run in a host through ``nsenter``
into a holder process that keeps the host's namespaces alive.

Needs root, ``ip``, ``unshare`` and ``nsenter`` (``EmulatedHosts.unavailable()`` says what is
missing). ``close()`` — also on an exception inside ``with``, and at interpreter exit — kills
every process it started and removes every namespace, veth and cgroup it made.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence

__all__ = ["EmulatedHosts", "leftovers"]

_CGROUP_CPU = "/sys/fs/cgroup/cpu"  # the quota (cfs_quota_us) and its throttling (cpu.stat)
_CGROUP_ACCT = "/sys/fs/cgroup/cpuacct"  # the CPU a host used (cpuacct.usage), every host
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,19}$")
_PREFIX = "hx"  # every namespace and cgroup made here: hx<tag>-<name>


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"EmulatedHosts: {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def leftovers(tag: str) -> list[str]:
    """What an ``EmulatedHosts`` with ``tag`` left behind: namespaces, cgroups, holder processes."""
    left = []
    netns = _sh("ip", "netns", "list", check=False).stdout.split()
    left += [f"netns {n}" for n in netns if n.startswith(f"{_PREFIX}{tag}-")]
    for root in dict.fromkeys(os.path.realpath(r) for r in (_CGROUP_CPU, _CGROUP_ACCT)):  # often one mount
        if os.path.isdir(root):
            left += [f"cgroup {root}/{n}" for n in os.listdir(root) if n.startswith(f"{_PREFIX}{tag}-")]
    ps = _sh("ps", "-eo", "pid,args", check=False).stdout.splitlines()
    left += [f"process {line.strip()}" for line in ps if f"helix-host-{tag}-" in line]
    return left


class EmulatedHosts:
    """``with EmulatedHosts(["a", "b"], cpus={"b": 0.5}, link_mbps=100) as hosts:`` — then
    ``hosts.address("a")``, ``hosts.popen("a", argv)``, ``hosts.run("b", argv)``.

    ``names``: host names (lowercase letters, digits, ``-``; also their hostnames); ``cpus``: a CPU
    quota in cores, for every host or by name; ``link_mbps``: a link rate, likewise; ``shm_mb``:
    each host's /dev/shm size. Addresses are ``<subnet>.<10 + position>`` (198.51.100.0/24, TEST-NET-2).
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        cpus: float | Mapping[str, float] | None = None,
        link_mbps: float | Mapping[str, float] | None = None,
        shm_mb: int = 1024,
        subnet: str = "198.51.100",
    ):
        names = list(names)
        bad = [n for n in names if not isinstance(n, str) or not _NAME.match(n)]
        if not names or bad or len(set(names)) != len(names):
            raise ValueError(f"EmulatedHosts: host names must be distinct, lowercase, [a-z][a-z0-9-]*, got {names!r}")
        self.names, self.subnet, self.shm_mb = names, subnet, int(shm_mb)
        self.cpus = self._per_host(cpus, "cpus")
        self.link_mbps = self._per_host(link_mbps, "link_mbps")
        self.tag = uuid.uuid4().hex[:6]
        self._holders: dict[str, subprocess.Popen] = {}
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces, in the order made
        self._cgroups: list[str] = []
        self._closed = True

    def _per_host(self, value, what: str) -> dict[str, float]:
        if value is None:
            return {}
        values = dict(value) if isinstance(value, Mapping) else {n: value for n in self.names}
        unknown = sorted(set(values) - set(self.names))
        if unknown:
            raise ValueError(f"EmulatedHosts: {what} names hosts {unknown} that are not among {self.names}")
        for n, v in values.items():
            if not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise ValueError(f"EmulatedHosts: {what}[{n!r}] must be a positive number, got {v!r}")
        return {n: float(v) for n, v in values.items()}

    @staticmethod
    def unavailable() -> str | None:
        """Why hosts can't be emulated here (None: they can)."""
        if os.geteuid() != 0:
            return "emulated hosts need root (network, mount and UTS namespaces)"
        missing = [t for t in ("ip", "unshare", "nsenter", "tc") if shutil.which(t) is None]
        if missing:
            return f"emulated hosts need {', '.join(missing)} (iproute2, util-linux)"
        return None

    # ---- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> EmulatedHosts:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ns(self, name: str) -> str:
        return f"{_PREFIX}{self.tag}-{name}"

    def address(self, name: str) -> str:
        """The host's address on the bridge (reachable from every emulated host, from nowhere else)."""
        return f"{self.subnet}.{10 + self.names.index(name)}"

    def start(self) -> None:
        why = self.unavailable()
        if why:
            raise RuntimeError(f"EmulatedHosts: {why}")
        self._closed = False
        atexit.register(self.close)
        try:
            bridge = self.ns("br")
            _sh("ip", "netns", "add", bridge)
            self._made.append(bridge)
            _sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", bridge, "link", "set", "br0", "up")
            for k, name in enumerate(self.names):
                self._add_host(k, name, bridge)
        except BaseException:
            self.close()
            raise

    def _add_host(self, k: int, name: str, bridge: str) -> None:
        ns, veth = self.ns(name), f"v{k}"
        _sh("ip", "netns", "add", ns)
        self._made.append(ns)
        _sh("ip", "-n", bridge, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "-n", bridge, "link", "set", veth, "master", "br0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if name in self.link_mbps:  # both directions: the host's egress and the bridge's egress to it
            for where, dev in ((ns, "eth0"), (bridge, veth)):
                rate = self.link_mbps[name]
                burst = max(16_384, int(rate * 1e6 / 8 / 100))  # 10 ms of the rate, at least 16 KiB
                _sh(
                    "ip",
                    "netns",
                    "exec",
                    where,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{rate}mbit",
                    "burst",
                    str(burst),
                    "latency",
                    "100ms",
                )
        cgroups = self._host_cgroups(name)
        for cg in dict.fromkeys(cgroups.values()):  # one directory where cpu and cpuacct share a mount
            os.mkdir(cg)
            self._cgroups.append(cg)
        if "cpu" in cgroups:
            cg = cgroups["cpu"]
            with open(os.path.join(cg, "cpu.cfs_period_us"), "w") as f:
                f.write("100000")
            with open(os.path.join(cg, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(max(1000, int(self.cpus[name] * 100_000))))
        script = (
            f"mount -t tmpfs -o size={self.shm_mb}m,mode=1777 tmpfs /dev/shm && hostname {name} "
            f"&& echo ready && exec -a helix-host-{self.tag}-{name} sleep 1000000"
        )
        holder = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "bash",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._holders[name] = holder
        if holder.stdout.readline().strip() != "ready":
            raise RuntimeError(f"EmulatedHosts: host {name!r} did not start: {holder.stderr.read().strip()}")

    def _enter(self, name: str, argv: Sequence[str]) -> list[str]:
        if self._closed:
            raise RuntimeError("EmulatedHosts: not started (use it in a with block)")
        if name not in self._holders:
            raise ValueError(f"EmulatedHosts: no host {name!r}; hosts: {self.names}")
        enter = ["nsenter", "-t", str(self._holders[name].pid), "-n", "-m", "-u", "--", *map(str, argv)]
        # join the host's cgroups first, so every child inherits the quota and is counted
        joins = [os.path.join(cg, "cgroup.procs") for cg in dict.fromkeys(self._host_cgroups(name).values())]
        if joins:
            return ["sh", "-c", "".join(f"echo $$ > {p} && " for p in joins) + 'exec "$@"', "sh", *enter]
        return enter

    def _host_cgroups(self, name: str) -> dict[str, str]:
        """``{"acct": dir}`` (where the cpuacct controller is mounted) and ``{"cpu": dir}`` (with a
        quota) of host ``name``: the same directory where the two controllers share a mount."""
        out = {}
        if os.path.isdir(_CGROUP_ACCT):
            out["acct"] = os.path.join(os.path.realpath(_CGROUP_ACCT), self.ns(name))
        if name in self.cpus:
            out["cpu"] = os.path.join(os.path.realpath(_CGROUP_CPU), self.ns(name))
        return out

    def cpu_seconds(self, name: str) -> dict[str, float | None]:
        """CPU-seconds the processes started on host ``name`` used so far (``used_s``, kernel time
        spent on their behalf included; None where no cpuacct controller is mounted); with a quota,
        the time it held them back (``throttled_s``, summed over the CPUs), its periods with work
        (``periods``) and those that ran out of quota (``throttled_periods``); 0 without one.
        Counters: read them before and after what you measure."""
        if name not in self._holders:
            raise ValueError(f"EmulatedHosts: no host {name!r}; hosts: {self.names}")
        used, throttled, periods, held = None, 0.0, 0.0, 0.0
        cgroups = self._host_cgroups(name)
        acct = os.path.join(cgroups.get("acct", ""), "cpuacct.usage")
        if "acct" in cgroups and os.path.exists(acct):
            with open(acct) as f:
                used = int(f.read()) / 1e9
        stat = os.path.join(cgroups.get("cpu", ""), "cpu.stat")
        if "cpu" in cgroups and os.path.exists(stat):
            with open(stat) as f:
                fields = dict(line.split() for line in f if line.strip())
            throttled = int(fields.get("throttled_time", 0)) / 1e9  # summed over the CPUs' run queues
            periods, held = float(fields.get("nr_periods", 0)), float(fields.get("nr_throttled", 0))
        return {"used_s": used, "throttled_s": throttled, "periods": periods, "throttled_periods": held}

    def popen(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``name`` (its own session; killed, with its group, at ``close()``)."""
        proc = subprocess.Popen(self._enter(name, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``name`` to its end (``subprocess.run``'s arguments)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self._enter(name, argv), timeout=timeout, start_new_session=True, **kwargs)

    def _kill_in_namespaces(self, sig) -> None:
        """Signal every process still in one of the hosts' network namespaces."""
        for ns in self._made:
            try:
                pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            except subprocess.TimeoutExpired:
                continue
            for pid in pids:
                try:
                    os.kill(int(pid), sig)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass

    def close(self) -> None:
        """Stop every process started here, then remove the hosts (idempotent)."""
        if self._closed and not self._made:
            return
        self._closed = True
        procs = list(self._procs) + list(self._holders.values())
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for p in procs:  # the whole group, even when its leader is gone (its children may not be)
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            self._kill_in_namespaces(sig)  # what left its group (setsid: torchrun's workers) but not the host
            deadline = time.monotonic() + wait
            for p in procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            procs = [p for p in procs if p.poll() is None]
            if not procs:
                break
        for p in self._holders.values():
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        self._kill_in_namespaces(signal.SIGKILL)
        for ns in reversed(self._made):  # removing a namespace removes the veth ends inside it
            try:
                _sh("ip", "netns", "del", ns, check=False)
            except subprocess.TimeoutExpired:
                pass
        for cg in self._cgroups:
            try:  # whatever left the hosts' namespaces but not their cgroups
                with open(os.path.join(cg, "cgroup.procs")) as f:
                    for pid in f.read().split():
                        os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
            for _ in range(50):
                try:
                    os.rmdir(cg)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy for a moment after its last process exits
                    time.sleep(0.1)
        self._made, self._cgroups, self._holders, self._procs = [], [], {}, []
        atexit.unregister(self.close)
