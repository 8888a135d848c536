"""Tier 2 on real processes: ranks of one host trade decoded samples of the same global step
through their group's leader DataServer (slabs handed over, no bytes between servers), keep their
batch sizes and every epoch's samples exactly once; a rank alone, or a policy that fails, keeps
its batches; nothing is left in shared memory."""
import threading
import time
from collections import Counter

import pytest
import torch

import helix_core as hx
from helix_core.testing import CostedDataset, IndexDataset

from dataplane import CFG, busy_segments, torch_batches, wait_for

HEAVY, LIGHT = 1000, 10


@pytest.fixture(scope="module")
def cluster():
    with hx.LocalCluster(local_servers=2, workers_per_server=1, config=CFG, token=True) as c:
        yield c


def _skewed(n=16):
    """Rank 0's shard (even indices, no shuffle) is all heavy, rank 1's all light."""
    return CostedDataset(n, tokens=[HEAVY if i % 2 == 0 else LIGHT for i in range(n)], shape=(8,))


def _run_ranks(cluster, ds, world, rebalance, epochs=1, ranks=None, after=None, **kw):
    """Each rank's loader in its own thread, stepping together; returns ({rank: [batch]}, {rank: stats})."""
    got, stats, errors = {}, {}, []
    ranks = list(ranks if ranks is not None else range(world))
    step = threading.Barrier(len(ranks))  # what the gradients' all_reduce does to ranks: they step together
    rebalance = {"round_timeout_s": 5.0, **rebalance}

    def rank_main(rank):
        try:
            with hx.DistributedDataLoader(ds, batch_size=2, rank=rank, world_size=world, coordinator=cluster.address,
                                          token=cluster.token, config=CFG, rebalance=rebalance,
                                          gpu_cost=lambda t: t, **kw) as ld:
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


def test_ranks_trade_samples_of_a_step_and_keep_batch_sizes_and_every_sample_once(cluster):
    ds = _skewed(16)
    reference = IndexDataset(16, shape=(8,))
    got, stats = _run_ranks(cluster, ds, 2, {"args": {"seconds_per_unit": 1.0}}, epochs=2)
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
    ds = _skewed(8)
    got, stats = _run_ranks(cluster, ds, 2, {"round_timeout_s": 0.05, "args": {"seconds_per_unit": 1.0}}, ranks=[0])
    assert [b["index"].tolist() for _, b in got[0]] == [b["index"].tolist() for b in torch_batches(ds, 2, 0, 2)]
    assert stats[0]["rebalance"].get("alone") == 2 and not stats[0]["rebalance"].get("moved_in")
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_rank_waiting_for_a_batch_held_in_its_round_gets_it_after_the_grace_not_at_its_deadline(cluster):
    """Rank 0 trains alone (rank 1 never comes) and reports 20 s GPU windows, so a batch landing
    while it computes may wait in its round until just before it is needed, ~20 s. But the rank
    asks for it sooner: once it waits in ``next()``, the round closes after ``round_timeout_s``
    ("asked"). Were it held to its deadline, ``next()`` would give up after the loader's batch
    deadline (10 s + 2 RPC timeouts here) with an error."""
    ds = _skewed(16)
    cfg = hx.ClusterConfig.for_tests(execute_timeout_s=10.0, sample_timeout_s=5.0)
    with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=2, coordinator=cluster.address,
                                  token=cluster.token, config=cfg, gpu_cost=lambda t: t, prefetch_depth=1,
                                  rebalance={"round_timeout_s": 0.2, "max_wait_s": 60.0,
                                             "args": {"seconds_per_unit": 1.0}}) as ld:
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
    ds = _skewed(8)
    got, stats = _run_ranks(cluster, ds, 2, {"sort_fn": lambda features, args: [0] * len(features)})
    for r in range(2):
        assert [b["index"].tolist() for _, b in got[r]] == [b["index"].tolist() for b in torch_batches(ds, 2, r, 2)]
        errors = stats[r]["rebalance_errors"]
        assert errors and "would get 4 samples, not its batch's 2" in errors[0], errors
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_user_feature_fn_and_sort_fn_decide_the_round(cluster):
    ds = _skewed(8)

    def swap_all(features, args):  # move every sample to the other rank of its step
        assert all(set(f) >= {"heavy", "rank", "step"} for f in features)
        return [1 - f["rank"] for f in features]

    got, stats = _run_ranks(cluster, ds, 2, {"feature_fn": lambda s: {"heavy": int(s["tokens"]) > 100},
                                             "sort_fn": swap_all})
    for r in range(2):
        want = torch_batches(ds, 2, 1 - r, 2)
        assert [sorted(b["index"].tolist()) for _, b in got[r]] == [sorted(b["index"].tolist()) for b in want]
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_rebalance_with_a_collate_whose_rows_cannot_be_told_apart_is_refused_up_front(cluster):
    with pytest.raises(ValueError, match="rebalance= needs collate_fn=None"):
        hx.DistributedDataLoader(_skewed(8), batch_size=2, rank=0, world_size=2, coordinator=cluster.address,
                                 token=cluster.token, config=CFG, rebalance={}, collate_fn=lambda s: s)
    with pytest.raises(ValueError, match="unknown key"):
        hx.DistributedDataLoader(_skewed(8), batch_size=2, rank=0, world_size=2, coordinator=cluster.address,
                                 token=cluster.token, config=CFG, rebalance={"buffer": 3})


def test_the_leader_sigkilled_mid_epoch_costs_no_sample_and_repeats_none():
    ds = CostedDataset(24, tokens=[HEAVY if i % 2 == 0 else LIGHT for i in range(24)], shape=(8,),
                       delays={i: 0.03 for i in range(24)})
    with hx.LocalCluster(local_servers=2, workers_per_server=1, config=CFG, token=True) as c:
        got, stats = _run_ranks(c, ds, 2, {"args": {"seconds_per_unit": 1.0}},
                                after=lambda n: c.kill_server(0) if n == 2 else None)  # rank 0's server: the leader
        steps = [sorted(i for r in range(2) for i in got[r][k][1]["index"].tolist()) for k in range(6)]
        want = [sorted(i for r in range(2) for i in torch_batches(ds, 2, r, 2)[k]["index"].tolist()) for k in range(6)]
        assert steps == want  # every step's samples, each once, after the leader died
        assert all(len(b["index"]) == 2 for r in range(2) for _, b in got[r])
        assert stats[0]["resubmits"] + stats[1]["resubmits"] > 0  # the kill did cost something
        assert sum(stats[r]["rebalance"].get("moved", 0) for r in range(2)) > 0  # rounds went on after it
        wait_for(lambda: not busy_segments(c), what="every slab released")


def test_a_policy_that_cannot_travel_without_pickles_is_refused_naming_it():
    from helix_core.client.tier2 import policy_spec

    local = lambda features, args: [f["rank"] for f in features]  # noqa: E731 - not importable by name
    with pytest.raises(ValueError, match="sort_fn is not an importable module-level function"):
        policy_spec(hx.Rebalance(sort_fn=local), pickle_allowed=False)
    pid, payload, fmt = policy_spec(hx.Rebalance(args={"margin": 0.3}), pickle_allowed=False)
    assert fmt == "json" and b"margin" in payload
    assert policy_spec(hx.Rebalance(sort_fn=local), pickle_allowed=True)[2] == "cloudpickle"


def test_a_run_resumed_mid_epoch_loses_and_repeats_nothing(cluster):
    """Both ranks stop after 2 steps, save, and new loaders resume: the rounds of the steps left are
    planned again, and the epoch's steps still hold exactly the planned samples."""
    ds = _skewed(16)
    opts = dict(batch_size=2, world_size=2, coordinator=cluster.address, token=cluster.token, config=CFG,
                rebalance={"round_timeout_s": 5.0, "args": {"seconds_per_unit": 1.0}}, gpu_cost=lambda t: t)
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
        assert sorted(i for r in range(2) for i in got[r][k]["index"].tolist()) == \
            sorted(i for r in range(2) for i in want[r][k]["index"].tolist())
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_resumed_rank_never_trades_with_a_rank_still_on_the_run_before(cluster):
    """Rank 1 stops and resumes while rank 0's old loader still holds its next step in a round:
    the resumed rank waits for rank 0's resumed loader (rounds never mix runs), the old loader's
    batch leaves the round when it closes, and the steps still hold exactly the planned samples."""
    ds = _skewed(16)
    opts = dict(batch_size=2, world_size=2, coordinator=cluster.address, token=cluster.token, config=CFG,
                rebalance={"round_timeout_s": 5.0, "args": {"seconds_per_unit": 1.0}}, gpu_cost=lambda t: t,
                prefetch_depth=1)
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
        assert sorted(i for r in range(2) for i in got[r][k]["index"].tolist()) == \
            sorted(i for r in range(2) for i in want[r][k]["index"].tolist())
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_loader_closed_while_its_batch_waits_in_a_round_leaves_the_round(cluster):
    """Rank 0's batch waits in its round (rank 1 has not come); rank 0's loader closes: its batch
    leaves the round, so rank 1, coming later, trades with no one and keeps its own samples."""
    ds = _skewed(8)
    opts = dict(batch_size=2, world_size=2, coordinator=cluster.address, token=cluster.token, config=CFG,
                gpu_cost=lambda t: t, prefetch_depth=1)
    gone = hx.DistributedDataLoader(ds, rank=0, rebalance={"round_timeout_s": 60.0,
                                                           "args": {"seconds_per_unit": 1.0}}, **opts)
    waiting = threading.Thread(target=_next_until_closed, args=(gone,), daemon=True)
    waiting.start()
    wait_for(lambda: gone.stats()["rebalance"].get("asked"), what="rank 0's batch sent to its round")
    time.sleep(0.3)  # its call reaches the leader (had it not, the assertion below holds all the same)
    gone.close()
    waiting.join(30)
    assert not waiting.is_alive()
    got, stats = _run_ranks(cluster, ds, 2, {"round_timeout_s": 1.0, "args": {"seconds_per_unit": 1.0}}, ranks=[1],
                            prefetch_depth=1)
    assert [b["index"].tolist() for _, b in got[1]] == [b["index"].tolist() for b in torch_batches(ds, 2, 1, 2)]
    assert not stats[1]["rebalance"].get("moved_in")
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def _next_until_closed(loader):
    try:
        next(iter(loader))
    except (hx.ClusterError, RuntimeError):
        pass  # "loader stopped" / "this iteration was stopped": it was closed while waiting


def test_a_loader_stopped_while_its_round_runs_gives_back_what_the_round_gave_it(cluster):
    """Rank 0's first round has closed and runs (its policy takes 2 s) when rank 0's loader
    closes. The leader settles who owns what (``LeaveRound``): the round's answer stands, so rank 1
    trains on the row rank 0 gave it, read from rank 0's slab (which rank 0 does not release under
    it: no error, no decode again), and rank 0 gives back its hold on rank 1's shared slab —
    nothing is left in shared memory. (Before, the stopped rank released its slab under the round:
    the round failed, or, once its answer was out, a taker read a freed slab.)"""
    ds = _skewed(8)

    def slow_swap_second(features, args):  # after 2 s, each rank's second sample goes to the other rank
        time.sleep(2.0)
        seen, out = Counter(), []
        for f in features:
            out.append(1 - f["rank"] if seen[(f["step"], f["rank"])] == 1 else f["rank"])
            seen[(f["step"], f["rank"])] += 1
        return out

    opts = dict(batch_size=2, world_size=2, coordinator=cluster.address, token=cluster.token, config=CFG,
                gpu_cost=lambda t: t, prefetch_depth=1)
    gone = hx.DistributedDataLoader(ds, rank=0, rebalance={"round_timeout_s": 30.0, "sort_fn": slow_swap_second},
                                    **opts)
    waiting = threading.Thread(target=_next_until_closed, args=(gone,), daemon=True)
    waiting.start()
    wait_for(lambda: gone.stats()["rebalance"].get("asked"), what="rank 0's batch sent to its round")
    staying = hx.DistributedDataLoader(ds, rank=1, rebalance={"round_timeout_s": 0.5, "sort_fn": slow_swap_second},
                                       **opts)
    got, errors = [], []

    def rank1():
        try:
            got.extend(staying)
        except BaseException as e:
            errors.append(e)

    with staying:
        stepping = threading.Thread(target=rank1)
        stepping.start()
        wait_for(lambda: staying.stats()["rebalance"].get("asked"), what="rank 1's batch sent to its round")
        time.sleep(0.5)  # its batch closed the round; the policy runs
        gone.close()
        waiting.join(30)
        stepping.join(60)
        assert not waiting.is_alive() and not stepping.is_alive() and not errors, errors
        batches, stats = got, staying.stats()
    assert sorted(batches[0]["index"].tolist()) == [1, 2]  # its own first sample, and rank 0's second
    assert [b["index"].tolist() for b in batches[1:]] == [[5, 7]]  # alone
    assert not stats["rebalance"].get("lost") and not stats["rebalance_errors"], stats["rebalance"]
    wait_for(lambda: not busy_segments(cluster), what="every slab released")


def test_a_rank_whose_round_leader_dies_learns_its_rounds_fate_from_the_coordinator():
    """The leader dies while rank 0's batch is held in its round. Had the round been committed
    (moved, some rank answered), rank 0 decodes what the round gave it; had it not, rank 0 keeps
    its batch and that round can never be committed after (so no rank trains on a sample twice)."""
    from concurrent.futures import Future

    from helix_core.client.transport import ClusterClient, RoundUnknown
    from helix_core.client.waits import Stop
    from helix_core.runtime.auth import call_metadata
    from helix_core.runtime.proto import helix_pb2 as pb, helix_pb2_grpc as pbg
    from helix_core.runtime.rpc import connect

    with hx.LocalCluster(local_servers=2, workers_per_server=1, config=CFG, token=True) as c:
        client = ClusterClient(c.address, c.token, CFG, 0, 2)
        coordinator = pbg.CoordinatorStub(connect(c.address, CFG, None, keepalive=False))
        try:
            def held_then_leader_killed(server: int, step: int):
                request = pb.RebalanceRequest(
                    group="spec:0,1", group_size=2, rank=0, step=step, client_id=client.client_id, host=client.host,
                    buffer_size=8, timeout_s=30.0, features_json='[{"tokens": 1}, {"tokens": 2}]', batch_rows=[2],
                    batches=[pb.BatchHandle(slab=pb.SlabHandle(segment="none", generation=1))], indices=[8, 10],
                    policy_id="default", policy=b'{"sort_fn": null, "args": null}', policy_format="json")
                got, stop = [], Stop()

                def rank0():
                    try:
                        reply = client.rebalance(c.servers[server].address, request, 30.0, stop, leave_s=2.0,
                                                 wanted=Future())  # not waited for: no AskRound
                        got.append(("kept", None) if reply is None else ("reply", reply.outcome))
                    except RoundUnknown as e:
                        got.append(("lost", e.indices, e.release))

                call = threading.Thread(target=rank0)
                call.start()
                time.sleep(1.0)  # rank 1 never comes: the call is held in its open round
                return call, got

            call, got = held_then_leader_killed(0, step=2)
            # what a leader does once its round ran and before it answers anyone: commit at the Coordinator
            ranks = [pb.RankSamples(rank=0, indices=[8, 9], release=[pb.SlabHandle(segment="none", generation=1)]),
                     pb.RankSamples(rank=1, indices=[10, 11])]
            assert coordinator.CommitRound(pb.CommitRoundRequest(group="spec:0,1", step=2, ranks=ranks),
                                           timeout=5, metadata=call_metadata(c.token)).committed
            c.kill_server(0)
            call.join(30)
            # decoded again: what the committed round gave rank 0; the slab of its own it read, given back
            assert got == [("lost", [8, 9], [{"segment": "none", "generation": 1}])]

            call, got = held_then_leader_killed(1, step=3)
            c.kill_server(1)  # dies with nothing committed
            call.join(30)
            assert got == [("kept", None)]
            late = pb.CommitRoundRequest(group="spec:0,1", step=3, ranks=[pb.RankSamples(rank=0, indices=[9])])
            assert not coordinator.CommitRound(late, timeout=5, metadata=call_metadata(c.token)).committed
        finally:
            client.close()
