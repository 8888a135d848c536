"""Tier 2 through faults, on real processes: the leader SIGKILLed mid-epoch, a loader closed while
its batch waits in a round or while its round runs, a rank whose leader died asking the
Coordinator what its round gave it — no sample lost or repeated, nothing left in shared memory."""

import threading
import time
from collections import Counter

import pytest
from dataplane import CFG, busy_segments, torch_batches, wait_for
from tier2run import HEAVY, LIGHT, run_ranks, skewed

import helix_core as hx
from helix_core.testing.datasets import CostedDataset


@pytest.fixture(scope="module")
def cluster():
    with hx.LocalCluster(local_servers=2, workers_per_server=1, config=CFG, token=True) as c:
        yield c


def test_the_leader_sigkilled_mid_epoch_costs_no_sample_and_repeats_none():
    ds = CostedDataset(
        24, tokens=[HEAVY if i % 2 == 0 else LIGHT for i in range(24)], shape=(8,), delays={i: 0.03 for i in range(24)}
    )
    with hx.LocalCluster(local_servers=2, workers_per_server=1, config=CFG, token=True) as c:
        got, stats = run_ranks(
            c, ds, 2, {"args": {"seconds_per_unit": 1.0}}, after=lambda n: c.kill_server(0) if n == 2 else None
        )  # rank 0's server: the leader
        steps = [sorted(i for r in range(2) for i in got[r][k][1]["index"].tolist()) for k in range(6)]
        want = [sorted(i for r in range(2) for i in torch_batches(ds, 2, r, 2)[k]["index"].tolist()) for k in range(6)]
        assert steps == want  # every step's samples, each once, after the leader died
        assert all(len(b["index"]) == 2 for r in range(2) for _, b in got[r])
        assert stats[0]["resubmits"] + stats[1]["resubmits"] > 0  # the kill did cost something
        assert sum(stats[r]["rebalance"].get("moved", 0) for r in range(2)) > 0  # rounds went on after it
        wait_for(lambda: not busy_segments(c), what="every slab released")


def test_a_loader_closed_while_its_batch_waits_in_a_round_leaves_the_round(cluster):
    """Rank 0's batch waits in its round (rank 1 has not come); rank 0's loader closes: its batch
    leaves the round, so rank 1, coming later, trades with no one and keeps its own samples."""
    ds = skewed(8)
    opts = dict(
        batch_size=2,
        world_size=2,
        coordinator=cluster.address,
        token=cluster.token,
        config=CFG,
        gpu_cost=lambda t: t,
        prefetch_depth=1,
    )
    gone = hx.DistributedDataLoader(
        ds, rank=0, rebalance={"round_timeout_s": 60.0, "args": {"seconds_per_unit": 1.0}}, **opts
    )
    waiting = threading.Thread(target=_next_until_closed, args=(gone,), daemon=True)
    waiting.start()
    wait_for(lambda: gone.stats()["rebalance"].get("asked"), what="rank 0's batch sent to its round")
    time.sleep(0.3)  # its call reaches the leader (had it not, the assertion below holds all the same)
    gone.close()
    waiting.join(30)
    assert not waiting.is_alive()
    got, stats = run_ranks(
        cluster, ds, 2, {"round_timeout_s": 1.0, "args": {"seconds_per_unit": 1.0}}, ranks=[1], prefetch_depth=1
    )
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
    ds = skewed(8)

    def slow_swap_second(features, args):  # after 2 s, each rank's second sample goes to the other rank
        time.sleep(2.0)
        seen, out = Counter(), []
        for f in features:
            out.append(1 - f["rank"] if seen[(f["step"], f["rank"])] == 1 else f["rank"])
            seen[(f["step"], f["rank"])] += 1
        return out

    opts = dict(
        batch_size=2,
        world_size=2,
        coordinator=cluster.address,
        token=cluster.token,
        config=CFG,
        gpu_cost=lambda t: t,
        prefetch_depth=1,
    )
    gone = hx.DistributedDataLoader(
        ds, rank=0, rebalance={"round_timeout_s": 30.0, "sort_fn": slow_swap_second}, **opts
    )
    waiting = threading.Thread(target=_next_until_closed, args=(gone,), daemon=True)
    waiting.start()
    wait_for(lambda: gone.stats()["rebalance"].get("asked"), what="rank 0's batch sent to its round")
    staying = hx.DistributedDataLoader(
        ds, rank=1, rebalance={"round_timeout_s": 0.5, "sort_fn": slow_swap_second}, **opts
    )
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

    from helix_core.loader.cluster_client import ClusterClient
    from helix_core.loader.waits import Stop
    from helix_core.memory.shm import SlabHandle
    from helix_core.security.auth import call_metadata
    from helix_core.tier2.errors import RoundUnknown
    from helix_core.wire.proto import helix_pb2 as pb
    from helix_core.wire.proto import helix_pb2_grpc as pbg
    from helix_core.wire.rpc import connect

    with hx.LocalCluster(local_servers=2, workers_per_server=1, config=CFG, token=True) as c:
        client = ClusterClient(c.address, c.token, CFG, 0, 2)
        coordinator = pbg.CoordinatorStub(connect(c.address, CFG, None, keepalive=False))
        try:

            def held_then_leader_killed(server: int, step: int):
                request = pb.RebalanceRequest(
                    group="spec:0,1",
                    group_size=2,
                    rank=0,
                    step=step,
                    client_id=client.client_id,
                    host=client.host,
                    buffer_size=8,
                    timeout_s=30.0,
                    features_json='[{"tokens": 1}, {"tokens": 2}]',
                    batch_rows=[2],
                    batches=[pb.BatchHandle(slab=pb.SlabHandle(segment="none", generation=1))],
                    indices=[8, 10],
                    policy_id="default",
                    policy=b'{"sort_fn": null, "args": null}',
                    policy_format="json",
                )
                got, stop = [], Stop()

                def rank0():
                    try:
                        reply = client.rebalance(
                            c.servers[server].address, request, 30.0, stop, leave_s=2.0, wanted=Future()
                        )  # not waited for: no AskRound
                        got.append(("kept", None) if reply is None else ("reply", reply.outcome))
                    except RoundUnknown as e:
                        got.append(("lost", e.indices, e.release))

                call = threading.Thread(target=rank0)
                call.start()
                time.sleep(1.0)  # rank 1 never comes: the call is held in its open round
                return call, got

            call, got = held_then_leader_killed(0, step=2)
            # what a leader does once its round ran and before it answers anyone: commit at the Coordinator
            ranks = [
                pb.RankSamples(rank=0, indices=[8, 9], release=[pb.SlabHandle(segment="none", generation=1)]),
                pb.RankSamples(rank=1, indices=[10, 11]),
            ]
            assert coordinator.CommitRound(
                pb.CommitRoundRequest(group="spec:0,1", step=2, ranks=ranks), timeout=5, metadata=call_metadata(c.token)
            ).committed
            c.kill_server(0)
            call.join(30)
            # decoded again: what the committed round gave rank 0; the slab of its own it read, given back
            assert got == [("lost", [8, 9], [SlabHandle("none", 1)])]

            call, got = held_then_leader_killed(1, step=3)
            c.kill_server(1)  # dies with nothing committed
            call.join(30)
            assert got == [("kept", None)]
            late = pb.CommitRoundRequest(group="spec:0,1", step=3, ranks=[pb.RankSamples(rank=0, indices=[9])])
            assert not coordinator.CommitRound(late, timeout=5, metadata=call_metadata(c.token)).committed
        finally:
            client.close()
