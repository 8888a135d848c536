"""Ray sidecars on a real Ray cluster (a head and a worker node, ray.cluster_utils) for
tests/launch/test_sidecars_ray.py, in a process of its own (Ray reads its auth settings at import, and
keeps global state). Prints one JSON line of what it saw."""

import json
import os
import secrets
import sys
import time

os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))  # before Ray is imported

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataplane import CFG, torch_batches  # noqa: E402

import helix_core as hx  # noqa: E402
from helix_core.errors import ClusterError  # noqa: E402
from helix_core.loader.cluster_client import ClusterClient  # noqa: E402
from helix_core.testing.datasets import IndexDataset  # noqa: E402


def indices(batches):
    return [b["index"].tolist() for b in batches]


def restarted(sidecars, first):
    try:
        now = sidecars.describe()
    except Exception:  # noqa: BLE001 - still restarting
        return None
    if (
        now[0]["server_id"] != first[0]["server_id"]
        and now[0]["alive"]
        and now[1]["server_id"] == first[1]["server_id"]
    ):
        return now
    return None


def _answers(actor) -> bool:
    try:
        ray.get(actor.describe.remote(), timeout=10)
        return True
    except Exception:  # noqa: BLE001 - RayActorError: the actor is gone (and stays gone)
        return False


def main() -> dict:
    out = {}
    ray_cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    ray_cluster.add_node(num_cpus=2)
    ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
    out["ray_nodes"] = len([n for n in ray.nodes() if n["Alive"]])
    try:
        with hx.LocalCluster(local_servers=1, workers_per_server=1, token=True, config=CFG) as cluster:
            # no host=: a loopback Coordinator's sidecars listen on loopback (and need no TLS)
            sidecars = hx.ray_sidecars(cluster.address, count=2, workers=1, token=cluster.token, config=CFG)
            try:
                first = sidecars.describe()
                out["first"] = first
                ds = IndexDataset(40, delays={i: 0.05 for i in range(40)})
                with hx.DistributedDataLoader(
                    ds,
                    batch_size=2,
                    rank=0,
                    world_size=1,
                    coordinator=cluster.address,
                    token=cluster.token,
                    scheduler="least-request",
                    config=CFG,
                ) as loader:
                    got = []
                    for batch in loader:
                        got.append(batch)
                        if len(got) == 5:  # mid-epoch: kill one sidecar's actor; Ray restarts it
                            ray.kill(sidecars.actors[0], no_restart=False)
                    out["exact"] = indices(got) == indices(torch_batches(ds, 2, 0, 1))
                    out["cross_ds_bytes"] = loader.stats()["cross_ds_bytes"]
                    out["resubmits"] = loader.stats()["resubmits"]
                deadline, now = time.monotonic() + 60, None
                while now is None and time.monotonic() < deadline:
                    now = restarted(sidecars, first)
                    time.sleep(0.5)
                out["after"] = now
                # the Coordinator lists the restarted sidecar's new DataServer as a live sidecar
                deadline, alive = time.monotonic() + 30, []
                while now is not None and now[0]["server_id"] not in alive and time.monotonic() < deadline:
                    probe = ClusterClient(cluster.address, cluster.token, CFG, 0, 1)
                    alive = [
                        s["server_id"] for s in probe.telemetry()["servers"] if s["kind"] == "remote" and s["alive"]
                    ]
                    probe.close()
                    time.sleep(0.2)
                out["registered"] = alive
            finally:
                sidecars.close()
            time.sleep(2)
            out["actors_left"] = [a for a in range(len(sidecars.actors)) if _answers(sidecars.actors[a])]
        t0 = time.monotonic()
        try:
            hx.ray_sidecars("127.0.0.1:1", count=1, workers=1, config=CFG, host="127.0.0.1", max_restarts=0)
            out["unreachable"] = "started"
        except ClusterError as e:
            out["unreachable"] = str(e)
        out["unreachable_s"] = time.monotonic() - t0
    finally:
        ray.shutdown()
        ray_cluster.shutdown()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
