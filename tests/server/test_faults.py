"""Faults with real processes: SIGKILLed DataServers and workers, a lost Coordinator, and no
process or shared-memory segment outliving close, a crash or Ctrl-C."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from dataplane import CFG, assert_same_batches, children, helix_children, segments, torch_batches, wait_for

import helix_core as hx
from helix_core.memory import shm
from helix_core.testing.datasets import IndexDataset


def test_sigkill_dataservers_mid_epoch_loses_nothing():
    ds = IndexDataset(60, shape=(64,), delays={i: 0.04 for i in range(60)})
    with hx.LocalCluster(local_servers=2, remote_servers=1, workers_per_server=1, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, prefetch_depth=6, config=CFG
        ) as ld:
            got = []
            for i, b in enumerate(ld):
                got.append(b)
                if i == 4:
                    cluster.kill_server(0)  # rank 0's own delivery server
                if i == 12:
                    cluster.kill_server(2)  # the remote sidecar
            assert_same_batches(got, torch_batches(ds, 2, 0, 1))  # exactly the sampler's sequence, in order
            assert ld.stats()["resubmits"] >= 1
            tele = ld.client.telemetry(last_decisions=20)
        assert {d["delivery"] for d in tele["decisions"][-5:]} == {cluster.servers[1].server_id}


def test_sigkill_worker_mid_epoch_loses_nothing():
    ds = IndexDataset(40, shape=(64,), delays={i: 0.05 for i in range(40)})
    with hx.LocalCluster(local_servers=1, workers_per_server=2, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, prefetch_depth=4, config=CFG
        ) as ld:
            got, killed = [], []
            for i, b in enumerate(ld):
                got.append(b)
                if i in (3, 9):
                    pid = cluster.worker_pids(0)[0]
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            assert_same_batches(got, torch_batches(ds, 2, 0, 1))
        assert not set(killed) & set(cluster.worker_pids(0))  # replaced by new workers


def test_sample_that_keeps_killing_workers_becomes_a_sample_error():
    ds = IndexDataset(8, crash={5: "exit"})
    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, config=CFG
        ) as ld:
            it = iter(ld)
            assert [next(it)["index"].tolist() for _ in range(2)] == [[0, 1], [2, 3]]
            with pytest.raises(hx.SampleError, match="worker process died") as err:
                next(it)
            assert err.value.index == 5 and err.value.path == "index://5"
            assert next(it)["index"].tolist() == [6, 7]
        with hx.DistributedDataLoader(
            ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, config=CFG, on_error="skip"
        ) as ld:
            batches = [b["index"].tolist() for b in ld]
            assert [len(b) for b in batches] == [2, 2, 2, 2] and 5 not in batches[2]
            assert ld.stats()["skipped"] == 1


def test_without_coordinator_and_servers_a_loader_raises_cluster_error_not_a_hang():
    ds = IndexDataset(400, delays={i: 0.01 for i in range(400)})
    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, config=CFG
        ) as ld:
            it = iter(ld)
            next(it)
            cluster.kill_coordinator()  # the data keeps flowing through the server the client knows ...
            next(it)
            cluster.kill_server(0)  # ... until that one is gone too
            t0 = time.monotonic()
            with pytest.raises(hx.ClusterError, match="Coordinator .* unreachable"):
                for _ in it:
                    pass
            assert time.monotonic() - t0 < CFG.coordinator_timeout_s + 10


def test_closing_a_loader_whose_coordinator_is_gone_does_not_wait_out_the_retries():
    import threading

    from helix_core.loader.cluster_client import ClusterClient
    from helix_core.loader.waits import Stop
    from helix_core.wire.messages import Part

    cfg = hx.ClusterConfig.for_tests(coordinator_timeout_s=60.0)  # retries would go on for a minute
    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=cfg) as cluster:
        client = ClusterClient(cluster.address, None, cfg, 0, 1)
        cluster.kill_coordinator()
        stop, trying, got = Stop(), threading.Event(), []

        def route():
            trying.set()
            try:
                client.route(Part(1, [0]), stop=stop)
            except hx.ClusterError as e:
                got.append(e)

        t = threading.Thread(target=route)
        t.start()
        trying.wait(5)
        stop.set()  # what closing the loader does: the sender's wait between tries ends at once
        t.join(cfg.rpc_timeout_s + 5)  # at most the try in flight, never the minute of retries
        assert not t.is_alive() and "stopped" in str(got[0])
        client.close()


def test_close_leaves_no_process_and_no_segment():
    before = {p.pid for p in children()}
    ds = IndexDataset(20, shape=(1 << 14,))
    cluster = hx.LocalCluster(local_servers=2, remote_servers=1, workers_per_server=1, config=CFG)
    with hx.DistributedDataLoader(
        ds, batch_size=4, rank=0, world_size=1, coordinator=cluster.address, config=CFG
    ) as ld:
        kept = list(ld)
    assert segments(cluster)
    cluster.close()
    assert not segments(cluster)
    assert {p.pid for p in children()} <= before
    assert len(kept) == 5 and kept[0]["x"].shape == (4, 1 << 14)  # kept batches stay readable after close


_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import helix_core as hx
    from helix_core.testing.datasets import IndexDataset
    cfg = hx.ClusterConfig.for_tests()
    ds = IndexDataset(1000, shape=(1 << 14,), delays={i: 0.01 for i in range(1000)})
    loader = hx.DistributedDataLoader(ds, batch_size=4, rank=0, world_size=1, config=cfg)  # embedded cluster
    print("CLUSTER", loader.cluster_id, flush=True)
    it = iter(loader)
    for _ in range(3):
        next(it)
    print("RUNNING", flush=True)
    if sys.argv[1] == "crash":
        sys.stdin.readline()  # the test has seen the cluster's processes
        os.kill(os.getpid(), signal.SIGKILL)
    for b in it:  # until Ctrl-C
        pass
""")


@pytest.mark.parametrize("how", ["crash", "ctrl-c"])
def test_training_process_crash_or_ctrl_c_leaves_nothing(tmp_path, how):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        cluster_id = proc.stdout.readline().split()[1]
        assert proc.stdout.readline().strip() == "RUNNING"
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) >= 3  # coordinator, dataserver, worker
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        else:
            proc.stdin.write("crash now\n")
            proc.stdin.flush()
        proc.wait(timeout=60)
        wait_for(
            lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in descendants),
            30,
            "every process of the cluster to exit",
        )
        wait_for(lambda: not shm.list_segments(f"helix-{cluster_id}-"), 15, "every segment to be unlinked")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_loader_dropped_without_close_stops_its_embedded_cluster(monkeypatch):
    monkeypatch.delenv("HELIX_COORDINATOR", raising=False)
    ds = IndexDataset(40, shape=(1 << 13,), delays={i: 0.01 for i in range(40)})
    before = {p.pid for p in helix_children()}
    ld = hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, num_workers=1, config=CFG)
    prefix = f"helix-{ld.cluster_id}-"
    for i, _batch in enumerate(ld):  # requests still in flight when the loader goes
        if i == 2:
            break
    gone = lambda: not shm.list_segments(prefix) and not [p for p in helix_children() if p.pid not in before]
    gc.disable()  # as a torch DataLoader may simply be dropped: no reference cycle may keep it alive
    try:
        del ld, _batch
        deadline = time.monotonic() + 20
        while not gone() and time.monotonic() < deadline:  # a condition with a deadline (no collection may run)
            time.sleep(0.05)
    finally:
        gc.enable()
    assert gone(), "the embedded cluster's processes and segments outlived the dropped loader"
