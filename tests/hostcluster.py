"""Helix services on emulated hosts, as tests start them: a Cluster of CLI-started services (a
Coordinator and a local DataServer on hosts a and b, a sidecar on c), the ranks' results, and what
each host's namespace shows (listening sockets, slabs left). Shared by tests/launch/test_hosts.py
and tests/tier2/test_tier2_security.py."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from torch.utils.data import DistributedSampler

from helix_core.config import ClusterConfig
from helix_core.security.tls import write_certificates
from helix_core.testing.datasets import IndexDataset
from helix_core.testing.emulated_hosts import EmulatedHosts

APPS = Path(__file__).resolve().parent / "apps"

CFG = json.dumps(ClusterConfig.for_tests().to_dict())
TOKEN = "emulated-hosts-token"
EVERY = {"00000000", "0" * 32}  # 0.0.0.0 and :: in /proc/net/tcp{,6}: a socket on every interface


class Cluster:
    """A Coordinator on host a, one local DataServer (local rank 0) on each of a and b, and a
    remote sidecar on c: each started with the ``helix`` command on its own host, with a token and
    TLS (``helix certs``-style certificates for the hosts' addresses; ``tls=False``: --insecure);
    ``config``: the services' ``ClusterConfig`` as JSON."""

    def __init__(self, hosts: EmulatedHosts, tmp: Path, tls: bool = True, more_locals: tuple = (), config: str = CFG):
        self.hosts, self.tmp, self.config = hosts, tmp, config
        self.token_file = tmp / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)  # a token file others may read is refused
        self.procs, self.info = {}, {}
        self.env = dict(os.environ)
        if tls:
            certs = write_certificates(str(tmp / "certs"), [hosts.address(n) for n in hosts.names])
            self.env.update(HELIX_TLS_CERT=certs["cert"], HELIX_TLS_KEY=certs["key"], HELIX_TLS_CA=certs["ca"])
        self.flags = [] if tls else ["--insecure"]
        a = hosts.address("a")
        self.coordinator = self._start("coordinator", "a", ["coordinator", "--host", a, "--port", "7070"])["address"]
        for name in ("a", "b"):
            self._start(
                f"local-{name}",
                name,
                [
                    "dataserver",
                    "--coordinator",
                    self.coordinator,
                    "--local-rank",
                    "0",
                    "--workers",
                    "1",
                    "--host",
                    hosts.address(name),
                ],
            )
        for name, local_rank in more_locals:  # more local servers: (host, local rank)
            self._start(
                f"local-{name}{local_rank}",
                name,
                [
                    "dataserver",
                    "--coordinator",
                    self.coordinator,
                    "--local-rank",
                    str(local_rank),
                    "--workers",
                    "1",
                    "--host",
                    hosts.address(name),
                ],
            )
        self._start(
            "sidecar",
            "c",
            [
                "dataserver",
                "--coordinator",
                self.coordinator,
                "--remote",
                "--workers",
                "1",
                "--host",
                hosts.address("c"),
            ],
        )

    def _start(self, role: str, host: str, args: list[str]) -> dict:
        proc = self.hosts.popen(
            host,
            [
                sys.executable,
                "-m",
                "helix_core.launch.cli",
                *args,
                "--token-file",
                str(self.token_file),
                "--config-json",
                self.config,
                *self.flags,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        line = proc.stdout.readline()
        assert line.startswith("HELIX_READY "), f"{role} on host {host}: {line!r}"
        self.procs[role] = proc
        self.info[role] = json.loads(line.split(" ", 1)[1])
        return self.info[role]

    def status(self, host: str = "c") -> dict:
        done = self.hosts.run(
            host,
            [
                sys.executable,
                "-m",
                "helix_core.launch.cli",
                "status",
                "--coordinator",
                self.coordinator,
                "--token-file",
                str(self.token_file),
                "--json",
            ],
            env=self.env,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def ranks(self, placement: list[tuple[str, int]], schedulers, n: int = 48, batch: int = 2, **extra) -> list:
        """Start one rank per ``(host, local_rank)``; return their processes and output files."""
        started = []
        for rank, (host, local_rank) in enumerate(placement):
            out = self.tmp / f"rank{rank}-{time.monotonic_ns()}.json"
            args = dict(
                n=n,
                batch=batch,
                rank=rank,
                world=len(placement),
                local_rank=local_rank,
                coordinator=self.coordinator,
                token=TOKEN,
                schedulers=list(schedulers),
                out=str(out),
                **extra,
            )
            argv = [sys.executable, str(APPS / "hosts_rank.py"), json.dumps(args)]
            started.append((self.hosts.popen(host, argv, env=self.env), out))
        return started

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            proc.wait(timeout=20)
            proc.stdout.close()


def rank_results(started, timeout=240) -> list[dict]:
    out = []
    for proc, path in started:
        assert proc.wait(timeout=timeout) == 0
        out.append(json.loads(path.read_text()))
    return out


def wait_first_batches(started) -> None:
    """Until every rank started with ``mark_first`` has its first batch (then it is mid-epoch)."""
    deadline = time.monotonic() + 120
    while not all(Path(str(out) + ".first").exists() for _, out in started):
        assert time.monotonic() < deadline, "the ranks never received a batch"
        assert all(proc.poll() is None for proc, _ in started), "a rank ended before its first batch"
        time.sleep(0.05)


def sampler(n, rank, world, batch):
    order = list(DistributedSampler(IndexDataset(n), num_replicas=world, rank=rank, shuffle=False))
    return [order[i : i + batch] for i in range(0, len(order), batch)]


def listeners(hosts, name: str) -> list[tuple[str, int]]:
    """``(address hex, port)`` of every TCP socket listening in host ``name``'s network namespace."""
    done = hosts.run(name, ["cat", "/proc/net/tcp", "/proc/net/tcp6"])
    out = []
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3] == "0A":  # LISTEN
            addr, port = parts[1].split(":")
            out.append((addr, int(port, 16)))
    return out


def busy_slabs(hosts, name: str) -> list[str]:
    """Helix slab segments left on host ``name`` (its servers stopped: their pools unlinked them all)."""
    done = hosts.run(name, ["sh", "-c", "ls /dev/shm"])
    return [f for f in done.stdout.split() if re.match(r"helix-\w+-[lr]\d*p\d+-d-", f)]
