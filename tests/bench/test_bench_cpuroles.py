"""CPU-seconds by role: pure accounting on plain dicts, and a snapshot of a real process tree."""

import multiprocessing as mp
import os
import time

import pytest

from helix_bench.cpuroles import (
    assign_roles,
    cpu_by_role,
    decode_efficiency,
    snapshot,
    split_decode,
)


def test_roles_follow_explicit_pids_then_parents_then_other():
    root = 1
    # root -> rank 10 -> its DataLoader worker 11; root -> server 20 -> worker 21 -> helper 22;
    # root -> stray 30 -> 31; 40 is outside root's tree and unnamed
    parents = {1: 0, 10: 1, 11: 10, 20: 1, 21: 20, 22: 21, 30: 1, 31: 30, 40: 2}
    roles = assign_roles(
        parents, {"ranks": [10], "dataservers": [20]}, {"ranks": "loader-workers", "dataservers": "workers"}, root
    )
    assert roles == {
        10: "ranks",
        11: "loader-workers",
        20: "dataservers",
        21: "workers",
        22: "workers",
        30: "other",
        31: "other",
    }
    # an explicit pid under another explicit pid keeps its own role (a decoder actor under the raylet)
    roles = assign_roles({5: 1, 6: 5, 7: 5}, {"ray-system": [5], "ray-decoders": [6]}, {}, 1)
    assert roles == {5: "ray-system", 6: "ray-decoders", 7: "ray-system"}


def test_cpu_by_role_counts_differences_and_newborns_whole():
    before = {10: ("ranks", 1.0), 11: ("loader-workers", 5.0), 12: ("loader-workers", 2.0), 99: ("other", 3.0)}
    after = {
        10: ("ranks", 1.5),
        11: ("loader-workers", 7.0),  # 12 and 99 exited: their CPU is lost
        13: ("loader-workers", 0.25),  # born in between: all of it
        12: ("workers", 0.5),
    }  # a reused pid (another role): a newborn
    assert cpu_by_role(before, after) == pytest.approx({"ranks": 0.5, "loader-workers": 2.25, "workers": 0.5})
    assert cpu_by_role({1: ("ranks", 4.0)}, {1: ("ranks", 1.0)}) == {"ranks": 1.0}  # less than before: reused


def test_split_decode_and_efficiency():
    by_role = {"ranks": 1.0, "workers": 6.0, "dataservers": 1.0}
    split = split_decode(by_role, 5.0, "workers")
    assert split == {"ranks": 1.0, "workers": 1.0, "dataservers": 1.0, "decode": 5.0}
    assert by_role["workers"] == 6.0  # a copy
    assert split_decode({"workers": 1.0}, 1.5, "workers") == {"workers": 0.0, "decode": 1.5}
    assert decode_efficiency(4.0, split) == pytest.approx(0.5)
    assert decode_efficiency(1.0, {}) is None
    with pytest.raises(ValueError, match="decode_cpu_s"):
        split_decode(by_role, -1.0, "workers")


def _burn(seconds: float, ready, start, done, stop) -> None:
    ready.set()
    start.wait(30)
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass
    done.set()
    stop.wait(30)  # stay alive so that the second snapshot sees this process


def test_snapshot_reads_roles_and_cpu_of_a_real_tree():
    ctx = mp.get_context("spawn")
    start, stop = ctx.Event(), ctx.Event()
    ready, done = [ctx.Event(), ctx.Event()], [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=_burn, args=(0.3, ready[k], start, done[k], stop), daemon=True) for k in range(2)]
    try:
        for p in procs:
            p.start()
        assert all(r.wait(60) for r in ready)  # start-up (imports) is not the CPU under test
        me = os.getpid()
        roles = {"ranks": [procs[0].pid]}
        before = snapshot(roles, me, {"ranks": "loader-workers"})
        assert before[procs[0].pid][0] == "ranks" and before[procs[1].pid][0] == "other"
        assert me not in before  # the root is counted only when named
        start.set()
        assert all(d.wait(30) for d in done)
        after = snapshot(roles, me, {"ranks": "loader-workers"})
        used = cpu_by_role(before, after)
        assert 0.25 <= used["ranks"] <= 0.6 and 0.25 <= used["other"] <= 0.6
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
    assert not any(p.is_alive() for p in procs)
