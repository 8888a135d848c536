"""A DataServer that reads clips by URL measures what its storage costs and tells the
Coordinator, whose view of it (and so placement's ``C_io``) gains a storage bandwidth."""

import json

import pytest
from dataplane import CFG, wait_for

import helix_core as hx
from helix_core.data.media.synth import make_dataset
from helix_core.launch.cluster_cli import _storage
from helix_core.testing.objectstore import RangeHTTPServer

DELAY_S = 0.02  # each answer of the clips' server waits this long: a store behind a slow link


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("http-clips"), "kinetics-mixed", num_clips=8, scale=0.25)


def test_the_coordinator_learns_each_servers_storage_bandwidth_from_its_reads(clips):
    rels = [json.loads(line)["path"] for line in (clips / "manifest.jsonl").read_text().splitlines()]
    sizes = [(clips / r).stat().st_size for r in rels]
    with RangeHTTPServer(clips) as http:
        for r in rels:
            http.slow(r, DELAY_S)
        ds = hx.VideoClipDataset(http.url("manifest.jsonl"), model="videomae", num_frames=4, size=32)
        with hx.LocalCluster(local_servers=1, remote_servers=1, workers_per_server=1, config=CFG) as cluster:
            with hx.DistributedDataLoader(
                ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, config=CFG
            ) as ld:
                assert len(list(ld)) == 4
                assert sum(http.served[f"/{r}"] for r in rels) > 0  # the clips were read over HTTP

                def measured():
                    servers = ld.client.telemetry()["servers"]
                    worked = [s for s in servers if s["completed"] > 0]
                    return worked if worked and all(s["storage_bandwidth_bps"] > 0 for s in worked) else None

                worked = wait_for(measured, 10.0, "the servers' storage figures in the Coordinator's view")
    mean = sum(sizes) / len(sizes)
    for s in worked:
        assert s["storage_latency_s"] >= 0.0
        # every sample waited at least two delayed answers (the object's stat, then its bytes):
        # the figures must say an average clip costs about that, not what loopback alone would
        assert mean / s["storage_bandwidth_bps"] + s["storage_latency_s"] >= 1.5 * DELAY_S
        assert _storage(s) != "-"  # `helix status` shows it
    assert _storage({"storage_bandwidth_bps": 0.0}) == "-"
