"""Which host a process is on: the identity that decides who may share whose memory.

Shared memory works only between processes that see the same /dev/shm, so every DataServer and
every client says which host it is on, and the Coordinator lets a rank deliver only through a local
server of its own host. The identity is the hostname plus the machine's boot id (two machines
that share a hostname after an image clone still differ; a reboot makes a new host, whose old
slabs are gone anyway). ``HELIX_HOST_ID`` (or ``--host-id``) overrides it — for containers that
share a hostname but not /dev/shm, or hosts that share one /dev/shm under different names.
"""

from __future__ import annotations

import os
import socket

__all__ = ["check_host_id", "host_id"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def check_host_id(value: str, where: str = "HELIX_HOST_ID") -> str:
    """``value`` if it is a usable host identity, else ``ValueError`` naming ``where``."""
    if not isinstance(value, str) or not value.strip() or len(value) > 200 or not value.isprintable():
        raise ValueError(f"{where} must be a printable, non-empty name of at most 200 characters, got {value!r}")
    return value.strip()


def host_id(override: str | None = None) -> str:
    """This host's identity: ``override``, else ``HELIX_HOST_ID``, else ``<hostname>-<boot id[:8]>``."""
    if override:
        return check_host_id(override, "--host-id")
    env = os.environ.get("HELIX_HOST_ID")
    if env is not None:
        return check_host_id(env)
    name = socket.gethostname()
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip().replace("-", "")[:8]
    except OSError:  # not Linux: the hostname alone
        return name
    return f"{name}-{boot}" if boot else name
