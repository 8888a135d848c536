"""Liveness with real processes: a DataServer that stops answering (SIGSTOP: alive to the kernel,
silent to everyone) costs the epoch seconds — keepalive fails the calls in flight there and the
clients resubmit them — not ``execute_timeout_s``."""

import os
import signal
import time

from dataplane import CFG, assert_same_batches, segments, torch_batches

import helix_core as hx
from helix_core.testing.datasets import IndexDataset


def test_a_sigstopped_dataserver_costs_seconds_not_the_batch_deadline():
    ds = IndexDataset(48, shape=(64,), delays={i: 0.04 for i in range(48)})
    bound = CFG.heartbeat_timeout_s + CFG.keepalive_s + CFG.keepalive_timeout_s + 5.0
    assert bound < CFG.execute_timeout_s / 4
    with hx.LocalCluster(local_servers=2, remote_servers=1, workers_per_server=1, config=CFG) as cluster:
        stopped = []
        try:
            with hx.DistributedDataLoader(
                ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, prefetch_depth=6, config=CFG
            ) as ld:
                got, gaps, t = [], [], time.monotonic()
                for i, b in enumerate(ld):
                    now = time.monotonic()
                    gaps.append(now - t)
                    got.append(b)
                    if i in (4, 12):  # rank 0's own delivery server, then the remote sidecar
                        pid = cluster.servers[0 if i == 4 else 2].pid
                        os.kill(pid, signal.SIGSTOP)
                        stopped.append(pid)
                        t_stop = time.monotonic()
                    t = time.monotonic()
                assert_same_batches(got, torch_batches(ds, 2, 0, 1))  # exactly once, in order
                assert max(gaps) < bound, f"a batch took {max(gaps):.1f} s after a server stopped answering"
                assert ld.stats()["resubmits"] >= 1
                tele = ld.client.telemetry(last_decisions=10)
                assert {d["delivery"] for d in tele["decisions"][-3:]} == {cluster.servers[1].server_id}
                # the epoch may end before the Coordinator misses the sidecar's heartbeats: it must
                # mark both silent servers dead within the bound of the last stop
                gone = {cluster.servers[0].server_id, cluster.servers[2].server_id}
                deadline = t_stop + bound
                while True:
                    alive = {s["server_id"]: s["alive"] for s in ld.client.telemetry()["servers"]}
                    if not any(alive[s] for s in gone) or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert not any(alive[s] for s in gone), f"still alive {bound:.0f} s after the stop: {alive}"
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)  # what it finishes now goes to calls that are gone: it frees the slabs
    assert segments(cluster) == []


def _worker_pids(cluster) -> set[int]:
    return {pid for i in range(len(cluster.servers)) for pid in cluster.worker_pids(i)}


WATCHDOG = CFG.__class__.for_tests(sample_timeout_s=2.0)


def test_a_decode_that_never_returns_is_skipped_after_sample_timeout_and_its_worker_replaced():
    ds = IndexDataset(24, shape=(16,), delays={7: 3600.0})  # sample 7 "decodes" for an hour
    with hx.LocalCluster(local_servers=2, workers_per_server=1, config=WATCHDOG) as cluster:
        before = _worker_pids(cluster)
        t0 = time.monotonic()
        with hx.DistributedDataLoader(
            ds,
            batch_size=2,
            rank=0,
            world_size=1,
            coordinator=cluster.address,
            on_error="skip",
            prefetch_depth=4,
            config=WATCHDOG,
        ) as ld:
            batches = list(ld)
            stats = ld.stats()
        assert time.monotonic() - t0 < WATCHDOG.execute_timeout_s / 4
        seen = [int(i) for b in batches for i in b["index"]]
        assert len(batches) == 12 and len(seen) == 24 and 7 not in seen  # the epoch keeps its length
        assert stats["skipped"] == 1 and stats["resubmits"] == 0  # skipped where it hung, never sent elsewhere
        after = _worker_pids(cluster)
        assert len(before - after) == 1 and len(after) == 2  # the hung worker was killed and replaced
    assert segments(cluster) == []


def test_a_hung_sample_is_a_sample_error_naming_it_and_the_pool_keeps_serving():
    ds = IndexDataset(8, shape=(16,), delays={3: 3600.0})
    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=WATCHDOG) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, prefetch_depth=2, config=WATCHDOG
        ) as ld:
            it = iter(ld)
            next(it)
            try:
                next(it)
                raise AssertionError("the hung sample did not fail")
            except hx.SampleError as e:
                assert e.index == 3 and "timed out" in str(e) and "sample_timeout_s" in str(e)
            assert ld.stats()["resubmits"] == 0
        with hx.DistributedDataLoader(
            IndexDataset(8, shape=(16,)),
            batch_size=2,
            rank=0,
            world_size=1,
            coordinator=cluster.address,
            config=WATCHDOG,
        ) as ld:
            assert len(list(ld)) == 4  # the same server, a new worker


def test_configs_and_loader_options_of_the_wrong_kind_are_refused_naming_the_field():
    import math

    import pytest

    for field, bad, error in (
        ("heartbeat_timeout_s", math.nan, ValueError),
        ("rpc_timeout_s", math.inf, ValueError),
        ("execute_timeout_s", "600", TypeError),
        ("max_resubmits", 8.0, TypeError),
        ("work_stealing", 1, TypeError),
        ("keepalive_s", True, TypeError),
        ("sample_timeout_s", 900.0, ValueError),  # above execute_timeout_s
        ("worker_nice", 20, ValueError),
        ("worker_nice", -1, ValueError),
    ):
        with pytest.raises(error, match=f"ClusterConfig.{field}"):
            hx.ClusterConfig(**{field: bad})
    ds = IndexDataset(4)
    for option, bad, error in (
        ("shuffle", "false", TypeError),
        ("batch_size", 2.0, TypeError),
        ("prefetch_depth", 0, ValueError),
        ("drop_last", None, TypeError),
        ("seed", "0", TypeError),
        ("config", {"rpc_timeout_s": 1}, TypeError),
        ("collate_fn", "stack", TypeError),
        ("ddl_tolerance_s", math.nan, ValueError),
    ):
        with pytest.raises(error, match=option):
            hx.DistributedDataLoader(
                ds, **{"batch_size": 1, option: bad}, rank=0, world_size=1, coordinator="127.0.0.1:1"
            )


def test_a_coordinator_killed_mid_epoch_and_restarted_8_s_later_never_stops_the_data():
    ds = IndexDataset(400, shape=(16,), delays={i: 0.1 for i in range(400)})
    assert 8.0 > CFG.coordinator_timeout_s
    with hx.LocalCluster(local_servers=2, remote_servers=1, workers_per_server=1, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, prefetch_depth=6, config=CFG
        ) as ld:
            got, during, killed_at, restarted = [], 0, None, False
            for i, b in enumerate(ld):
                got.append(b)
                if i == 3:
                    cluster.kill_coordinator()
                    killed_at = time.monotonic()
                elif killed_at is not None and not restarted:
                    during += 1  # a batch that arrived while no Coordinator ran
                    if time.monotonic() - killed_at > 8.0:
                        cluster.restart_coordinator()
                        restarted = True
            assert restarted and during > 0
            assert_same_batches(got, torch_batches(ds, 2, 0, 1))  # exactly the sampler's batches
            assert ld.client.servers.routes > 0
            tele = ld.client.telemetry()  # the new Coordinator: everyone registered again, placement resumed
        assert tele["routed"] > 0 and ld.client.client_id in tele["clients"]
        assert sum(s["alive"] for s in tele["servers"]) == 3
    assert segments(cluster) == []


def test_a_sigkilled_client_has_its_load_and_slabs_released_within_a_few_heartbeat_timeouts():
    import subprocess
    import sys
    import textwrap

    from dataplane import busy_segments, wait_for

    with hx.LocalCluster(local_servers=1, remote_servers=1, workers_per_server=1, config=CFG) as cluster:
        code = textwrap.dedent(f"""
            import sys, time
            import helix_core as hx
            from helix_core.testing.datasets import IndexDataset
            ds = IndexDataset(400, shape=(1 << 16,), delays={{i: 0.05 for i in range(400)}})
            ld = hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, coordinator="{cluster.address}",
                                          prefetch_depth=6, config=hx.ClusterConfig.for_tests())
            it = iter(ld)
            kept = [next(it) for _ in range(6)]  # batches it holds: their slabs stay busy
            print(ld.client.client_id, flush=True)
            time.sleep(600)
        """)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            client_id = child.stdout.readline().strip()
            assert client_id, "the client did not start"
            from helix_core.loader.cluster_client import ClusterClient

            probe = ClusterClient(cluster.address, None, CFG, 0, 1)
            try:
                assert client_id in probe.telemetry()["clients"]
                assert busy_segments(cluster)  # what it holds
                child.kill()
                child.wait(10)
                budget = 4 * CFG.heartbeat_timeout_s + 2 * 2.0 + 3.0  # its lease, then the servers' idle reclaim
                wait_for(lambda: client_id not in probe.telemetry()["clients"], budget, "the lease to run out")
                wait_for(
                    lambda: all(s["outstanding"] == 0 for s in probe.telemetry()["servers"]),
                    budget,
                    "its load to be released",
                )
                wait_for(lambda: not busy_segments(cluster), budget, "its slabs to be taken back")
            finally:
                probe.close()
        finally:
            if child.poll() is None:
                child.kill()
            child.stdout.close()
    assert segments(cluster) == []


def test_the_watchdog_looks_again_at_a_worker_whose_sample_has_not_begun():
    """Unit test of the watchdog's timer (pure: no processes). A worker that was handed a task but
    has not stamped its first sample yet (waiting for a decode slot, say) must bring the supervisor
    back within a limit: it was the only event left when a lone worker then hung on that sample
    (the supervisor slept for ever and the rank waited out the batch deadline)."""
    from types import SimpleNamespace

    from helix_core.server.watchdog import Watchdog

    class Progress:
        started = None

        def get_started(self):
            return self.started

    killed = []
    w = SimpleNamespace(
        task={"indices": [6, 7], "predicted_cpu_s": 0.0},
        timed_out=None,
        progress=Progress(),
        wid=0,
        kill=lambda: killed.append(True),
    )
    watchdog = Watchdog(WATCHDOG)
    assert (
        watchdog.kill_hung([w], 1.0) == WATCHDOG.sample_timeout_s and not killed
    )  # not begun: look again within a limit
    w.progress.started = (7, "index://7", time.monotonic() - 0.5)
    assert 0 < watchdog.kill_hung([w], 1.0) <= WATCHDOG.sample_timeout_s - 0.5 and not killed
    w.progress.started = (7, "index://7", time.monotonic() - WATCHDOG.sample_timeout_s - 0.1)
    watchdog.kill_hung([w], 1.0)
    assert killed and "timed out" in w.timed_out[2]  # past its limit: killed, the sample named
    w.task = None
    assert watchdog.kill_hung([w], 1.0) is None  # nothing to watch: the supervisor sleeps until an event


def test_the_watchdog_retries_a_dead_workers_task_until_its_sample_has_killed_too_many():
    """Unit test of the watchdog's verdict on a dead worker's task (pure: plain dicts). A sample may
    kill ``max_task_retries`` workers and run again; one more death fails the task (or, with
    ``on_error="skip"``, marks the sample bad and runs the rest); a sample the watchdog killed fails
    at once; deaths before any sample fail the task after as many retries."""
    from helix_core.server.watchdog import Watchdog
    from helix_core.wire.messages import ErrorKind

    retries = WATCHDOG.max_task_retries
    watchdog = Watchdog(WATCHDOG)
    task = {"indices": [3, 4], "bad": {}}
    assert all(watchdog.retry_or_fail(task, (3, "index://3"), None, -9) is None for _ in range(retries))
    failed = watchdog.retry_or_fail(task, (3, "index://3"), None, -9)
    assert failed.error_kind == ErrorKind.SAMPLE and failed.failure.index == 3 and not task["bad"]

    skipping = {"indices": [5], "bad": {}, "on_error": "skip"}
    hung = (5, "index://5", "timed out: still decoding")
    assert watchdog.retry_or_fail(skipping, None, hung, -9) is None and skipping["bad"] == {5: hung[2]}
    assert Watchdog(WATCHDOG).retry_or_fail({"indices": [6], "bad": {}}, None, (6, "p", "hung"), -9).error == "hung"

    early = {"indices": [7], "bad": {}}
    assert all(watchdog.retry_or_fail(early, None, None, 1) is None for _ in range(retries))
    assert watchdog.retry_or_fail(early, None, None, 1).error_kind == ErrorKind.INTERNAL
