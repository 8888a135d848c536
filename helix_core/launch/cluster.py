"""``LocalCluster``: a Coordinator and DataServers as real processes on loopback.

The cluster owns its processes: each gets a pipe on stdin and stops when it closes (so a crashed
or interrupted training process takes them along), ``close()`` stops them gracefully and kills
what is left after a timeout, and every shared-memory segment named for the cluster is swept.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass

from helix_core.config import ClusterConfig
from helix_core.data.usercode import server_environ
from helix_core.errors import ClusterError
from helix_core.memory import shm
from helix_core.security.auth import new_token
from helix_core.security.tls import ENV
from helix_core.security.tokenfiles import load_token, remove_token, token_path

__all__ = ["LocalCluster", "ServerHandle", "host_layout", "wait_ready"]


def wait_ready(proc: subprocess.Popen, what: str, timeout_s: float) -> dict:
    """The JSON of a service's ``HELIX_READY`` line on its stdout (a binary pipe);
    ``ClusterError`` naming ``what`` if it exits first or is not ready within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(f"{what} process exited with code {proc.returncode} during start-up")
            if sel.select(timeout=0.1):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    continue
                buf += chunk
                for line in buf.split(b"\n")[:-1]:
                    if line.startswith(b"HELIX_READY "):
                        return json.loads(line[len(b"HELIX_READY ") :])
        raise ClusterError(f"{what} process not ready within {timeout_s:.0f} s")
    finally:
        sel.close()


def host_layout(local_ranks: int, workers: int) -> tuple[int, int]:
    """``(servers, workers_per_server)`` for ``workers`` worker processes serving ``local_ranks``
    ranks on one host: one DataServer per rank while each still gets two workers or more, else
    fewer servers (ranks share them). A server with one worker runs its queue one batch at a time
    and can split none of them (``steal``), so when the other ranks wait for one rank's batches,
    the host's other cores idle."""
    local_ranks, workers = max(1, int(local_ranks)), max(1, int(workers))
    servers = max(1, min(local_ranks, workers // 2))
    return servers, max(1, workers // servers)


@dataclass
class ServerHandle:
    """One DataServer of a cluster: ``index`` in ``cluster.servers``, ``kind``, ``address``, ``pid``."""

    index: int
    kind: str
    address: str
    pid: int
    server_id: str
    process: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


class LocalCluster:
    """A Coordinator, ``local_servers`` local DataServers and ``remote_servers`` remote ("sidecar")
    ones, each with ``workers_per_server`` worker processes, on ``host`` (127.0.0.1) — or, with
    ``coordinator="host:port"``, only the DataServers, joining that Coordinator (a job's other nodes);
    ``advertise``: the name the DataServers register to be dialled by (default ``host``).

    ``token``: the token every RPC must carry (default, or ``True``: a fresh one; a cluster never
    runs without one). The Coordinator leaves it in the user's private Helix folder, so this user's
    loaders and ``helix`` commands given only ``address`` find it; cloudpickled datasets travel
    unless ``config.allow_pickle`` is False. ``tls``: a ``Tls`` for every port and channel of the
    cluster (default: its processes read ``HELIX_TLS_*``); clients pass ``cluster.tls``. ``address`` is ``"host:port"``
    of the Coordinator; ``servers`` lists local servers first, then remote ones; ``kill_server(i)``
    SIGKILLs one (fault injection).
    """

    def __init__(
        self,
        local_servers: int = 1,
        remote_servers: int = 0,
        workers_per_server: int = 1,
        token: str | bool | None = None,
        host: str = "127.0.0.1",
        config: ClusterConfig | None = None,
        scheduler: str = "deadline",
        start: bool = True,
        tls=None,
        coordinator: str | None = None,
        advertise: str | None = None,
    ):
        if (
            local_servers < 0
            or remote_servers < 0
            or workers_per_server < 1
            or (coordinator is None and local_servers < 1)
        ):
            raise ValueError(
                f"LocalCluster needs local_servers >= 1 (>= 0 when joining a coordinator), "
                f"remote_servers >= 0, workers_per_server >= 1 "
                f"(got {local_servers}, {remote_servers}, {workers_per_server})"
            )
        self.local_servers, self.remote_servers = local_servers, remote_servers
        self.workers_per_server = workers_per_server
        if isinstance(token, str) and token:
            self.token = token
        elif coordinator is None:
            self.token = new_token()
        else:  # joining: that Coordinator's token (HELIX_TOKEN, or the file this user's Coordinator left)
            self.token = load_token(coordinator=coordinator)
            if not self.token:
                raise ValueError(
                    f"LocalCluster(coordinator={coordinator!r}) needs that cluster's token: pass token=... "
                    f"or set HELIX_TOKEN (none in {token_path(coordinator)})"
                )
        self.host, self.scheduler = host, scheduler
        self.config = config or ClusterConfig()
        self.cluster_id = uuid.uuid4().hex[:12]  # joining a coordinator: its id, learnt at start
        self.tls, self._join, self.advertise = tls, coordinator, advertise
        tls_dir = tempfile.mkdtemp(prefix="helix-tls-") if tls is not None else None  # 0700, ours
        self._tls_env = tls.environ(tls_dir) if tls is not None else {}
        self._state = {
            "cluster_id": self.cluster_id,
            "tls_dir": tls_dir,  # what cleanup sweeps and removes
            "token": self.token,
            "address": "",
        }
        self.address = ""
        self.servers: list[ServerHandle] = []
        self._coordinator: subprocess.Popen | None = None
        self._closed = False
        self._procs: list[subprocess.Popen] = []  # owned from birth, even if start() fails
        self._finalizer = weakref.finalize(
            self, LocalCluster._cleanup, self._procs, self._state, self.config.stop_timeout_s
        )
        if start:
            self.start()

    # ---- lifecycle ---------------------------------------------------------------------------------
    def _spawn(self, args: list[str]) -> tuple[subprocess.Popen, dict]:
        # the client's sys.path (as torch's spawned workers get it): a JSON spec's transform beside the script imports
        env = dict(server_environ(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["HELIX_TOKEN"] = self.token
        env = {k: v for k, v in env.items() if k not in ENV.values()} if self._tls_env else env
        env.update(self._tls_env)
        cmd = [
            sys.executable,
            "-m",
            "helix_core.launch.process",
            *args,
            "--owned",
            "--config-json",
            json.dumps(self.config.to_dict()),
        ]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._procs.append(proc)
        return proc, wait_ready(proc, " ".join(args[:1]), self.config.startup_timeout_s)

    def start(self) -> LocalCluster:
        if self.address:
            return self
        try:
            if self._join is None:
                proc, info = self._spawn(
                    [
                        "coordinator",
                        "--host",
                        self.host,
                        "--port",
                        "0",
                        "--scheduler",
                        self.scheduler,
                        "--cluster-id",
                        self.cluster_id,
                    ]
                )
                self._coordinator, self.address = proc, info["address"]
                self._state["address"] = self.address  # its token file, if a SIGKILL left it
            else:
                self.address = self._join
            pending = [("local", r) for r in range(self.local_servers)] + [("remote", -1)] * self.remote_servers
            procs = [(kind, self._server_args(kind, rank)) for kind, rank in pending]
            started = [(kind, *self._spawn(a)) for kind, a in procs]
            self.servers = [
                ServerHandle(i, kind, info["address"], info["pid"], info["server_id"], p)
                for i, (kind, p, info) in enumerate(started)
            ]
            if self._join is not None and started:  # the joined Coordinator's id names our segments
                self.cluster_id = self._state["cluster_id"] = started[0][2]["cluster_id"]
        except BaseException:
            self.close()
            raise
        return self

    def _server_args(self, kind: str, rank: int) -> list[str]:
        where = ["--local-rank", str(rank)] if kind == "local" else ["--remote"]
        return [
            "dataserver",
            "--coordinator",
            self.address,
            *where,
            "--workers",
            str(self.workers_per_server),
            "--host",
            self.host,
            *(["--advertise", self.advertise] if self.advertise else []),
        ]

    def restart_server(self, i: int) -> ServerHandle:
        """Start DataServer ``i`` again (SIGKILLing it first if it still runs), same kind and slot,
        a new process on a new port; it registers with the Coordinator like any new server."""
        old = self.servers[i]
        self.kill_server(i)
        if old.process in self._procs:
            self._procs.remove(old.process)
            if old.process.stdout:
                old.process.stdout.close()
        rank = sum(s.kind == "local" for s in self.servers[:i]) if old.kind == "local" else -1
        proc, info = self._spawn(self._server_args(old.kind, rank))
        self.servers[i] = ServerHandle(i, old.kind, info["address"], info["pid"], info["server_id"], proc)
        return self.servers[i]

    def kill_server(self, i: int) -> None:
        """SIGKILL DataServer ``i`` (index into ``servers``), like tf.data's ``stop_worker``."""
        s = self.servers[i]
        if s.alive:
            s.process.kill()
            s.process.wait(timeout=self.config.stop_timeout_s)

    def worker_pids(self, i: int) -> list[int]:
        """The worker process ids of DataServer ``i`` (its ``Health`` reply), for fault injection."""
        from helix_core.security.auth import call_metadata
        from helix_core.wire.proto import helix_pb2 as pb
        from helix_core.wire.proto import helix_pb2_grpc as pbg
        from helix_core.wire.rpc import connect

        with connect(self.servers[i].address, self.config, self.tls) as ch:
            reply = pbg.DataServerStub(ch).Health(
                pb.HealthRequest(), timeout=self.config.rpc_timeout_s, metadata=call_metadata(self.token)
            )
        return list(reply.worker_pids)

    def kill_coordinator(self) -> None:
        """SIGKILL the Coordinator (fault injection: clients must fail within their timeout)."""
        if self._coordinator is not None and self._coordinator.poll() is None:
            self._coordinator.kill()
            self._coordinator.wait(timeout=self.config.stop_timeout_s)

    def restart_coordinator(self) -> None:
        """Start the Coordinator again on the same address (SIGKILLing it first if it still runs),
        like tf.data service's ``restart_dispatcher()``: it knows nothing, and servers and clients
        register again within a few heartbeats. Only for a cluster that started its Coordinator."""
        if self._join is not None or not self.address:
            raise RuntimeError("restart_coordinator(): this LocalCluster did not start a Coordinator")
        self.kill_coordinator()
        if self._coordinator in self._procs:
            self._procs.remove(self._coordinator)
            if self._coordinator.stdout:
                self._coordinator.stdout.close()
        port = self.address.rsplit(":", 1)[1]
        proc, info = self._spawn(
            [
                "coordinator",
                "--host",
                self.host,
                "--port",
                port,
                "--scheduler",
                self.scheduler,
                "--cluster-id",
                self.cluster_id,
            ]
        )
        self._procs.remove(proc)
        self._procs.insert(0, proc)  # still stopped last (cleanup stops servers first)
        self._coordinator = proc
        if info["address"] != self.address:
            raise RuntimeError(f"restarted Coordinator listens on {info['address']}, not {self.address}")

    @property
    def coordinator_pid(self) -> int | None:
        """The Coordinator's process id (for CPU accounting), None before ``start``."""
        return self._coordinator.pid if self._coordinator is not None else None

    def close(self) -> None:
        """Stop every process gracefully (close its pipe, then SIGTERM), SIGKILL what is left after
        ``stop_timeout_s``, and sweep the cluster's shared-memory segments. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    stop = close

    @staticmethod
    def _cleanup(procs: list, state: dict, timeout_s: float) -> None:
        servers_first = list(reversed(procs))  # DataServers, then the Coordinator
        for p in servers_first:
            try:
                if p.stdin:
                    p.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for p in servers_first:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
        for p in servers_first:
            try:
                p.wait(timeout=max(0.05, deadline + 1.0 - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=timeout_s)
            if p.stdout:
                p.stdout.close()
        shm.sweep(f"helix-{state['cluster_id']}-")
        if state["address"]:
            remove_token(state["address"], state["token"])
        if state["tls_dir"] is not None:
            shutil.rmtree(state["tls_dir"], ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LocalCluster(address={self.address!r}, local_servers={self.local_servers}, "
            f"remote_servers={self.remote_servers}, workers_per_server={self.workers_per_server})"
        )
