"""``python -m helix_bench.micro.sigstop [--no-bulk]``: a DataServer SIGSTOPped mid-epoch under the
*default* ``ClusterConfig`` (heartbeat timeout 5 s, keepalive 2 + 3 s) — how long the rank waits
for its worst batch, and that the epoch is still exactly the sampler's. Once for the rank's own
delivery server, once for the remote sidecar. (``tests/server/test_liveness.py`` asserts the same with
the tests' short timings; this prints what a user with default settings sees.)"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch


def run(bulk: bool = True) -> list[dict]:
    import helix_core as hx
    from helix_core.testing.datasets import IndexDataset

    cfg = hx.ClusterConfig(bulk_delivery=bulk)
    ds = IndexDataset(48, shape=(64,), delays={i: 0.04 for i in range(48)})
    expected = [
        torch.utils.data.default_collate([ds[i] for i in range(k, k + 2)])["index"].tolist() for k in range(0, 48, 2)
    ]
    rows = []
    for victim in (0, 2):  # the rank's delivery server; the remote sidecar
        with hx.LocalCluster(local_servers=2, remote_servers=1, workers_per_server=1, config=cfg) as cluster:
            pid = None
            try:
                with hx.DistributedDataLoader(
                    ds,
                    batch_size=2,
                    rank=0,
                    world_size=1,
                    coordinator=cluster.address,
                    prefetch_depth=6,
                    config=cfg,
                    scheduler="least-request",
                ) as ld:
                    got, gaps, t0 = [], [], time.monotonic()
                    t = t0
                    for i, b in enumerate(ld):
                        now = time.monotonic()
                        gaps.append(now - t)
                        got.append(b["index"].tolist())
                        if i == 4:
                            pid = cluster.servers[victim].pid
                            os.kill(pid, signal.SIGSTOP)
                        t = time.monotonic()
                    rows.append(
                        {
                            "stopped": cluster.servers[victim].kind,
                            "epoch_s": time.monotonic() - t0,
                            "longest_wait_s": max(gaps),
                            "resubmits": ld.stats()["resubmits"],
                            "exact": got == expected,
                        }
                    )
            finally:
                if pid:
                    os.kill(pid, signal.SIGCONT)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m helix_bench.micro.sigstop", description=__doc__)
    p.add_argument("--no-bulk", action="store_true", help="remote batches by gRPC's Deliver (bulk_delivery=False)")
    a = p.parse_args(argv)
    for r in run(bulk=not a.no_bulk):
        print(
            f"{r['stopped']} server SIGSTOPped: epoch {r['epoch_s']:.1f} s, longest wait {r['longest_wait_s']:.1f} s, "
            f"{r['resubmits']} resubmits, exactly the sampler's batches: {'yes' if r['exact'] else 'NO'}"
        )


if __name__ == "__main__":
    main()
