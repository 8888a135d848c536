"""The embedded cluster: what a loader starts when no Coordinator is given.

A single process starts its own ``LocalCluster`` (with a fresh token, so cloudpickled datasets
work). Under torchrun, local rank 0 starts it and publishes address and token in a private file
(mode 0600) named for the run; the other local ranks wait for that file.
"""
from __future__ import annotations

import json
import os
import tempfile
import time

from ..config import ClusterConfig
from ..errors import ClusterError

__all__ = ["embedded_cluster"]


def _rendezvous_file() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    port = os.environ.get("MASTER_PORT", "0")
    return os.path.join(tempfile.gettempdir(), f"helix-embedded-{os.getuid()}-{run}-{port}.json")


def embedded_cluster(world_size: int, num_workers: int | None, config: ClusterConfig):
    """``(cluster or None, address, token)``: the cluster is returned to the process that owns it."""
    from ..runtime.cluster import LocalCluster

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size if "LOCAL_RANK" in os.environ else 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    total = num_workers or max(1, (os.cpu_count() or 2))
    per_server = max(1, total // max(local_world, 1))
    if local_world <= 1 or local_rank == 0:
        cluster = LocalCluster(local_servers=max(local_world, 1), workers_per_server=per_server, token=True,
                               config=config)
        if local_world > 1:
            path = _rendezvous_file()
            tmp = f"{path}.{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"address": cluster.address, "token": cluster.token}, f)
            os.replace(tmp, path)
        return cluster, cluster.address, cluster.token
    path = _rendezvous_file()
    deadline = time.monotonic() + config.startup_timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                info = json.load(f)
            return None, info["address"], info["token"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    raise ClusterError(f"local rank 0 did not publish the embedded Helix cluster in {path} within "
                       f"{config.startup_timeout_s:.0f} s")
