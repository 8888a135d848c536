"""How the ranks of one job find its embedded cluster: the job's own torch.distributed store.

Under torchrun, Lightning or Accelerate the job already has a key-value store (the TCPStore that
``init_process_group`` made, or torchrun's agent store at ``MASTER_ADDR:MASTER_PORT``). The rank
that starts a part of the cluster publishes it there under ``helix/<run id>/<restart count>/``;
the others wait for the key.

The store has no authentication: any local user (and anyone who reaches ``MASTER_PORT``) reads
and writes it. So it carries nothing that grants access, only where the cluster is: on one node
the address (the token stays in the user's private Helix folder, found by that address); on
several nodes the address sealed with the job's secret (``HELIX_JOB_SECRET``, passed to every rank
out of band like ``MASTER_ADDR``): AES-GCM under a key derived (HKDF) from the secret, the run id
and the restart count (and Slurm's job id), bound to the entry's name, so a planted entry, one of
another attempt, or one moved to another name is refused with an error that says so. Give each job
a secret of its own: two jobs with one secret and the same run id could open each other's entries.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import socket
import time

from helix_core.errors import ClusterError

__all__ = ["JOB_SECRET", "JobRendezvous", "derive", "job_rendezvous", "job_secret", "node_address"]

JOB_SECRET = "HELIX_JOB_SECRET"
MIN_SECRET_CHARS = 16


def job_secret() -> bytes | None:
    """The job's secret from ``HELIX_JOB_SECRET`` (None when unset); ``ClusterError`` if it is too short."""
    value = os.environ.get(JOB_SECRET, "")
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise ClusterError(
            f"{JOB_SECRET} has {len(value)} characters: give at least {MIN_SECRET_CHARS} random ones, "
            f"the same for every rank (e.g. {JOB_SECRET}=$(head -c 32 /dev/urandom | base64))"
        )
    return value.encode()


def derive(secret: bytes, purpose: str, label: str, length: int = 32) -> bytes:
    """``length`` bytes that follow from the job's ``secret`` for one ``purpose`` and ``label`` (HKDF-SHA256)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(hashes.SHA256(), length, salt=b"helix-job", info=f"{purpose}\0{label}".encode()).derive(secret)


class JobRendezvous:
    """Entries of one job attempt in a store (anything with ``set``, ``get`` and ``wait``), sealed
    with the job's ``secret`` when there is one."""

    def __init__(self, store, run_id: str, attempt: str, secret: bytes | None = None):
        self.store, self.run_id, self.attempt = store, str(run_id), str(attempt)
        self.prefix = f"helix/{self.run_id}/{self.attempt}/"
        # what tells this job from another that reused its secret, where the launcher says (Slurm's job id)
        self.label = f"{self.run_id}/{self.attempt}" + (
            f"/slurm-{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else ""
        )
        self._aead = None
        if secret is not None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(derive(secret, "store", self.label))

    @property
    def sealed(self) -> bool:
        return self._aead is not None

    def publish(self, name: str, info: dict) -> None:
        entry = {"run_id": self.run_id, "attempt": self.attempt}
        if self._aead is None:
            entry.update(info)
        else:
            nonce = os.urandom(12)
            sealed = self._aead.encrypt(nonce, json.dumps(info).encode(), (self.prefix + name).encode())
            entry["sealed"] = base64.b64encode(nonce + sealed).decode()
        self.store.set(self.prefix + name, json.dumps(entry))

    def wait(self, name: str, timeout_s: float) -> dict:
        """The entry ``name`` once some rank published it; ``ClusterError`` after ``timeout_s``, for
        an entry of another run or attempt, or (sealed) for one the job's secret does not open."""
        key = self.prefix + name
        deadline = time.monotonic() + timeout_s
        try:
            self.store.wait([key], datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - the store raises RuntimeError / DistStoreError on timeouts
            raise ClusterError(
                f"no rank published the Helix cluster's {name!r} in the job's store within "
                f"{timeout_s:.0f} s (key {key}): {e}"
            ) from None
        while True:  # an entry planted before the rank's own is refused, then overwritten: read again until then
            try:
                return self._checked(key, self.store.get(key))
            except ClusterError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.5)

    def _checked(self, key: str, raw: bytes) -> dict:
        try:
            info = json.loads(raw)
        except ValueError:
            raise ClusterError(f"the job's store holds a malformed Helix entry at {key}") from None
        if not isinstance(info, dict) or info.get("run_id") != self.run_id or info.get("attempt") != self.attempt:
            raise ClusterError(
                f"the job's store holds a Helix entry at {key} of another run or attempt "
                f"({info.get('run_id') if isinstance(info, dict) else '?'}/"
                f"{info.get('attempt') if isinstance(info, dict) else '?'}, this job is "
                f"{self.run_id}/{self.attempt}): refusing it"
            )
        return self._open(key, info)

    def _open(self, key: str, info: dict) -> dict:
        if self._aead is None:
            return info
        try:
            raw = base64.b64decode(info["sealed"], validate=True)
            opened = json.loads(self._aead.decrypt(raw[:12], raw[12:], key.encode()))
        except Exception:  # noqa: BLE001 - no field, bad base64, InvalidTag, not JSON: all one answer
            opened = None
        if not isinstance(opened, dict):
            raise ClusterError(
                f"the job's store holds a Helix entry at {key} that this job's {JOB_SECRET} does not "
                "open: written by someone without the secret (planted), by another job or attempt, or "
                f"the ranks were given different secrets; refusing it (give every rank the same "
                f"{JOB_SECRET})"
            )
        return {"run_id": self.run_id, "attempt": self.attempt, **opened}


def job_rendezvous(timeout_s: float) -> JobRendezvous | None:
    """The job's rendezvous: in torchrun's agent store, else the default process group's store;
    None outside a torch.distributed job."""
    import torch.distributed as dist

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # torchrun's agent store first: the same before and after init_process_group (whose default
    # store is a prefixed view of it), so loaders made before and after it meet
    if "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        return JobRendezvous(store, run_id, attempt, job_secret())
    if dist.is_available() and dist.is_initialized():
        return JobRendezvous(dist.distributed_c10d._get_default_store(), run_id, attempt, job_secret())
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
