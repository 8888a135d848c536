"""Frozen, validated configuration of a Helix cluster (heartbeats, timeouts, limits)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = ["PROTOCOL_VERSION", "ClusterConfig", "cache_dir"]

def cache_dir() -> Path:
    """``$HELIX_CACHE``, else ``~/.cache/helix``: where synthesized workloads, bench data and
    reports are kept between runs."""
    return Path(os.environ.get("HELIX_CACHE", Path.home() / ".cache" / "helix"))


#: Wire protocol version; every connection checks it first (Hello).
PROTOCOL_VERSION = 5  # 5: host identities on registration and Route (host-aware topology); 4: work stealing


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
    startup_timeout_s: float = 120.0  # LocalCluster: processes ready within this
    stop_timeout_s: float = 5.0  # graceful stop, then SIGKILL
    max_message_bytes: int = 64 << 20  # gRPC send/receive limit
    stream_chunk_bytes: int = 4 << 20  # remote delivery chunk size
    max_task_retries: int = 2  # worker deaths on one sample before it becomes a SampleError
    max_resubmits: int = 8  # client: resubmits of one task after server failures
    server_threads: int = 64  # gRPC handler threads of a DataServer (bounds tasks in flight)
    decode_slots: int = 0  # batches prepared at once per host, by all its workers (0: one per core)
    work_stealing: bool = True  # a DataServer worker with nothing queued takes the unstarted tail of a running batch

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "decode_slots" and isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                continue
            if f.name == "work_stealing":
                if not isinstance(v, bool):
                    raise ValueError(f"ClusterConfig.work_stealing must be True or False, got {v!r}")
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ClusterConfig.{f.name} must be a positive number, got {v!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("ClusterConfig.heartbeat_timeout_s must exceed heartbeat_interval_s "
                             f"({self.heartbeat_timeout_s} <= {self.heartbeat_interval_s})")

    @classmethod
    def for_tests(cls, **overrides) -> "ClusterConfig":
        base = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, rpc_timeout_s=3.0,
                    coordinator_timeout_s=3.0, execute_timeout_s=120.0, stop_timeout_s=3.0)
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
