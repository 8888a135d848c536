"""Frozen, validated configuration of a Helix cluster (heartbeats, timeouts, limits)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = ["PROTOCOL_VERSION", "ClusterConfig", "cache_dir"]


def cache_dir() -> Path:
    """``$HELIX_CACHE``, else ``~/.cache/helix``: where synthesized workloads, bench data and
    reports are kept between runs."""
    return Path(os.environ.get("HELIX_CACHE", Path.home() / ".cache" / "helix"))


#: Wire protocol version; every connection checks it first (Hello).
PROTOCOL_VERSION = 12  # what each version added: docs/protocol.md


@dataclass(frozen=True)
class ClusterConfig:
    """Timing and limits shared by the Coordinator, DataServers and clients. Seconds and bytes.

    Tests use short heartbeats (``ClusterConfig.for_tests()``: 100 ms, dead after 500 ms).
    """

    heartbeat_interval_s: float = 1.0  # DataServer -> Coordinator
    heartbeat_timeout_s: float = 5.0  # missed for this long: the server is dead
    rpc_timeout_s: float = 10.0  # deadline of every control-plane RPC
    execute_timeout_s: float = 600.0  # deadline of one batch (decode + delivery)
    coordinator_timeout_s: float = 15.0  # client: Coordinator unreachable this long -> ClusterError
    keepalive_s: float = 2.0  # HTTP/2 ping on every channel with calls in flight, this often
    keepalive_timeout_s: float = 3.0  # unanswered this long: the peer is gone (SIGSTOP, half-open), its calls fail
    startup_timeout_s: float = 120.0  # LocalCluster: processes ready within this
    stop_timeout_s: float = 5.0  # graceful stop, then SIGKILL
    max_message_bytes: int = 64 << 20  # gRPC send/receive limit
    stream_chunk_bytes: int = 4 << 20  # remote delivery chunk size
    slab_idle_s: float = 60.0  # a free shared-memory slab unused this long is unlinked (the pool shrinks)
    sample_timeout_s: float = (
        300.0  # one sample's decode past this (and 20x its predicted cost): its worker is killed, the sample fails
    )
    worker_memory_fraction: float = 0.5  # each worker's address space: at most this share of the host's RAM (RLIMIT_AS)
    max_task_retries: int = 2  # worker deaths on one sample before it becomes a SampleError
    max_resubmits: int = 8  # client: resubmits of one task after server failures
    server_threads: int = 64  # gRPC handler threads of a DataServer (bounds tasks in flight)
    decode_slots: int = 0  # batches prepared at once per host, by all its workers (0: one per core)
    worker_nice: int = (
        10  # decoding workers' niceness (0-19): a rank's or server's thread that wakes takes a core first
    )
    work_stealing: bool = True  # a DataServer worker with nothing queued takes the unstarted tail of a running batch
    allow_pickle: bool = True  # cloudpickled datasets and batches between authenticated peers (False: JSON specs only)
    local_link: bool = True  # Execute and Route to servers of the rank's own host over a Unix socket (wire/locallink/link.py); False: gRPC
    bulk_delivery: bool = True  # remote batches reach the delivery server's slab by the bulk path (wire/bulk/common.py); False: gRPC Deliver

    def __post_init__(self):
        for f in fields(self):
            v, name = getattr(self, f.name), f"ClusterConfig.{f.name}"
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            if kind == "bool":
                if not isinstance(v, bool):
                    raise TypeError(f"{name} must be True or False, got {v!r}")
            elif kind == "int":  # counts and byte sizes: an int (not 2.0, not True)
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
                low = 0 if f.name in ("decode_slots", "worker_nice") else 1
                if v < low:
                    raise ValueError(f"{name} must be >= {low}, got {v!r}")
            else:  # seconds: a finite positive number (a NaN heartbeat timeout would keep dead servers alive)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError(f"{name} must be a number of seconds, got {type(v).__name__} {v!r}")
                if not (math.isfinite(v) and v > 0):
                    raise ValueError(f"{name} must be a finite positive number, got {v!r}")
        if self.worker_memory_fraction > 1:
            raise ValueError(
                f"ClusterConfig.worker_memory_fraction is a share of the host's RAM in (0, 1], "
                f"got {self.worker_memory_fraction!r}"
            )
        if self.worker_nice > 19:
            raise ValueError(f"ClusterConfig.worker_nice is a niceness in 0..19, got {self.worker_nice!r}")
        if self.sample_timeout_s >= self.execute_timeout_s:
            raise ValueError(
                "ClusterConfig.sample_timeout_s must be below execute_timeout_s (a hung sample must fail "
                f"before its batch's deadline: {self.sample_timeout_s} >= {self.execute_timeout_s})"
            )
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                "ClusterConfig.heartbeat_timeout_s must exceed heartbeat_interval_s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_interval_s})"
            )

    @classmethod
    def for_tests(cls, **overrides) -> ClusterConfig:
        base: dict[str, object] = dict(
            heartbeat_interval_s=0.1,
            heartbeat_timeout_s=0.5,
            rpc_timeout_s=3.0,
            coordinator_timeout_s=3.0,
            execute_timeout_s=120.0,
            stop_timeout_s=3.0,
            keepalive_s=0.5,
            keepalive_timeout_s=1.0,
            sample_timeout_s=60.0,
        )
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]  # each field checked in __post_init__

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
