"""Tier-2 tests' shared parts: a skewed dataset (rank 0's shard heavy, rank 1's light) and ranks
stepping together, each loader on its own thread, as the gradients' all_reduce makes them."""

import threading

from dataplane import CFG

import helix_core as hx
from helix_core.testing.datasets import CostedDataset

HEAVY, LIGHT = 1000, 10


def skewed(n=16):
    """Rank 0's shard (even indices, no shuffle) is all heavy, rank 1's all light."""
    return CostedDataset(n, tokens=[HEAVY if i % 2 == 0 else LIGHT for i in range(n)], shape=(8,))


def run_ranks(cluster, ds, world, rebalance, epochs=1, ranks=None, after=None, **kw):
    """Each rank's loader in its own thread, stepping together; returns ({rank: [batch]}, {rank: stats})."""
    got, stats, errors = {}, {}, []
    ranks = list(ranks if ranks is not None else range(world))
    step = threading.Barrier(len(ranks))  # what the gradients' all_reduce does to ranks: they step together
    rebalance = {"round_timeout_s": 5.0, **rebalance}

    def rank_main(rank):
        try:
            with hx.DistributedDataLoader(
                ds,
                batch_size=2,
                rank=rank,
                world_size=world,
                coordinator=cluster.address,
                token=cluster.token,
                config=CFG,
                rebalance=rebalance,
                gpu_cost=lambda t: t,
                **kw,
            ) as ld:
                out = []
                for epoch in range(epochs):
                    ld.set_epoch(epoch)
                    for b in ld:
                        out.append((epoch, b))
                        if after is not None and rank == ranks[0]:
                            after(len(out))  # fault injection, between two steps
                        step.wait(60)
                got[rank], stats[rank] = out, ld.stats()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return got, stats
