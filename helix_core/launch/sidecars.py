"""Sidecars on an existing engine: DataServers on CPU machines as Ray actors.

Each sidecar is a Ray actor that reserves ``workers`` CPUs and runs ``helix dataserver --remote``
as its own child process (pipe-owned: when the actor dies, for whatever reason, the DataServer
and its workers stop with it). Ray restarts a dead actor (``max_restarts``); the new incarnation
starts a new DataServer, which registers again. The data path stays Helix's — gRPC streams from
the sidecar to the rank's local server — never Ray's object store. ``close()`` ends the actors
and, with them, their processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helix_core.config import ClusterConfig
from helix_core.errors import ClusterError

__all__ = ["RaySidecars", "ray_sidecars"]


class _Sidecar:
    """A Ray actor that owns one sidecar process (started in ``__init__``)."""

    def __init__(
        self,
        coordinator: str,
        workers: int,
        token_ref: list,
        env: dict,
        config_json: str,
        host: str | None,
        insecure: bool,
        startup_timeout_s: float,
    ):
        import ray

        from helix_core.launch.cluster import wait_ready

        token = ray.get(token_ref[0]) if token_ref else None  # from the object store: no actor argument shows it
        host = host or toward(coordinator)
        argv = [
            sys.executable,
            "-m",
            "helix_core.launch.process",
            "dataserver",
            "--coordinator",
            coordinator,
            "--remote",
            "--workers",
            str(workers),
            "--host",
            host,
            "--owned",
            "--config-json",
            config_json,
        ]
        if insecure:
            argv.append("--insecure")
        child_env = dict(os.environ, **env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if token:
            child_env["HELIX_TOKEN"] = token
        import tempfile

        self.log = tempfile.TemporaryFile()  # the DataServer's stderr: its first words if it fails to start
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=child_env
        )
        try:
            self.info = wait_ready(self.proc, "the sidecar's DataServer", startup_timeout_s)
        except ClusterError as e:
            self.proc.kill()
            self.log.seek(0)
            said = self.log.read()[-2000:].decode(errors="replace").strip()
            raise RuntimeError(f"{e}: {said or 'it said nothing'}") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the DataServer gracefully (its pipe closes: it unregisters nothing, frees its slabs,
        stops its workers), SIGKILL after ``timeout_s`` — before the actor itself is killed, so
        nothing of it is left to a SIGKILL of the whole process tree."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)

    def describe(self) -> dict:
        """``{"address", "server_id", "pid", "cluster_id"}`` of its DataServer, and the actor's pid."""
        return {**self.info, "actor_pid": os.getpid(), "alive": self.proc.poll() is None}


class RaySidecars:
    """Handle of ``ray_sidecars``: ``actors`` (Ray actor handles), ``describe()``, ``close()``."""

    def __init__(self, actors: list, owns_ray: bool, keep: tuple = ()):
        self.actors, self._owns_ray, self._closed = actors, owns_ray, False
        self._keep = keep  # what a restarted actor gets again (the token's object), held while the actors live

    def describe(self) -> list[dict]:
        """Each sidecar's DataServer (address, server id, pid) as it runs now."""
        import ray

        return ray.get([a.describe.remote() for a in self.actors])

    def close(self) -> None:
        """End every sidecar actor (no restart) and so their DataServers; idempotent."""
        if self._closed:
            return
        self._closed = True
        import ray

        pending = [a.stop.remote() for a in self.actors]
        try:  # their DataServers stop gracefully first (a killed tree would strand its semaphores)
            ray.wait(pending, num_returns=len(pending), timeout=30)
        except Exception:  # noqa: BLE001 - an actor already dead: ray.kill below is all it needs
            pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> RaySidecars:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def toward(coordinator: str) -> str:
    """The address of this node's interface toward the Coordinator at ``coordinator`` (loopback for
    a loopback Coordinator): what a sidecar binds, so the Coordinator's ranks reach it and no one
    else needs to."""
    from helix_core.launch.rendezvous import node_address

    host = coordinator.rpartition(":")[0].strip("[]")
    try:
        return node_address(host)
    except ClusterError:
        raise ClusterError(f"cannot resolve the Coordinator's host in {coordinator!r}") from None


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Ray retries an address that does not answer for minutes: look first (one TCP connect)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot join the Ray cluster at --ray {address}: nothing answers there ({e})") from None


def ray_sidecars(
    coordinator: str,
    count: int,
    workers: int,
    token: str | None = None,
    *,
    ray_address: str | None = None,
    host: str | None = None,
    tls_env: dict | None = None,
    insecure: bool = False,
    config: ClusterConfig | None = None,
    max_restarts: int = -1,
    **actor_options,
) -> RaySidecars:
    """Start ``count`` sidecars (DataServers of ``workers`` workers each) as Ray actors that
    join the Coordinator at ``coordinator``. ``ray_address``: the Ray cluster to join (default: the
    one this process is connected to, else ``ray.init()``'s default); ``host``: the address each
    DataServer listens on (default: its node's interface toward the Coordinator, ``toward``:
    loopback for a loopback Coordinator); beyond loopback it needs ``tls_env`` or ``insecure=True``;
    ``tls_env``: ``HELIX_TLS_*`` paths as the
    Ray nodes see them (default: this process's); ``actor_options``: Ray's (``resources=``, ...)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"--count must be an int >= 1 (sidecars to start), got {count!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be an int >= 1 (each sidecar's worker processes), got {workers!r}")
    try:
        import ray
    except ImportError:
        raise ClusterError("sidecars on Ray need Ray: pip install 'ray>=2.40'") from None
    from helix_core.security.auth import is_loopback
    from helix_core.security.tokenfiles import load_token

    config, token = (
        config or ClusterConfig(),
        load_token(token, coordinator=coordinator),
    )  # the actors may run elsewhere
    env = {k: v for k, v in os.environ.items() if k.startswith("HELIX_TLS_")} if tls_env is None else dict(tls_env)
    beyond = host if host is not None else coordinator.rpartition(":")[0].strip("[]")
    if not is_loopback(beyond) and not insecure and not env:
        where = f"host={host!r}" if host is not None else f"the interface toward the Coordinator at {coordinator}"
        raise ValueError(
            f"ray_sidecars: the sidecars would listen on {where}, beyond loopback, which needs TLS: pass "
            "tls_env={'HELIX_TLS_CERT': ..., 'HELIX_TLS_KEY': ..., 'HELIX_TLS_CA': ...} (paths as the Ray "
            "nodes see them; default: this process's HELIX_TLS_* environment), or insecure=True (no "
            "pickled data then)"
        )
    owns = not ray.is_initialized()
    if owns and ray_address and ray_address != "auto" and not ray_address.startswith("ray://"):
        _check_reachable(ray_address)
    if owns:
        try:
            ray.init(address=ray_address, logging_level="ERROR", log_to_driver=False)
        except Exception as e:  # noqa: BLE001 - ConnectionError, TimeoutError, ...: name the address
            raise ClusterError(f"cannot join the Ray cluster at --ray {ray_address or 'auto'}: {e}") from None
    token_ref = [ray.put(token)] if token else []  # nested: the actor gets it with ray.get, never as an argument
    cls = ray.remote(_Sidecar).options(num_cpus=workers, max_restarts=max_restarts, **actor_options)
    actors = [
        cls.remote(
            coordinator, workers, token_ref, env, json.dumps(config.to_dict()), host, insecure, config.startup_timeout_s
        )
        for _ in range(count)
    ]
    handle = RaySidecars(actors, owns, keep=tuple(token_ref))
    try:
        handle.describe()  # every sidecar's DataServer is up (and registered) before this returns
    except BaseException as e:
        handle.close()
        if isinstance(e, Exception):
            raise ClusterError(f"a Ray sidecar failed to start: {e}") from None
        raise
    return handle
