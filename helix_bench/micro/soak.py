"""``helix soak``: loaders against a cluster for a long time with faults injected, printing what
must stay flat — the process tree's RSS, /dev/shm segments and bytes, open descriptors, threads —
and what must stay zero: samples lost or repeated (a benchmark, not a test).

Faults, in turn, one every ``fault_every_s`` (with ``faults``, only so many, and the soak ends once
the clients have run as many epochs as there are clients after the last): SIGKILL a DataServer (it
is started again), SIGSTOP a DataServer for a few seconds, SIGKILL a worker (its pool respawns it), restart the Coordinator,
SIGKILL a client (a new one takes its place). Each client is a process that runs epochs of a
``DistributedDataLoader`` and reports, per epoch, how many of the sampler's samples it missed or
saw twice.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass

__all__ = ["SoakConfig", "run_soak"]

FAULTS = ("kill-server", "stop-server", "kill-worker", "restart-coordinator", "kill-client")

_CLIENT = textwrap.dedent("""
    import collections, json, sys
    import helix_core as hx
    from helix_core.testing.datasets import IndexDataset
    from torch.utils.data import DistributedSampler
    address, rank, world, n, config = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    ds = IndexDataset(n, shape=(1 << 14,), delays={i: 0.002 for i in range(n)})
    cfg = hx.ClusterConfig(**json.loads(config))
    ld = hx.DistributedDataLoader(ds, batch_size=4, rank=rank, world_size=world, coordinator=address, shuffle=True,
                                  prefetch_depth=4, config=cfg)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)  # what it must yield
    for epoch in range(10**9):
        ld.set_epoch(epoch)
        sampler.set_epoch(epoch)
        want = collections.Counter(sampler)
        got = collections.Counter(int(i) for b in ld for i in b["index"])
        lost, extra = sum((want - got).values()), sum((got - want).values())
        print(json.dumps({"epoch": epoch, "lost": lost, "repeated": extra}), flush=True)
""")


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 30.0
    report_every_s: float = 120.0
    fault_every_s: float = 15.0
    clients: int = 2
    samples: int = 512
    faults: int = 0  # > 0: end once this many faults are in and the clients ran as many epochs after the last

    def __post_init__(self):
        if not (self.minutes > 0 and self.report_every_s > 0 and self.fault_every_s > 0):
            raise ValueError("--minutes, --report-every and --fault-every must be > 0")
        if self.clients < 1 or self.samples < self.clients * 4:
            raise ValueError("--clients must be >= 1 and --samples at least 4 per client")
        if self.faults < 0:
            raise ValueError(f"--faults {self.faults}: 0 (no limit) or more")


class _Client:
    """One loader process and the thread that reads its per-epoch reports."""

    def __init__(self, rank: int, world: int, address: str, cfg: SoakConfig, config_json: str, totals: dict):
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, address, str(rank), str(world), str(cfg.samples), config_json],
            stdout=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, args=(totals,), daemon=True)
        self._reader.start()

    def _read(self, totals: dict) -> None:
        for line in self.proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            totals["epochs"] += 1
            totals["lost"] += rec["lost"]
            totals["repeated"] += rec["repeated"]
            totals["epoch_done"].set()

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)
        self.proc.stdout.close()


def _row(cluster, totals: dict, faults: int, t0: float) -> dict:
    import psutil

    from helix_core.memory import shm

    rss = fds = threads = 0
    for p in [psutil.Process()] + psutil.Process().children(recursive=True):
        try:
            with p.oneshot():
                rss, fds, threads = rss + p.memory_info().rss, fds + p.num_fds(), threads + p.num_threads()
        except psutil.Error:
            continue
    names = shm.list_segments(f"helix-{cluster.cluster_id}-")
    size = 0
    for n in names:
        try:
            size += os.stat(os.path.join(shm.SHM_DIR, n)).st_size
        except OSError:
            pass
    return {
        "minute": (time.monotonic() - t0) / 60,
        "rss_mb": rss / 2**20,
        "segments": len(names),
        "shm_mb": size / 2**20,
        "fds": fds,
        "threads": threads,
        "epochs": totals["epochs"],
        "lost": totals["lost"],
        "repeated": totals["repeated"],
        "faults": faults,
    }


def _inject(kind: str, cluster, clients: list, make_client) -> None:
    if kind == "kill-server":
        cluster.restart_server(len(cluster.servers) - 1)  # SIGKILL, then a new one in its slot
    elif kind == "stop-server":
        pid = cluster.servers[0].pid
        os.kill(pid, signal.SIGSTOP)
        time.sleep(4.0)
        os.kill(pid, signal.SIGCONT)
    elif kind == "kill-worker":
        pids = cluster.worker_pids(0)
        if pids:
            os.kill(pids[0], signal.SIGKILL)
    elif kind == "restart-coordinator":
        cluster.kill_coordinator()
        time.sleep(2.0)
        cluster.restart_coordinator()
    elif kind == "kill-client":
        victim = clients.pop(0)
        victim.stop(kill=True)
        clients.append(make_client(victim.rank))


def run_soak(cfg: SoakConfig, console=None) -> list[dict]:
    """Run the soak; print a row every ``report_every_s`` and return the rows."""
    from rich.console import Console
    from rich.table import Table

    import helix_core as hx

    console = console or Console()
    config = hx.ClusterConfig(
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=1.0,
        coordinator_timeout_s=5.0,
        keepalive_s=0.5,
        keepalive_timeout_s=1.0,
        rpc_timeout_s=3.0,
        execute_timeout_s=120.0,
        sample_timeout_s=60.0,
        slab_idle_s=20.0,
    )
    config_json = json.dumps(config.to_dict())
    totals = {"epochs": 0, "lost": 0, "repeated": 0, "epoch_done": threading.Event()}
    epochs_at_last_fault = None  # with cfg.faults: the epoch count when the last fault went in
    rows: list[dict] = []
    columns = ("minute", "rss_mb", "segments", "shm_mb", "fds", "threads", "epochs", "lost", "repeated", "faults")

    def show(row: dict) -> None:
        console.print(
            "  ".join(f"{k} {row[k]:.1f}" if isinstance(row[k], float) else f"{k} {row[k]}" for k in columns),
            soft_wrap=True,
        )  # one row per line, whatever the terminal's width

    with hx.LocalCluster(local_servers=2, remote_servers=1, workers_per_server=1, config=config) as cluster:

        def make_client(rank: int) -> _Client:
            return _Client(rank, cfg.clients, cluster.address, cfg, config_json, totals)

        clients = [make_client(r) for r in range(cfg.clients)]
        try:
            t0 = time.monotonic()
            end, next_report, next_fault, faults = (
                t0 + cfg.minutes * 60,
                t0 + min(30.0, cfg.report_every_s),
                t0 + cfg.fault_every_s,
                0,
            )
            rows.append(_row(cluster, totals, faults, t0))
            show(rows[-1])
            while time.monotonic() < end:
                totals["epoch_done"].clear()  # before the count is read: an epoch after it wakes the wait below
                if epochs_at_last_fault is not None and totals["epochs"] >= epochs_at_last_fault + cfg.clients:
                    end = time.monotonic()  # every kind of fault asked for is in, and epochs ran after the last
                totals["epoch_done"].wait(max(0.0, min(next_report, next_fault, end) - time.monotonic()))
                now = time.monotonic()
                if now >= next_fault and now < end:
                    kind = FAULTS[faults % len(FAULTS)]
                    _inject(kind, cluster, clients, make_client)
                    faults += 1
                    next_fault = time.monotonic() + cfg.fault_every_s
                    if cfg.faults and faults >= cfg.faults:
                        epochs_at_last_fault = totals["epochs"]
                        next_fault = math.inf  # no more: wait for epochs (or a report), not for a fault
                if now >= next_report or now >= end:
                    rows.append(_row(cluster, totals, faults, t0))
                    show(rows[-1])
                    next_report = now + cfg.report_every_s
        finally:
            for c in clients:
                c.stop()
    table = Table(title=f"helix soak: {cfg.minutes:g} min, a fault every {cfg.fault_every_s:g} s ({', '.join(FAULTS)})")
    for k in columns:
        table.add_column(k, justify="right")
    for r in (rows[0], rows[-1]) if len(rows) > 1 else rows:
        table.add_row(*(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in columns))
    console.print(table)
    return rows
