"""The embedded cluster: what a loader starts when no Coordinator is given.

A single process starts its own ``LocalCluster`` on loopback (with a fresh token, so cloudpickled
datasets work) and shares it between its loaders (train and val), closing it when the last one
closes. In a torch.distributed job (torchrun, Lightning, Accelerate) there is one cluster per job,
found through the job's own store (``rendezvous.py``):

- on one node, local rank 0 starts it on loopback and publishes its address; the other ranks
  read it and find the token, by that address, in the user's private Helix folder (``tokenfiles``),
  where its Coordinator left it: the store, open to every local user, never carries it;
- on several nodes, global rank 0 starts the Coordinator (and its node's DataServers) on the
  address this node reaches ``MASTER_ADDR`` by, each other node's local rank 0 starts that node's
  DataServers joining it, and every rank reads the address. Token and TLS never cross the store:
  every rank derives them from the job's secret (``HELIX_JOB_SECRET``, which also seals the
  store's entries: ``rendezvous.py``), or takes them from ``HELIX_TOKEN`` and ``HELIX_TLS_*``
  where the job sets them (as the deploy recipes do, and a job whose sidecars should join must).

A cluster a rank shares with others lives until the process that started it exits.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import threading
from typing import NamedTuple

from helix_core.config import ClusterConfig
from helix_core.errors import ClusterError

__all__ = ["Embedded", "acquire_embedded", "embedded_cluster", "release_embedded"]


class Embedded(NamedTuple):
    cluster: object  # the LocalCluster this process started (None: another rank's)
    address: str
    token: str | None
    tls: object  # the Tls of the job's channels, or None

    def __repr__(self) -> str:  # never the token
        return (
            f"Embedded(cluster={self.cluster!r}, address={self.address!r}, "
            f"token={'<redacted>' if self.token else None}, tls={self.tls!r})"
        )


_SHARED: dict = {"embedded": None, "refs": 0, "shared": False}
_LOCK = threading.Lock()


def acquire_embedded(world_size: int, num_workers: int | None, config: ClusterConfig) -> Embedded:
    """This process's embedded cluster (and how to reach it), started on first use."""
    with _LOCK:
        got = _SHARED["embedded"]
        if got is None or (got.cluster is not None and got.cluster._closed):
            got = embedded_cluster(world_size, num_workers, config)
            _SHARED.update(embedded=got, refs=0, shared=_in_job(world_size))
        _SHARED["refs"] += 1
        return got


def release_embedded() -> None:
    """One loader is done with the embedded cluster; the last one closes it — except a cluster
    shared with other ranks (they know only its address): it lives until this process exits."""
    with _LOCK:
        _SHARED["refs"] -= 1
        got = _SHARED["embedded"]
        if got is not None and got.cluster is not None and _SHARED["shared"]:
            return
        if _SHARED["refs"] <= 0:
            if got is not None and got.cluster is not None:
                got.cluster.close()
            _SHARED.update(embedded=None, refs=0, shared=False)


def _in_job(world_size: int) -> bool:
    """A rank of a torch.distributed job (launched with LOCAL_RANK set) with other ranks."""
    return "LOCAL_RANK" in os.environ and world_size > 1


def _local_world(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size if "LOCAL_RANK" in os.environ else 1))


def embedded_cluster(world_size: int, num_workers: int | None, config: ClusterConfig) -> Embedded:
    """Start this process's part of the job's cluster, or find the part another rank started."""
    from helix_core.launch.cluster import LocalCluster, host_layout
    from helix_core.launch.rendezvous import job_rendezvous

    local_world = _local_world(world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    servers, per_server = host_layout(local_world, num_workers or max(1, (os.cpu_count() or 2)))
    if not _in_job(world_size):  # one process (not launched as a job's rank): its own cluster
        cluster = LocalCluster(local_servers=servers, workers_per_server=per_server, token=True, config=config)
        return Embedded(cluster, cluster.address, cluster.token, None)
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)) or 0)
    if "LOCAL_WORLD_SIZE" not in os.environ and node_rank > 0:
        raise ClusterError(
            f"node {node_rank} of a job whose launcher does not say how many ranks share a node "
            "(no LOCAL_WORLD_SIZE): launch with torchrun, set LOCAL_WORLD_SIZE, or pass "
            "coordinator='host:port' / set HELIX_COORDINATOR"
        )
    job = job_rendezvous(config.startup_timeout_s)
    if job is None:
        raise ClusterError(
            f"{local_world} local ranks but no torch.distributed store to share one Helix cluster "
            "through: launch with torchrun (or call init_process_group before building the loader), "
            "or pass coordinator='host:port' / set HELIX_COORDINATOR"
        )
    if world_size <= local_world:  # one node: local rank 0 starts it all on loopback
        if local_rank == 0:
            cluster = LocalCluster(local_servers=servers, workers_per_server=per_server, token=True, config=config)
            job.publish("cluster", {"address": cluster.address})
            return Embedded(cluster, cluster.address, cluster.token, None)
        address = job.wait("cluster", config.startup_timeout_s)["address"]
        return Embedded(None, address, _private_token(address), None)
    return _several_nodes(job, servers, per_server, local_rank, config)


def _private_token(address) -> str:
    """The token of this user's Coordinator at ``address`` (the job's store gave the address),
    from the user's private Helix folder; ``ClusterError`` if there is none."""
    from helix_core.security.tokenfiles import find_token, token_path

    try:
        token = find_token(address) if isinstance(address, str) else None
    except ValueError as e:  # a file not private, or a port another user listens on
        raise ClusterError(f"the job's store gives the Helix cluster's address as {address}: {e}") from None
    if not token:
        raise ClusterError(
            f"the job's store gives the Helix cluster's address as {address!r}, but this user's private "
            f"Helix folder holds no token for it ({token_path(address) if isinstance(address, str) else '-'})"
            ": local rank 0 of this job did not start it (an entry planted in the store?), or the ranks "
            "see different HELIX_RUNTIME_DIR / HOME; refusing it"
        )
    return token


def _job_credentials(job) -> tuple[str, object]:
    """The token and TLS of a job on several nodes, the same on every rank and never from the
    store: ``HELIX_TOKEN`` / ``HELIX_TLS_*`` where set, else derived from the job's secret."""
    from helix_core.launch.rendezvous import JOB_SECRET, derive, job_secret
    from helix_core.security.tls import Tls

    token, tls, secret = os.environ.get("HELIX_TOKEN") or None, Tls.from_env(), job_secret()
    if secret is None and (token is None or tls is None):
        raise ClusterError(
            f"a Helix cluster for a job on several nodes needs {JOB_SECRET}: the same random value in "
            f"every rank's environment, passed out of band like MASTER_ADDR (e.g. export {JOB_SECRET}="
            "$(head -c 32 /dev/urandom | base64) in the batch script, or a Kubernetes Secret). The "
            "job's store is open to anyone who reaches it, so the cluster's token and keys never go "
            "there. Or set HELIX_TOKEN and HELIX_TLS_CA / _CERT / _KEY on every rank, or pass "
            "coordinator='host:port' (HELIX_COORDINATOR) to use a cluster of your own"
        )
    if token is None:
        token = base64.urlsafe_b64encode(derive(secret, "token", job.label)).decode().rstrip("=")
    return token, tls or Tls.from_secret(derive(secret, "tls", job.label), job.label)


def _several_nodes(job, servers: int, per_server: int, local_rank: int, config: ClusterConfig) -> Embedded:
    from helix_core.launch.cluster import LocalCluster
    from helix_core.launch.rendezvous import node_address
    from helix_core.security.hostid import host_id

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    here = node_address(master)
    # where this node's services listen, and the name the other nodes dial them by: the interface
    # toward the master — or, on the master when its name resolves to loopback here (Debian's
    # 127.0.1.1 line in /etc/hosts), every interface, dialled by MASTER_ADDR
    bind, advertise = (here, None) if not ipaddress.ip_address(here).is_loopback else ("0.0.0.0", master)
    token, tls = _job_credentials(job)
    cluster = None
    if int(os.environ.get("RANK", 0)) == 0:
        cluster = LocalCluster(
            local_servers=servers,
            workers_per_server=per_server,
            token=token,
            host=bind,
            tls=tls,
            config=config,
            advertise=advertise,
        )
        address = f"{advertise}:{cluster.address.rsplit(':', 1)[1]}" if advertise else cluster.address
        job.publish("cluster", {"address": address})
    address = job.wait("cluster", config.startup_timeout_s)["address"]
    node = f"node/{host_id()}"
    if local_rank == 0:
        if cluster is None:
            cluster = LocalCluster(
                local_servers=servers,
                workers_per_server=per_server,
                token=token,
                host=bind,
                tls=tls,
                config=config,
                coordinator=address,
                advertise=advertise,
            )
        job.publish(node, {"servers": len(cluster.servers)})
    else:
        job.wait(node, config.startup_timeout_s)  # this node's DataServers are registered
    return Embedded(cluster, address, token, tls)
