"""The embedded cluster: what a loader starts when no Coordinator is given.

A single process starts its own ``LocalCluster`` (with a fresh token, so cloudpickled datasets
work) and shares it between its loaders (train and val), closing it when the last one closes.
Under torchrun, local rank 0 starts it and publishes address and token in a private file
(mode 0600) named for the run; the other local ranks wait for that file.
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
import threading
import time
import weakref

from ..config import ClusterConfig
from ..errors import ClusterError

__all__ = ["acquire_embedded", "embedded_cluster", "release_embedded"]

_STARTED = time.time()  # about when this process started: older rendezvous files are stale


def _unlink(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _private_dir() -> str:
    """``$TMPDIR/helix-<uid>``, made 0700 and checked: the rendezvous file holds the cluster's
    token, so neither its folder nor its contents may come from another user."""
    path = os.path.join(tempfile.gettempdir(), f"helix-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ClusterError(f"{path} must be a folder of user {os.getuid()} with mode 0700 (it is owned by "
                           f"{st.st_uid} with mode {oct(st.st_mode & 0o777)}): remove it and start again")
    return path


def _rendezvous_file() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    port = os.environ.get("MASTER_PORT", "0")
    return os.path.join(_private_dir(), f"embedded-{run}-{port}.json")


_SHARED: dict = {"cluster": None, "address": None, "token": None, "refs": 0, "shared": False}
_LOCK = threading.Lock()


def acquire_embedded(world_size: int, num_workers: int | None, config: ClusterConfig):
    """``(address, token)`` of this process's embedded cluster, started on first use."""
    with _LOCK:
        if _SHARED["address"] is None or (_SHARED["cluster"] is not None and _SHARED["cluster"]._closed):
            cluster, address, token = embedded_cluster(world_size, num_workers, config)
            _SHARED.update(cluster=cluster, address=address, token=token, refs=0, shared=_local_world(world_size) > 1)
        _SHARED["refs"] += 1
        return _SHARED["cluster"], _SHARED["address"], _SHARED["token"]


def release_embedded() -> None:
    """One loader is done with the embedded cluster; the last one closes it — except the cluster
    local rank 0 shares under torchrun: other ranks may still use it (and know only its address),
    so it lives until this process exits."""
    with _LOCK:
        _SHARED["refs"] -= 1
        if _SHARED["cluster"] is not None and _SHARED["shared"]:
            return
        if _SHARED["refs"] <= 0:
            if _SHARED["cluster"] is not None:
                _SHARED["cluster"].close()
            _SHARED.update(cluster=None, address=None, token=None, refs=0, shared=False)


def _local_world(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size if "LOCAL_RANK" in os.environ else 1))


def embedded_cluster(world_size: int, num_workers: int | None, config: ClusterConfig):
    """``(cluster or None, address, token)``: the cluster is returned to the process that owns it."""
    from ..runtime.cluster import LocalCluster, host_layout

    local_world = _local_world(world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    servers, per_server = host_layout(local_world, num_workers or max(1, (os.cpu_count() or 2)))
    if local_world <= 1 or local_rank == 0:
        cluster = LocalCluster(local_servers=servers, workers_per_server=per_server, token=True, config=config)
        if local_world > 1:
            path = _rendezvous_file()
            tmp = f"{path}.{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"address": cluster.address, "token": cluster.token}, f)
            os.replace(tmp, path)
            weakref.finalize(cluster, _unlink, path)  # the token file goes with the cluster
        return cluster, cluster.address, cluster.token
    path = _rendezvous_file()
    deadline = time.monotonic() + config.startup_timeout_s
    while time.monotonic() < deadline:
        try:
            if os.stat(path).st_mtime >= _STARTED - 60:
                with open(path) as f:
                    info = json.load(f)
                return None, info["address"], info["token"]
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise ClusterError(f"local rank 0 did not publish the embedded Helix cluster in {path} within "
                       f"{config.startup_timeout_s:.0f} s")
