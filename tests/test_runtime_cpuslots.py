"""Host-wide decode slots: at most n holders, granted earliest deadline first, freed when a holder dies."""
import multiprocessing as mp
import os
import signal

import numpy as np

from helix_core.runtime import shm
from helix_core.runtime.cpuslots import CpuSlots

from dataplane import wait_for


def _hold(prefix, key, started, order, release):
    slots = CpuSlots(prefix, 1)
    started.put(key)
    assert slots.acquire(key)
    order.put(key)
    release.wait(30)
    slots.release()
    slots.close()


def _waiting(table: str) -> list[tuple[float, int]]:
    entries = np.fromfile(table, dtype=[("pid", "<i8"), ("key", "<f8"), ("eligible", "<i8")])
    return [(float(e["key"]), int(e["eligible"])) for e in entries if e["pid"]]


def test_one_slot_goes_to_the_earliest_deadline_and_a_dead_holder_frees_it(tmp_path):
    prefix = f"helix-test-{os.getpid()}-cpu"
    ctx = mp.get_context("spawn")
    started, order = ctx.Queue(), ctx.Queue()
    release = [ctx.Event() for _ in range(3)]
    procs = []
    try:
        holder = ctx.Process(target=_hold, args=(prefix, 0.0, started, order, release[0]), daemon=True)
        holder.start()
        assert order.get(timeout=60) == 0.0  # it holds the only slot
        for k, key in ((1, 10.0), (2, 5.0)):  # needed later first, needed sooner second
            p = ctx.Process(target=_hold, args=(prefix, key, started, order, release[k]), daemon=True)
            p.start()
            procs.append(p)
        table = os.path.join(shm.SHM_DIR, f"{prefix}q")
        # both wait; only the one needed sooner may take the slot, though it came second
        wait_for(lambda: sorted(_waiting(table)) == [(5.0, 1), (10.0, 0)], 60, "both waiters ranked by deadline")
        os.kill(holder.pid, signal.SIGKILL)  # the kernel drops a dead holder's lock
        assert order.get(timeout=30) == 5.0  # the earlier deadline wins
        release[2].set()
        assert order.get(timeout=30) == 10.0
        release[1].set()
    finally:
        for p in [holder, *procs]:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shm.sweep(prefix)
