"""Tier 2 on real processes: ranks of one host trade decoded samples of the same global step
through their group's leader DataServer (slabs handed over, no bytes between servers), keep their
batch sizes and every epoch's samples exactly once; a rank alone, or a policy that fails, keeps
its batches; nothing is left in shared memory."""

import threading
import time
from collections import Counter

import pytest
import torch
from dataplane import CFG, busy_segments, torch_batches, wait_for
from tier2run import HEAVY, LIGHT, run_ranks, skewed

import helix_core as hx
from helix_core.testing.datasets import IndexDataset


@pytest.fixture(scope="module")
def cluster():
    with hx.LocalCluster(local_servers=2, workers_per_server=1, config=CFG, token=True) as c:
        yield c


def test_ranks_trade_samples_of_a_step_and_keep_batch_sizes_and_every_sample_once(cluster):
    ds = skewed(16)
    reference = IndexDataset(16, shape=(8,))
    got, stats = run_ranks(cluster, ds, 2, {"args": {"seconds_per_unit": 1.0}}, epochs=2)
    for epoch in range(2):
        want = {r: torch_batches(ds, 2, r, 2, epoch=epoch) for r in range(2)}
        mine = {r: [b for e, b in got[r] if e == epoch] for r in range(2)}
        assert [len(mine[r]) for r in range(2)] == [len(want[r]) for r in range(2)]
        seen = Counter()
        for step in range(len(want[0])):
            planned = sorted(i for r in range(2) for i in want[r][step]["index"].tolist())
            traded = sorted(i for r in range(2) for i in mine[r][step]["index"].tolist())
            assert traded == planned  # samples move only within their global step
            for r in range(2):
                b = mine[r][step]
                assert len(b["index"]) == 2  # every rank keeps its batch size
                for row, i in enumerate(b["index"].tolist()):  # each row came with its own tensors
                    assert torch.equal(b["x"][row], reference[i]["x"]) and int(b["tokens"][row]) == ds.tokens[i]
                # the default policy balanced the measured cost: one heavy and one light sample each
                assert sorted(b["tokens"].tolist()) == [LIGHT, HEAVY]
            seen.update(traded)
        assert seen == Counter(range(16))  # the epoch: every sample exactly once
    for r in range(2):
        t2 = stats[r]["rebalance"]
        assert t2["moved"] == 8 and t2["moved_in"] == t2["moved_out"] == 8, t2
        assert not stats[r]["rebalance_errors"]
    wait_for(lambda: not busy_segments(cluster), what="every slab released (shared ones counted down)")


def test_a_rank_alone_keeps_its_batches_after_the_round_timeout(cluster):
    ds = skewed(8)
    got, stats = run_ranks(cluster, ds, 2, {"round_timeout_s": 0.05, "args": {"seconds_per_unit": 1.0}}, ranks=[0])
    assert [b["index"].tolist() for _, b in got[0]] == [b["index"].tolist() for b in torch_batches(ds, 2, 0, 2)]
    assert stats[0]["rebalance"].get("alone") == 2 and not stats[0]["rebalance"].get("moved_in")
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_rank_waiting_for_a_batch_held_in_its_round_gets_it_after_the_grace_not_at_its_deadline(cluster):
    """Rank 0 trains alone (rank 1 never comes) and reports 20 s GPU windows, so a batch landing
    while it computes may wait in its round until just before it is needed, ~20 s. But the rank
    asks for it sooner: once it waits in ``next()``, the round closes after ``round_timeout_s``
    ("asked"). Were it held to its deadline, ``next()`` would give up after the loader's batch
    deadline (10 s + 2 RPC timeouts here) with an error."""
    ds = skewed(16)
    cfg = hx.ClusterConfig.for_tests(execute_timeout_s=10.0, sample_timeout_s=5.0)
    with hx.DistributedDataLoader(
        ds,
        batch_size=2,
        rank=0,
        world_size=2,
        coordinator=cluster.address,
        token=cluster.token,
        config=cfg,
        gpu_cost=lambda t: t,
        prefetch_depth=1,
        rebalance={"round_timeout_s": 0.2, "max_wait_s": 60.0, "args": {"seconds_per_unit": 1.0}},
    ) as ld:
        got = []
        for b in ld:
            got.append(b["index"].tolist())
            ld.report_step_time(20.0)  # what the trainer measured: its deadlines look 20 s off ...
            time.sleep(0.3)  # ... while the next batch lands and goes to its round
        closed_by = [r["closed_by"] for r in ld.stats()["rebalance_rounds"]]
    assert got == [b["index"].tolist() for b in torch_batches(ds, 2, 0, 2)]
    assert "asked" in closed_by and set(closed_by) <= {"asked", "timeout"}, closed_by
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_policy_that_breaks_the_rules_is_named_and_the_batches_stay(cluster):
    ds = skewed(8)
    got, stats = run_ranks(cluster, ds, 2, {"sort_fn": lambda features, args: [0] * len(features)})
    for r in range(2):
        assert [b["index"].tolist() for _, b in got[r]] == [b["index"].tolist() for b in torch_batches(ds, 2, r, 2)]
        errors = stats[r]["rebalance_errors"]
        assert errors and "would get 4 samples, not its batch's 2" in errors[0], errors
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_user_feature_fn_and_sort_fn_decide_the_round(cluster):
    ds = skewed(8)

    def swap_all(features, args):  # move every sample to the other rank of its step
        assert all(set(f) >= {"heavy", "rank", "step"} for f in features)
        return [1 - f["rank"] for f in features]

    got, stats = run_ranks(
        cluster, ds, 2, {"feature_fn": lambda s: {"heavy": int(s["tokens"]) > 100}, "sort_fn": swap_all}
    )
    for r in range(2):
        want = torch_batches(ds, 2, 1 - r, 2)
        assert [sorted(b["index"].tolist()) for _, b in got[r]] == [sorted(b["index"].tolist()) for b in want]
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_rebalance_with_a_collate_whose_rows_cannot_be_told_apart_is_refused_up_front(cluster):
    with pytest.raises(ValueError, match="rebalance= needs collate_fn=None"):
        hx.DistributedDataLoader(
            skewed(8),
            batch_size=2,
            rank=0,
            world_size=2,
            coordinator=cluster.address,
            token=cluster.token,
            config=CFG,
            rebalance={},
            collate_fn=lambda s: s,
        )
    with pytest.raises(ValueError, match="unknown key"):
        hx.DistributedDataLoader(
            skewed(8),
            batch_size=2,
            rank=0,
            world_size=2,
            coordinator=cluster.address,
            token=cluster.token,
            config=CFG,
            rebalance={"buffer": 3},
        )


def test_a_policy_that_cannot_travel_without_pickles_is_refused_naming_it():
    from helix_core.tier2.rank import policy_spec

    local = lambda features, args: [f["rank"] for f in features]  # noqa: E731 - not importable by name
    with pytest.raises(ValueError, match="sort_fn .*a lambda.*takes no cloudpickle"):
        policy_spec(hx.Rebalance(sort_fn=local), pickle_allowed=False)
    pid, payload, fmt = policy_spec(hx.Rebalance(args={"margin": 0.3}), pickle_allowed=False)
    assert fmt == "json" and b"margin" in payload
    assert policy_spec(hx.Rebalance(sort_fn=local), pickle_allowed=True)[2] == "cloudpickle"


def test_a_run_resumed_mid_epoch_loses_and_repeats_nothing(cluster):
    """Both ranks stop after 2 steps, save, and new loaders resume: the rounds of the steps left are
    planned again, and the epoch's steps still hold exactly the planned samples."""
    ds = skewed(16)
    opts = dict(
        batch_size=2,
        world_size=2,
        coordinator=cluster.address,
        token=cluster.token,
        config=CFG,
        rebalance={"round_timeout_s": 5.0, "args": {"seconds_per_unit": 1.0}},
        gpu_cost=lambda t: t,
    )
    states, first, rest, errors = {}, {}, {}, []
    step = threading.Barrier(2)

    def rank_main(rank):
        try:
            with hx.DistributedDataLoader(ds, rank=rank, **opts) as ld:
                it = iter(ld)
                first[rank] = [next(it) for _ in range(2) if step.wait(60) is not None]
                states[rank] = ld.state_dict()
            with hx.DistributedDataLoader(ds, rank=rank, **opts) as ld:
                ld.load_state_dict(states[rank])
                rest[rank] = []
                for b in ld:
                    rest[rank].append(b)
                    step.wait(60)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    got = {r: first[r] + rest[r] for r in range(2)}
    want = {r: torch_batches(ds, 2, r, 2) for r in range(2)}
    assert [len(got[r]) for r in range(2)] == [4, 4]
    for k in range(4):
        assert sorted(i for r in range(2) for i in got[r][k]["index"].tolist()) == sorted(
            i for r in range(2) for i in want[r][k]["index"].tolist()
        )
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_resumed_rank_never_trades_with_a_rank_still_on_the_run_before(cluster):
    """Rank 1 stops and resumes while rank 0's old loader still holds its next step in a round:
    the resumed rank waits for rank 0's resumed loader (rounds never mix runs), the old loader's
    batch leaves the round when it closes, and the steps still hold exactly the planned samples."""
    ds = skewed(16)
    opts = dict(
        batch_size=2,
        world_size=2,
        coordinator=cluster.address,
        token=cluster.token,
        config=CFG,
        rebalance={"round_timeout_s": 5.0, "args": {"seconds_per_unit": 1.0}},
        gpu_cost=lambda t: t,
        prefetch_depth=1,
    )
    states, first, rest, errors = {}, {}, {}, []
    step, resumed = threading.Barrier(2), threading.Event()

    def rank_main(rank):
        try:
            old = hx.DistributedDataLoader(ds, rank=rank, **opts)
            it = iter(old)
            first[rank] = [next(it) for _ in range(2) if step.wait(60) is not None]
            states[rank] = old.state_dict()
            if rank == 1:
                old.close()  # at once: its next step never reaches a round
            else:
                resumed.wait(60)
                time.sleep(0.5)  # the hazard's window: rank 1's resumed loader sends its step meanwhile
                old.close()  # its next step has waited in a round all this time
            with hx.DistributedDataLoader(ds, rank=rank, **opts) as ld:
                ld.load_state_dict(states[rank])
                rest[rank] = []
                batches = iter(ld)
                resumed.set()
                for b in batches:
                    rest[rank].append(b)
                    step.wait(60)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    got = {r: first[r] + rest[r] for r in range(2)}
    want = {r: torch_batches(ds, 2, r, 2) for r in range(2)}
    assert [len(got[r]) for r in range(2)] == [4, 4]
    for k in range(4):
        assert sorted(i for r in range(2) for i in got[r][k]["index"].tolist()) == sorted(
            i for r in range(2) for i in want[r][k]["index"].tolist()
        )
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_dataserver_on_loopback_never_loads_torch_tier_2_or_not():
    """A DataServer relays slabs as bytes: one that listens on loopback (no other host can reach it,
    so no Tier-2 row crosses hosts through it) never loads torch — seconds of CPU and ~180 MB less
    per server. One that listens beyond loopback loads it at start, before it serves
    (``test_hosts.py``)."""

    def torch_loaded(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()

    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=CFG, token=True) as c:
        server = c.servers[0].pid
        with hx.DistributedDataLoader(
            IndexDataset(8, shape=(4,)),
            batch_size=2,
            rank=0,
            world_size=1,
            coordinator=c.address,
            token=c.token,
            config=CFG,
        ) as ld:
            assert len(list(ld)) == 4
        assert all(torch_loaded(pid) for pid in c.worker_pids(0))  # the workers decode: they have it
        got, stats = run_ranks(c, skewed(8), 2, {"args": {"seconds_per_unit": 1.0}})  # rounds that trade slabs
        assert sum(stats[r]["rebalance"].get("moved", 0) for r in range(2)) > 0
        assert not torch_loaded(server)
