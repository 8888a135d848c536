"""The supervisor's handle of one worker process (``worker.py`` is the child's program): its
pipe, its progress and steal-claim cells, the task it runs — and what its death leaves behind."""

from __future__ import annotations

import multiprocessing as mp
import os

from helix_core.memory import shm
from helix_core.server import cpuslots
from helix_core.server.steal import Claim
from helix_core.server.worker import Progress, worker_main

__all__ = ["WorkerProcess"]


class WorkerProcess:
    """Worker ``wid``'s ``incarnation``-th process, started at once (spawn). Its slabs are named
    ``<prefix>w<wid>i<incarnation>-``; ``slab_lease``: their ``(orphan_s, idle_s)``; ``nice``: its
    niceness (``ClusterConfig.worker_nice``)."""

    def __init__(
        self,
        wid: int,
        incarnation: int,
        prefix: str,
        allow_pickle: bool,
        cpu_slots=None,
        memory_fraction: float = 1.0,
        slab_lease: tuple[float, float] = (900.0, 60.0),
        nice: int = 0,
    ):
        ctx = mp.get_context("spawn")
        self.wid, self.incarnation, self.cpu_slots = wid, incarnation, cpu_slots
        self.prefix = f"{prefix}w{wid}i{incarnation}-"
        self.conn, child = ctx.Pipe(duplex=True)
        self.progress = Progress(ctx)
        self.progress.clear()
        self.claim = Claim(ctx, os.path.join(shm.SHM_DIR, f"{prefix}claim-w{wid}i{incarnation}"))
        self.proc = ctx.Process(
            target=worker_main,
            args=(
                child,
                self.prefix,
                allow_pickle,
                os.getpid(),
                cpu_slots,
                self.progress,
                self.claim,
                memory_fraction,
                slab_lease,
                nice,
            ),
            name=f"helix-worker-{wid}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.task: dict | None = None
        self.started = 0.0  # clock() when its task was handed over
        self.specs: set[str] = set()
        self.timed_out: tuple[int, str, str] | None = None  # (index, path, cause): the watchdog killed it

    def kill(self) -> None:
        try:
            self.proc.kill()
        except (OSError, ValueError):
            pass

    def bury(self) -> tuple[int | None, list[str]]:
        """After its death: ``(exit code, slabs a client still holds)``. Its free slabs are unlinked
        now; held ones (maybe not even mapped yet) stay until released, so a reply already sent
        stays readable. A decode slot it held is given back (the kernel tells no one) and its FIFO
        removed."""
        self.proc.join(timeout=1.0)
        self.claim.unlink()
        held = [n for n in shm.list_segments(self.prefix) if not shm.unlink_if_free(n)]
        if self.cpu_slots:
            cpuslots.forget(self.cpu_slots[0], self.proc.pid)
            cpuslots.notify(*self.cpu_slots)
        return self.proc.exitcode, held
