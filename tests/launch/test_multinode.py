"""One cluster per job across nodes: ``torchrun --nnodes 2`` on two emulated hosts (own address,
/dev/shm and hostname each), no coordinator given — Lightning's ``HelixDataModule`` and the
Accelerate plugin. Global rank 0 starts the Coordinator, each node's local rank 0 its node's
DataServers; every rank finds the cluster's address in the job's store (sealed with the job's
secret, from which every rank derives the token and the job's own CA)."""

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helix_core.testing.datasets import IndexDataset
from helix_core.testing.emulated_hosts import EmulatedHosts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(EmulatedHosts.unavailable() is not None, reason=str(EmulatedHosts.unavailable())),
]

APP = Path(__file__).resolve().parents[1] / "apps" / "multinode_app.py"
ROOT = Path(__file__).resolve().parents[2]
N, BATCH = 40, 2


@pytest.fixture(scope="module")
def hosts():
    with EmulatedHosts(["a", "b"]) as h:
        yield h


def _torchrun(hosts: EmulatedHosts, mode: str, out: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELIX_")}
    env.update(PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="eth0")  # gloo: the bridge, not loopback
    env["HELIX_JOB_SECRET"] = secrets.token_urlsafe(32)  # the job's secret, out of band like MASTER_ADDR
    procs = []
    for node, host in enumerate(("a", "b")):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            hosts.address("a"),
            "--master-port",
            "29511",
            str(APP),
            mode,
            str(out),
            str(N),
            str(BATCH),
        ]
        procs.append(
            hosts.popen(
                host, argv, env=env, cwd=str(out.parent), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=400)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("torchrun did not finish within 400 s")
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _sampler(rank: int) -> list[list[int]]:
    sampler = torch.utils.data.DistributedSampler(IndexDataset(N), num_replicas=4, rank=rank, shuffle=True, seed=7)
    sampler.set_epoch(0)
    order = list(sampler)
    return [order[i : i + BATCH] for i in range(0, len(order), BATCH)]


@pytest.mark.parametrize("mode", ["lightning", "accelerate"])
def test_torchrun_on_two_nodes_forms_one_cluster_and_every_rank_trains_the_sampler_batches(hosts, tmp_path, mode):
    ranks = _torchrun(hosts, mode, tmp_path / "out")
    assert [r["world_size"] for r in ranks] == [4] * 4
    assert len({r["coordinator"] for r in ranks}) == 1  # one cluster for the job ...
    assert ranks[0]["coordinator"].startswith(hosts.address("a") + ":")  # ... on the master's address
    assert ranks[0]["host"] == ranks[1]["host"] != ranks[2]["host"] == ranks[3]["host"]
    # global rank 0 started the Coordinator and node a's servers, local rank 0 of node b its node's
    assert [r["owner"] for r in ranks] == [True, False, True, False]
    for rank, got in enumerate(ranks):
        assert got["seen"] == _sampler(rank), rank
