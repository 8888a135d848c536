"""Running Helix as a user does: `helix coordinator` / `helix dataserver` as separate services, the
embedded cluster of a one-line loader, and torchrun ranks sharing one embedded cluster."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from dataplane import CFG, assert_same_batches, helix_children, torch_batches

import helix_core as hx
from helix_core.testing.datasets import IndexDataset


def _start(args, env=None):
    proc = subprocess.Popen(
        [sys.executable, "-m", "helix_core.launch.cli", *args, "--config-json", json.dumps(CFG.to_dict())],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    assert line.startswith("HELIX_READY "), line
    return proc, json.loads(line.split(" ", 1)[1])


def test_standalone_coordinator_and_dataserver(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("standalone-token\n")
    token_file.chmod(0o600)  # a token file others may read is refused
    coord, info = _start(["coordinator", "--port", "0", "--token-file", str(token_file)])
    server = None
    try:
        server, sinfo = _start(
            [
                "dataserver",
                "--coordinator",
                info["address"],
                "--local-rank",
                "0",
                "--workers",
                "1",
                "--token-file",
                str(token_file),
            ]
        )
        ds = IndexDataset(10)
        with hx.DistributedDataLoader(
            ds, batch_size=3, rank=0, world_size=1, coordinator=info["address"], token="standalone-token", config=CFG
        ) as ld:
            assert_same_batches(list(ld), torch_batches(ds, 3, 0, 1))
    finally:
        for p in (server, coord):
            if p is not None:
                p.send_signal(signal.SIGTERM)
        for p in (server, coord):
            if p is not None:
                assert p.wait(timeout=20) == 0


def test_embedded_cluster_one_line_loader(monkeypatch):
    monkeypatch.delenv("HELIX_COORDINATOR", raising=False)
    ds = IndexDataset(9)
    with hx.DistributedDataLoader(ds, batch_size=4, rank=0, world_size=1, num_workers=1, config=CFG) as ld:
        cluster = ld.cluster
        assert cluster is not None and cluster.token  # an embedded cluster makes its own token
        assert_same_batches(list(ld), torch_batches(ds, 4, 0, 1))
        # the decoding workers yield a core to the ranks and the services; those keep the user's niceness
        base, services = os.nice(0), helix_children()
        workers = [w for s in services for w in s.children() if "resource_tracker" not in " ".join(w.cmdline())]
        assert len(services) == 2 and len(workers) == 1
        assert [s.nice() for s in services] == [base, base]
        assert workers[0].nice() == min(19, base + CFG.worker_nice) > base
    assert all(not s.alive for s in cluster.servers)


_RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import helix_core as hx
    from helix_core.testing.datasets import IndexDataset
    ds = IndexDataset(22)
    kw = dict(batch_size=3, shuffle=True, seed=5, num_workers=2, config=hx.ClusterConfig.for_tests())
    ld = hx.DistributedDataLoader(ds, **kw)  # rank / world size from torchrun
    got = [b["index"].tolist() for b in ld]
    owner = ld.cluster is not None
    ld.close()  # local rank 0's last loader: the cluster it shares must stay up for the other ranks
    dist.init_process_group("gloo")
    dist.barrier()
    with hx.DistributedDataLoader(ds, **kw) as again:  # after rank 0 closed: the same cluster, still serving
        second = [b["index"].tolist() for b in again]
    sampler = torch.utils.data.DistributedSampler(ds, int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]),
                                                  shuffle=True, seed=5)
    want = [b["index"].tolist() for b in torch.utils.data.DataLoader(ds, batch_size=3, sampler=sampler)]
    result = {"rank": ld.rank, "ok": got == want and second == want, "owner": owner}
    with open(f"result-{ld.rank}.json", "w") as f:  # a file, not stdout: torchrun may redirect the ranks' streams
        json.dump(result, f)
    dist.barrier()  # the owner's process outlives the other ranks' use of its cluster
""")


@pytest.mark.timeout(240)
def test_torchrun_local_rank_zero_starts_and_shares_the_cluster(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("HELIX_COORDINATOR", "HELIX_TOKEN")}
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # this interpreter's torchrun, whatever PATH says
    r = subprocess.run(
        [*torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
        cwd=tmp_path,
    )
    output = r.stdout[-2000:] + r.stderr[-4000:]
    assert r.returncode == 0, output
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result-*.json"))]
    assert sorted(x["rank"] for x in results) == [0, 1] and all(x["ok"] for x in results), (results, output)
    assert [x["owner"] for x in sorted(results, key=lambda x: x["rank"])] == [True, False]
