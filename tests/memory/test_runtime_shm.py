"""Shared-memory slabs on the real /dev/shm: ownership, reuse, generations, cleanup, capacity."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import secrets
import time

import pytest

from helix_core.memory import shm, slabpool
from helix_core.memory.reader import SlabReader
from helix_core.memory.shm import ShmCapacityError
from helix_core.memory.slabpool import SlabPool

MIB = 1 << 20


@pytest.fixture
def prefix():
    """A prefix no other test or process uses; anything left under it fails the test."""
    p = f"helix-test{os.getpid()}{secrets.token_hex(3)}-"
    yield p
    assert shm.sweep(p) == 0, f"/dev/shm segments leaked under {p}"


def test_acquire_reuses_a_slab_only_after_the_client_released_it(prefix):
    with SlabPool(prefix) as pool:
        a = pool.acquire(1000)
        assert (a.capacity, a.generation, a.free) == (MIB, 1, False)
        assert a.name.startswith(f"{prefix}{os.getpid()}-1-")
        held = a.handle(1000)
        b = pool.acquire(10)  # `a` is held by a client: a new segment, never `a` again
        assert b.name != a.name
        assert pool.stats() == {
            "segments": 2,
            "bytes": 2 * (MIB + shm.HEADER_BYTES),
            "busy": 2,
            "created": 2,
            "reused": 0,
        }
        reader = SlabReader()
        assert reader.release(held)
        c = pool.acquire(10)
        assert (c.name, c.generation) == (a.name, 2)
        assert pool.stats()["reused"] == 1
        reader.close()


def test_acquire_picks_the_smallest_free_slab_that_fits(prefix):
    with SlabPool(prefix) as pool:
        small, big = pool.acquire(MIB), pool.acquire(3 * MIB - 5)
        assert (small.capacity, big.capacity) == (MIB, 3 * MIB)
        small.release()
        big.release()
        assert pool.acquire(2 * MIB).name == big.name
        assert pool.acquire(0).name == small.name


def test_a_stale_generation_release_is_ignored(prefix):
    with SlabPool(prefix) as pool:
        slab = pool.acquire(100)
        first = slab.handle(100)
        assert shm.release_segment(first)
        again = pool.acquire(100)
        assert again is slab and slab.generation == 2
        assert not shm.release_segment(first)  # the old client's late release must not free it
        assert not slab.free
        assert shm.release_segment(slab.handle(100))
        assert slab.free


def test_a_full_pool_drops_small_free_slabs_and_grows_while_all_are_held(prefix):
    with SlabPool(prefix, max_segments=2) as pool:
        a, b = pool.acquire(10), pool.acquire(10)
        c = pool.acquire(10)  # every kept slab is held (a user keeping batches): one more, not an error
        assert pool.stats()["segments"] == 3
        c.release()
        b.release()
        big = pool.acquire(2 * MIB)  # b and c are free but too small: they make room
        assert big.capacity == 2 * MIB
        assert shm.list_segments(prefix) == sorted([a.name, big.name])
        assert pool.stats()["segments"] == 2


def test_close_unlinks_everything_while_clients_keep_their_mapping(prefix):
    pool = SlabPool(prefix)
    slab = pool.acquire(100)
    slab.payload[:5] = b"hello"
    pool.acquire(5 * MIB)
    reader = SlabReader()
    view = reader.view(slab.handle(5))
    pool.close()
    assert shm.list_segments(prefix) == []
    assert bytes(view) == b"hello"  # tmpfs keeps the pages until the last mapping goes
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)
    reader.close()  # `view` still exports the mapping: kept, no BufferError
    assert bytes(view) == b"hello"
    del view
    reader.close()


def test_sweep_removes_the_prefix_and_refuses_broad_prefixes(prefix):
    for i in range(3):
        with open(os.path.join(shm.SHM_DIR, f"{prefix}dead-{i}"), "wb"):
            pass
    assert len(shm.list_segments(prefix)) == 3
    assert shm.sweep(prefix) == 3
    assert shm.list_segments(prefix) == []
    for bad in ("helix-", "", "myapp-cluster-", "/helix-x"):
        with pytest.raises(ValueError, match="helix-"):
            shm.sweep(bad)


def test_more_than_dev_shm_holds_raises_quickly_and_leaves_no_file(prefix):
    st = os.statvfs(shm.SHM_DIR)
    too_much = st.f_bavail * st.f_frsize + (1 << 30)
    with SlabPool(prefix) as pool:
        start = time.monotonic()
        with pytest.raises(ShmCapacityError, match=rf"{prefix}.*needs \d+ bytes and \d+ bytes are free"):
            pool.acquire(too_much)
        assert time.monotonic() - start < 2.0
        assert shm.list_segments(prefix) == []
        assert pool.stats()["segments"] == 0


def test_slabs_past_max_segments_leave_a_reserve_of_dev_shm(prefix, monkeypatch):
    monkeypatch.setattr(slabpool, "OVERFLOW_RESERVE", 1.0)  # as if /dev/shm were full past the reserve
    with SlabPool(prefix, max_segments=1) as pool:
        held = pool.acquire(10)  # within max_segments: only the plain capacity check
        with pytest.raises(ShmCapacityError, match="every slab this pool keeps for reuse is held"):
            pool.acquire(10)
        held.release()
        assert pool.acquire(10) is held and shm.list_segments(prefix) == [held.name]


def test_a_failed_reservation_unlinks_the_half_created_file(prefix, monkeypatch):
    def no_space(fd, offset, length):  # what tmpfs answers when statvfs raced another writer
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", no_space)
    with SlabPool(prefix) as pool:
        with pytest.raises(ShmCapacityError, match="needs"):
            pool.acquire(10)
        assert shm.list_segments(prefix) == []


def _child_reads(handle: dict, out) -> None:
    reader = SlabReader()
    data = bytes(reader.view(handle))
    reader.close()
    out.put((data, shm.release_segment(handle)))


def test_a_spawned_process_attaches_by_name_and_releases(prefix):
    ctx = mp.get_context("spawn")
    with SlabPool(prefix) as pool:
        slab = pool.acquire(3 * MIB)
        message = secrets.token_bytes(2 * MIB + 7)
        slab.payload[: len(message)] = message
        out = ctx.Queue()
        child = ctx.Process(target=_child_reads, args=(slab.handle(len(message)), out))
        child.start()
        try:
            data, released = out.get(timeout=60)
        finally:
            child.join(timeout=60)
            if child.is_alive():
                child.kill()
                child.join(timeout=10)
        assert child.exitcode == 0
        assert data == message and released and slab.free


def test_attach_names_a_missing_segment_and_release_of_it_is_a_no_op(prefix):
    reader = SlabReader()
    missing = f"{prefix}gone"
    with pytest.raises(FileNotFoundError, match=missing):
        reader.attach(missing)
    assert not reader.release(shm.SlabHandle(missing, 1))
    with pytest.raises(ValueError):
        reader.attach("../etc/passwd")


def test_attach_refuses_a_file_that_is_not_a_slab(prefix):
    name = f"{prefix}junk"
    with open(os.path.join(shm.SHM_DIR, name), "wb") as f:
        f.write(b"\0" * 128)
    with pytest.raises(ValueError, match="not a Helix slab"):
        SlabReader().attach(name)
    shm.sweep(prefix)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root (CI runs as root)")
def test_a_reader_maps_no_segment_another_user_planted_nor_a_symlink(prefix):
    """A slab's name, freed by its DataServer, taken by another user (or a link to a file of theirs):
    the reader refuses it before it maps a byte."""
    planted = os.path.join(shm.SHM_DIR, f"{prefix}planted")
    with open(planted, "wb") as f:
        f.write(shm.MAGIC + b"\0" * 4096)
    os.chown(planted, 65534, 65534)
    link = os.path.join(shm.SHM_DIR, f"{prefix}link")
    os.symlink(planted, link)
    try:
        with pytest.raises(PermissionError, match="belongs to uid 65534"):
            SlabReader().attach(f"{prefix}planted")
        with pytest.raises(PermissionError, match="symbolic link"):
            SlabReader().attach(f"{prefix}link")
    finally:
        os.unlink(link)
        os.unlink(planted)


def test_the_reader_unmaps_segments_the_pool_unlinked(prefix):
    reader = SlabReader()
    with SlabPool(prefix, max_segments=1) as pool:
        small = pool.acquire(10)
        reader.attach(small.name)
        small.release()
        big = pool.acquire(2 * MIB)  # unlinks `small`
        reader.attach(big.name)  # a new name: the reader drops its stale mapping of `small`
        assert list(reader._maps) == [big.name]
    reader.close()


def test_handle_and_header(prefix):
    with SlabPool(prefix) as pool:
        slab = pool.acquire(10)
        with pytest.raises(ValueError, match="holds"):
            slab.handle(slab.capacity + 1)
        mm = SlabReader().attach(slab.name)
        magic, gen, state, cap = shm._HEADER.unpack_from(mm, 0)
        assert (magic, gen, state, cap) == (b"HELIXSLB", 1, shm.BUSY, MIB)
        assert len(mm) == shm.HEADER_BYTES + MIB
        mm.close()


def test_a_slab_whose_holder_died_is_taken_back_and_idle_slabs_are_unlinked():
    import multiprocessing as mp
    import time

    from helix_core.memory.reader import SlabReader

    def hold(handle, ready):
        r = SlabReader()
        r.view(handle)  # maps it: the lease names this process
        ready.set()
        time.sleep(60)

    prefix = f"helix-test{os.getpid()}-lease-"
    with SlabPool(prefix, orphan_s=3600.0, idle_s=3600.0) as pool:
        slab = pool.acquire(1000)
        handle = slab.handle(1000)
        ctx = mp.get_context("fork")
        ready = ctx.Event()
        p = ctx.Process(target=hold, args=(handle, ready))
        p.start()
        assert ready.wait(30)
        assert pool.reclaim() == 0 and not slab.free  # its holder lives
        p.kill()
        p.join()
        assert pool.reclaim() == 1 and slab.free  # its holder died: the slab is free again
        unmapped = pool.acquire(1000)  # handed out, never mapped: taken back only after orphan_s
        assert pool.reclaim() == 0 and not unmapped.free
        pool.orphan_s = 0.0
        assert pool.reclaim() == 1
        pool.idle_s = 0.0
        time.sleep(0.01)
        pool.reclaim()
        assert pool.stats()["segments"] == 0 and shm.list_segments(prefix) == []  # idle: given back


def test_a_dead_producers_slab_is_unlinked_once_free_or_never_mapped_within_orphan_s():
    import time

    from helix_core.memory.reader import SlabReader

    prefix = f"helix-test{os.getpid()}-grave-"
    pool = SlabPool(prefix)
    try:
        held, unmapped, free = pool.acquire(100), pool.acquire(100), pool.acquire(100)
        free.release()
        reader = SlabReader()
        reader.view(held.handle(100))  # this process maps it: its holder is alive
        # the producer dies (its pool never closes): what may its graveyard unlink?
        assert shm.unlink_if_free(free.name) and not shm.unlink_if_free(held.name, 0.0)
        assert not shm.unlink_if_free(unmapped.name) and not shm.unlink_if_free(unmapped.name, 3600.0)
        time.sleep(0.01)
        assert shm.unlink_if_free(unmapped.name, 0.001)  # being written when it died: nobody will map it
        assert sorted(shm.list_segments(prefix)) == [held.name]
        reader.close()
    finally:
        shm.sweep(prefix)


def test_a_slab_shared_by_three_readers_is_free_only_after_the_last_release(prefix):
    """Tier 2 hands one slab's rows to several ranks: each releases once, the last one frees it,
    and the next hand-out starts with one holder again."""
    with SlabPool(prefix) as pool:
        a = pool.acquire(100)
        held = a.handle(100)
        leader, r1, r2 = SlabReader(), SlabReader(), SlabReader()
        assert leader.share(held, 3)
        assert not r1.release(held) and not a.free
        assert not r2.release(held) and not a.free
        assert leader.release(held) and a.free  # the third
        again = pool.acquire(100)
        assert again.name == a.name and not leader.share(held, 2)  # a stale handle is not shared
        assert r1.release(again.handle(100)) and again.free  # one holder again: the first release frees it
        for r in (leader, r1, r2):
            r.close()


def _as_nobody(*argv: str) -> None:
    """Run ``argv`` as another user (nobody), as a second local user would."""
    import subprocess

    subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *argv], check=True, timeout=30)


def _sweep_as(uid: int, prefix: str, planted: str, out) -> None:
    """A cluster's cleanup run by a user who is not root (so another user's file cannot be unlinked)."""
    try:
        os.setgid(uid)
        os.setuid(uid)
        for i in range(2):
            os.close(os.open(os.path.join(shm.SHM_DIR, f"{prefix}own-{i}"), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        gone = shm.unlink_if_free(planted)  # (a dead worker's slabs are buried the same way)
        out.send(("ok", shm.sweep(prefix), gone))
    except BaseException as e:  # noqa: BLE001 - what the parent asserts on
        out.send(("error", repr(e), None))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two other users")
def test_cleanup_leaves_another_users_file_under_the_prefix_and_removes_its_own(prefix):
    planted = f"{prefix}planted"
    path = os.path.join(shm.SHM_DIR, planted)
    _as_nobody("touch", path)
    try:
        ctx = mp.get_context("fork")
        got, out = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_sweep_as, args=(65533, prefix, planted, out))
        p.start()
        assert got.poll(30)
        status, swept, gone = got.recv()
        p.join(10)
        assert status == "ok", swept  # it used to raise PermissionError and stop half-way
        assert swept == 2 and gone is True  # its own two, and nothing of its own to wait for in the planted one
        assert shm.list_segments(prefix) == [planted] and os.stat(path).st_uid == 65534
        assert shm.sweep(prefix) == 0 and os.path.exists(path)  # root too leaves another user's file
    finally:
        os.unlink(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant files as another user")
def test_a_cluster_stops_cleanly_past_files_another_user_planted_under_its_prefix(tmp_path):
    import helix_core as hx
    from helix_core.testing.datasets import IndexDataset

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    cfg = hx.ClusterConfig.for_tests()
    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=cfg) as cluster:
        prefix = f"helix-{cluster.cluster_id}-"
        planted = [os.path.join(shm.SHM_DIR, f"{prefix}planted"), os.path.join(shm.SHM_DIR, f"{prefix}link")]
        _as_nobody("touch", planted[0])
        _as_nobody("ln", "-s", str(victim), planted[1])
        with hx.DistributedDataLoader(
            IndexDataset(8, shape=(4,)), 2, rank=0, world_size=1, coordinator=cluster.address, config=cfg
        ) as loader:
            assert len(list(loader)) == 4
    try:
        assert sorted(shm.list_segments(prefix)) == sorted(os.path.basename(p) for p in planted)
        assert victim.read_bytes() == b"keep"
    finally:
        for p in planted:
            os.unlink(p)
