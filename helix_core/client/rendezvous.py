"""How the ranks of one job find its embedded cluster: the job's own torch.distributed store.

Under torchrun, Lightning or Accelerate the job already has a key-value store (the TCPStore that
``init_process_group`` made, or torchrun's agent store at ``MASTER_ADDR:MASTER_PORT``). The rank
that starts a part of the cluster publishes it there under ``helix/<run id>/<restart count>/``;
the others wait for the key. Every entry also carries the run id and restart count, and a reader
refuses one that does not match its own: an entry of an earlier attempt of an elastic job (or of
another job sharing the store) is never trusted. The store is the job's: whoever can reach
``MASTER_PORT`` can read the token and certificates in it, as they could join the process group.
"""
from __future__ import annotations

import datetime
import json
import os
import socket

from ..errors import ClusterError

__all__ = ["JobRendezvous", "job_rendezvous", "node_address"]


class JobRendezvous:
    """Entries of one job attempt in a store (anything with ``set``, ``get`` and ``wait``)."""

    def __init__(self, store, run_id: str, attempt: str):
        self.store, self.run_id, self.attempt = store, str(run_id), str(attempt)
        self.prefix = f"helix/{self.run_id}/{self.attempt}/"

    def publish(self, name: str, info: dict) -> None:
        self.store.set(self.prefix + name, json.dumps({"run_id": self.run_id, "attempt": self.attempt, **info}))

    def wait(self, name: str, timeout_s: float) -> dict:
        """The entry ``name`` once some rank published it; ``ClusterError`` after ``timeout_s``, or
        for an entry of another run or attempt."""
        key = self.prefix + name
        try:
            self.store.wait([key], datetime.timedelta(seconds=timeout_s))
            raw = self.store.get(key)
        except Exception as e:  # noqa: BLE001 - the store raises RuntimeError / DistStoreError on timeouts
            raise ClusterError(f"no rank published the Helix cluster's {name!r} in the job's store within "
                               f"{timeout_s:.0f} s (key {key}): {e}") from None
        try:
            info = json.loads(raw)
        except ValueError:
            raise ClusterError(f"the job's store holds a malformed Helix entry at {key}") from None
        if not isinstance(info, dict) or info.get("run_id") != self.run_id or info.get("attempt") != self.attempt:
            raise ClusterError(f"the job's store holds a Helix entry at {key} of another run or attempt "
                               f"({info.get('run_id') if isinstance(info, dict) else '?'}/"
                               f"{info.get('attempt') if isinstance(info, dict) else '?'}, this job is "
                               f"{self.run_id}/{self.attempt}): refusing it")
        return info


def job_rendezvous(timeout_s: float) -> JobRendezvous | None:
    """The job's rendezvous: in torchrun's agent store, else the default process group's store;
    None outside a torch.distributed job."""
    import torch.distributed as dist

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # torchrun's agent store first: the same before and after init_process_group (whose default
    # store is a prefixed view of it), so loaders made before and after it meet
    if "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        return JobRendezvous(store, run_id, attempt)
    if dist.is_available() and dist.is_initialized():
        return JobRendezvous(dist.distributed_c10d._get_default_store(), run_id, attempt)
    return None


def node_address(master: str) -> str:
    """This node's address toward ``master`` (the interface a packet to it would leave by; no
    packet is sent): where this node's services listen so the job's other nodes reach them."""
    try:
        infos = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)
    except OSError as e:
        raise ClusterError(f"cannot resolve MASTER_ADDR={master!r}: {e}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]
