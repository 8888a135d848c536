"""What ``helix bench --hosts`` runs: ``HostBenchConfig`` (the emulated hosts, their CPU quotas, the
sidecar counts, the systems and the workload), checked once, each error naming its flag; and
``SYSTEMS``, the systems the sweep knows. The sweep (``sweep.py``) and each of its points
(``point.py``) read it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SYSTEMS", "HostBenchConfig"]


@dataclass(frozen=True)
class HostBenchConfig:
    hosts: int = 2
    ranks_per_host: int = 2
    host_cpus: float = 0.5
    sidecars: tuple[int, ...] = (0, 1, 2)
    sidecar_cpus: float = 0.5
    link_mbps: float | None = None
    repeats: int = 1  # interleaved rounds (native, helix 0, 1, ... sidecars; again): medians per point
    systems: tuple[str, ...] = ("native", "helix")
    workload: str = "kinetics-mixed"
    model: str = "videomae"
    batch_size: int = 2
    warmup: int = 8
    steps: int = 32
    prefetch: int = 4
    clips: int = 24
    scale: float = 0.5
    seed: int = 0
    estimate_noise: float = 0.0  # > 0: the costs the loaders plan with are off by a seeded log-normal factor
    data_dir: str = str(Path.home() / ".cache" / "helix" / "bench-data")
    # None: the GPU window matches the decode capacity of the hosts plus the most sidecars;
    # "gpu-bound" / "cpu-bound": the main bench's regimes (the window that factor of it)
    regime: str | None = None
    # "s3" / "http": the workload is read from a server on an emulated storage host behind a
    # ``storage_mbps`` link (native: each rank's workers read it; helix: the DataServers)
    storage: str | None = None
    storage_mbps: float | None = 200.0

    def __post_init__(self):
        if self.hosts < 1 or self.ranks_per_host < 1 or self.repeats < 1:
            raise ValueError("--hosts, --ranks-per-host and --repeats must be >= 1")
        if not self.sidecars or min(self.sidecars) < 0:
            raise ValueError(f"--sidecars must be a list of counts >= 0, got {list(self.sidecars)}")
        for flag, v in (("--host-cpus", self.host_cpus), ("--sidecar-cpus", self.sidecar_cpus)):
            if not 0.05 <= v <= 1e3:
                raise ValueError(f"{flag} must be a CPU quota >= 0.05 cores, got {v}")
        cores = os.cpu_count() or 1
        need = self.hosts * self.host_cpus + max(self.sidecars) * self.sidecar_cpus
        if need > cores + 1e-9:
            raise ValueError(
                f"--hosts {self.hosts} x --host-cpus {self.host_cpus} + {max(self.sidecars)} sidecars x "
                f"--sidecar-cpus {self.sidecar_cpus} = {need:g} CPUs, more than this machine's {cores}: "
                "the quotas would not hold"
            )
        if not 0.0 <= self.estimate_noise < 10.0:
            raise ValueError(f"--estimate-noise {self.estimate_noise!r}: a log-normal sigma in [0, 10)")
        from helix_bench.emulate import REGIMES

        if self.regime is not None and self.regime not in REGIMES:
            raise ValueError(f"--regime {self.regime!r}: with --hosts one of {', '.join(REGIMES)}")
        if self.storage not in (None, "s3", "http"):
            raise ValueError(f"--storage {self.storage!r}: s3 or http")
        if self.storage_mbps is not None and not self.storage_mbps > 0:
            raise ValueError(f"--storage-mbps must be > 0, got {self.storage_mbps}")
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad:
            raise ValueError(f"--systems {bad}: the hosts mode runs {', '.join(SYSTEMS)}")

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host


#: native; helix; helix-grpc: helix with remote batches sent by gRPC's Deliver, not the bulk path;
#: helix-tier2: helix with Tier-2 rounds over all the ranks (rows that change host go through each
#: host's member: one packed all_to_all)
SYSTEMS = ("native", "helix", "helix-grpc", "helix-tier2")
