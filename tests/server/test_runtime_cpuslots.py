"""Host-wide decode slots: at most n holders, granted earliest deadline first, freed when a holder dies."""

import multiprocessing as mp
import os
import signal

import numpy as np
from dataplane import wait_for

from helix_core.memory import shm
from helix_core.server.cpuslots import CpuSlots


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


def test_the_last_dataserver_of_a_host_unlinks_the_slots_and_only_it():
    from helix_core.server.cpuslots import HostSlots

    prefix = f"helix-test-{os.getpid()}-own"
    a, b = HostSlots(prefix), HostSlots(prefix)  # two DataServers of one host
    worker = CpuSlots(prefix, 2)
    worker.close()
    files = shm.list_segments(prefix)
    assert len(files) == 4  # two slots, the waiting table, the membership file
    assert a.close() is False and shm.list_segments(prefix) == files  # one server stops: the other's slots stay
    c = HostSlots(prefix)  # a server joining now shares the same files
    assert b.close() is False and shm.list_segments(prefix) == files
    assert c.close() is True and shm.list_segments(prefix) == []  # the last one cleans up
    d = HostSlots(prefix)  # and the next generation starts afresh
    assert d.close() is True and shm.list_segments(prefix) == []


def _release_after(prefix, holding, go):
    slots = CpuSlots(prefix, 1)
    assert slots.acquire(0.0)
    holding.set()
    go.wait(30)
    slots.release()
    slots.close()


def test_a_waiter_blocks_without_polling_and_a_release_wakes_it():
    import threading

    prefix = f"helix-test-{os.getpid()}-wake"
    ctx = mp.get_context("spawn")
    holding, go = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_release_after, args=(prefix, holding, go), daemon=True)
    holder.start()
    try:
        assert holding.wait(60)
        slots = CpuSlots(prefix, 1, patience_s=3600.0)  # only a wake-up can end its wait
        got = threading.Event()
        t = threading.Thread(target=lambda: got.set() if slots.acquire(1.0) else None, daemon=True)
        t.start()
        table = os.path.join(shm.SHM_DIR, f"{prefix}q")
        wait_for(lambda: _waiting(table) == [(1.0, 1)], 30, "the waiter to list itself")
        assert not got.is_set()
        go.set()
        assert got.wait(30)  # the release's byte in its FIFO woke it
        t.join(10)
        slots.release()
        slots.close()
    finally:
        holder.join(timeout=10)
        shm.sweep(prefix)


def test_a_release_reaches_a_waiter_whose_fifo_was_made_anew(tmp_path):
    """Releases keep waiters' FIFOs open between wake-ups; when the waiter behind one is gone and a
    new process of the same pid made a new FIFO (or it left and waits again), the ring reaches the
    new one, not the dead one."""
    from helix_core.server.cpuslots import _Doorbells, _fifo

    prefix, pid = "hx-bells-", 4242
    path = _fifo(str(tmp_path), prefix, pid)
    bells = _Doorbells(str(tmp_path), prefix)
    try:
        assert bells.ring(pid) is False  # nobody waits under that pid
        os.mkfifo(path, 0o600)
        old = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        assert bells.ring(pid) and os.read(old, 16) == b"w"
        os.close(old)  # the waiter leaves; a new one of the same pid makes its FIFO afresh
        os.unlink(path)
        os.mkfifo(path, 0o600)
        new = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        assert bells.ring(pid) and os.read(new, 16) == b"w"
        os.close(new)
        os.unlink(path)
        assert bells.ring(pid) is False  # and once it is gone, the ring passes to the next in line
    finally:
        bells.close()


def _plant_symlink(target: str, path: str) -> None:
    """A symlink at ``path`` made by another user (nobody) where the test runs as root."""
    import subprocess

    if os.geteuid() == 0:
        subprocess.run(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "ln", "-s", target, path],
            check=True,
            timeout=30,
        )
    else:
        os.symlink(target, path)


def test_a_symlink_planted_at_a_slot_path_is_refused_and_not_followed(tmp_path):
    import pytest

    from helix_core.server.cpuslots import HostSlots

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    prefix = f"helix-test-{os.getpid()}-sym"
    planted = [os.path.join(shm.SHM_DIR, f"{prefix}{name}") for name in ("0", "m")]
    for path in planted:
        _plant_symlink(str(victim), path)
    try:
        with pytest.raises(PermissionError, match="symlink"):
            CpuSlots(prefix, 2)  # its first slot file is the planted link
        with pytest.raises(PermissionError, match="symlink"):
            HostSlots(prefix)  # the membership file too
        assert victim.read_bytes() == b"keep" and os.stat(victim).st_size == 4  # never opened through the link
        assert shm.sweep(prefix) >= 0 and all(os.path.islink(p) for p in planted)  # cleanup leaves them
    finally:
        for path in planted:
            os.unlink(path)
        shm.sweep(prefix)
    assert shm.list_segments(prefix) == []


def test_a_slot_file_of_another_user_is_refused():
    import subprocess

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to plant a file as another user")
    prefix = f"helix-test-{os.getpid()}-foreign"
    path = os.path.join(shm.SHM_DIR, f"{prefix}q")
    subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "sh", "-c", f"umask 0; : > {path}"],
        check=True,
        timeout=30,
    )
    try:
        with pytest.raises(PermissionError, match="not this user's"):
            CpuSlots(prefix, 1)  # its waiting table would be another user's to rewrite
    finally:
        os.unlink(path)
        shm.sweep(prefix)
    assert shm.list_segments(prefix) == []
