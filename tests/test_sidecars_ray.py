"""Sidecars on Ray: remote DataServers as Ray actors on a real Ray cluster (a head and a worker
node, on loopback) join a Helix cluster, serve its ranks, come back after their actor is killed,
and leave nothing behind."""
import subprocess
import sys
import time

import pytest
from dataplane import CFG, helix_children, torch_batches, wait_for

import helix_core as hx
from helix_core.errors import ClusterError
from helix_core.testing import IndexDataset

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'helix[bench]')")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _indices(batches):
    return [b["index"].tolist() for b in batches]


def test_ray_sidecars_register_serve_restart_after_a_kill_and_close_completely(ray_cluster):
    with hx.LocalCluster(local_servers=1, workers_per_server=1, token=True, config=CFG) as cluster:
        sidecars = hx.ray_sidecars(cluster.address, count=2, workers=1, token=cluster.token, config=CFG,
                                   host="127.0.0.1")
        try:
            first = sidecars.describe()
            assert len({s["server_id"] for s in first}) == 2 and all(s["alive"] for s in first)
            ds = IndexDataset(40, delays={i: 0.05 for i in range(40)})
            with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address,
                                          token=cluster.token, scheduler="least-request", config=CFG) as loader:
                got = []
                for batch in loader:
                    got.append(batch)
                    if len(got) == 5:  # mid-epoch: SIGKILL one sidecar's actor (Ray restarts it)
                        ray.kill(sidecars.actors[0], no_restart=False)
                assert _indices(got) == _indices(torch_batches(ds, 2, 0, 1))  # exactly once
                assert loader.stats()["cross_ds_bytes"] > 0  # sidecars streamed batches to the rank's server
            # the killed actor came back with a new DataServer, registered under a new id
            wait_for(lambda: _restarted(sidecars, first), 60, "the killed sidecar to be restarted by Ray")
        finally:
            sidecars.close()
        pids = [s["pid"] for s in first] + [s["actor_pid"] for s in first]
        wait_for(lambda: not any(_alive(p) for p in pids), 30, "the sidecars' processes to exit after close()")


def _restarted(sidecars, first) -> bool:
    try:
        now = sidecars.describe()
    except Exception:  # noqa: BLE001 - the actor is still restarting
        return False
    return now[0]["server_id"] != first[0]["server_id"] and now[0]["alive"] and now[1] == first[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_ray_sidecars_bad_input_is_named_and_leaves_nothing_running(ray_cluster):
    before = helix_children()
    with pytest.raises(ValueError, match="--count"):
        hx.ray_sidecars("127.0.0.1:1", count=0, workers=1)
    with pytest.raises(ValueError, match="--workers"):
        hx.ray_sidecars("127.0.0.1:1", count=1, workers=0)
    # a Coordinator that does not answer: the sidecar's DataServer fails; the actor is ended
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="failed to start"):
        hx.ray_sidecars("127.0.0.1:1", count=1, workers=1, config=CFG, host="127.0.0.1", max_restarts=0)
    assert time.monotonic() - t0 < 60
    assert helix_children() == before


def test_helix_sidecars_command_names_a_ray_address_that_does_not_answer():
    done = subprocess.run([sys.executable, "-m", "helix_core.cli", "sidecars", "--ray", "127.0.0.1:9",
                           "--coordinator", "127.0.0.1:1", "--count", "1", "--workers", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--ray 127.0.0.1:9" in done.stdout + done.stderr, done.stdout + done.stderr
