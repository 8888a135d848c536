"""Co-scheduling on real processes: deadline-ordered DataServers, deadlines and reasons in the
Coordinator's decision log, Tier-1 token planning through the loader (exactly once, resume
mid-window), and online cost feedback."""

import json
import shutil
import threading
import time

import pytest
import torch
from dataplane import CFG, busy_segments, torch_batches, wait_for

import helix_core as hx
from helix_core.data.specs import make_spec
from helix_core.loader.cluster_client import ClusterClient
from helix_core.planning.balance import imbalance_ratio
from helix_core.planning.batching import TokenPlanner
from helix_core.planning.gpu import gpu_cost
from helix_core.planning.sampling import steps as sampler_order
from helix_core.testing.datasets import CostedDataset, IndexDataset
from helix_core.wire.proto import helix_pb2 as pb


@pytest.fixture(scope="module")
def cluster():
    with hx.LocalCluster(local_servers=2, workers_per_server=1, config=CFG) as c:
        yield c


def test_a_dataserver_runs_an_earlier_deadline_first(cluster):
    ds = IndexDataset(3, delays={0: 2.0, 1: 0.05, 2: 0.05})
    client = ClusterClient(cluster.address, None, CFG, 0, 1)
    try:
        spec = make_spec(ds, None, client.pickle_allowed)
        address = cluster.servers[0].address
        done, lock = [], threading.Lock()

        def send(task, index, deadline_s):
            req = pb.ExecuteRequest(
                task_id=client.task_id_base + task,
                spec_id=spec[0],
                indices=[index],
                on_error="raise",
                client_id=client.client_id,
                deadline_s=deadline_s or 0.0,
                has_deadline=deadline_s is not None,
            )
            fut = client.execute(address, spec, req)

            def landed(f, index=index):
                with lock:
                    done.append(index)

            fut.add_done_callback(landed)
            return fut

        futures = [send(1, 0, None)]  # occupies the only worker for 2 s (seen running by a poll on a loaded machine)
        stub = client.stub(address)
        wait_for(
            lambda: stub.Health(pb.HealthRequest(), timeout=5, metadata=client.metadata).inflight == 1,
            timeout_s=30,
            what="the first task running",
        )  # on a slow machine it may not have started yet
        futures.append(send(2, 1, 30.0))  # submitted first, needed in 30 s
        futures.append(send(3, 2, 0.05))  # submitted later, needed in 50 ms: runs first
        for f in futures:
            client.materialize(f.result(timeout=30), copy=True)  # frees each slab
        assert done == [0, 2, 1]
    finally:
        client.close()


def test_deadlines_and_reasons_reach_the_decision_log(cluster):
    ds = IndexDataset(24, delays={i: 0.02 for i in range(24)})
    with hx.DistributedDataLoader(
        ds,
        batch_size=2,
        coordinator=cluster.address,
        rank=0,
        world_size=1,
        scheduler="deadline",
        prefetch_depth=3,
        config=CFG,
    ) as ld:
        got = []
        for batch in ld:
            got.append(batch["index"].tolist())
            time.sleep(0.03)  # the "GPU window"
            ld.report_step_time(0.03)
        decisions = ld.client.telemetry(last_decisions=12)["decisions"]
        stats = ld.stats()
    assert got == [b["index"].tolist() for b in torch_batches(ds, 2, 0, 1)]  # placement never changes batches
    assert all(d["scheduler"] == "deadline" for d in decisions)
    late = [d for d in decisions if d["deadline_s"] is not None]
    assert late and all(
        d["reason"] in ("local-meets", "remote-gain", "meets-deadline", "earliest-finish") for d in late
    )
    assert all(set(d["finish_s"]) == {s.server_id for s in cluster.servers} for d in late)
    assert stats["deadline_p50_s"] > 0 and stats["window_s_per_unit"] is not None
    assert sum(stats["placement_reasons"].values()) == len(ds) // 2


def sampler_steps(n, batch_size, world_size, shuffle=False, seed=0, epoch=0):
    """``steps[s][r]``: what DistributedSampler + batching give rank r at global step s."""
    return sampler_order(n, batch_size, world_size, shuffle, seed, epoch)


def _planned(ds, world_size, batch_size, window):
    """What every rank must get: the sampler's steps, window by window, through the planner."""
    steps = sampler_steps(len(ds), batch_size, world_size, shuffle=True, seed=5)
    units = gpu_cost("videomae").sample_units(ds.tokens)
    planner = TokenPlanner(world_size, window)
    plan = [s for w in planner.windows(len(steps)) for s in planner.plan_window([steps[k] for k in w], units)]
    return steps, plan


def test_token_balanced_loader_consumes_each_sample_once_and_resumes_mid_window(cluster):
    tokens = [1568, 7056, 25088] * 8  # S / M / L clips' VideoMAE tokens
    ds = CostedDataset(24, tokens, broken=[4])  # one clip can't be costed: planned at its bucket's median
    kw = dict(
        batch_size=2,
        coordinator=cluster.address,
        world_size=2,
        shuffle=True,
        seed=5,
        balance="tokens",
        window=3,
        gpu_cost="videomae",
        config=CFG,
    )
    steps, plan = _planned(ds, 2, 2, 3)
    got = []
    for rank in range(2):
        with hx.DistributedDataLoader(ds, rank=rank, **kw) as ld:
            assert len(ld) == len(steps) == 6
            got.append([b["index"].tolist() for b in ld])
    assert got == [[step[r] for step in plan] for r in range(2)]
    assert all(len(b) == 2 for rank in got for b in rank)
    for w in range(2):  # per window, exactly the sampler's samples
        window = range(3 * w, 3 * w + 3)
        assert sorted(i for s in window for r in range(2) for i in got[r][s]) == sorted(
            i for s in window for b in steps[s] for i in b
        )
    units = gpu_cost("videomae").sample_units(tokens)
    assert imbalance_ratio(plan, units) < imbalance_ratio(steps, units)
    # resume mid-window (after 2 batches: inside window 0) on a fresh loader
    with hx.DistributedDataLoader(ds, rank=1, **kw) as ld:
        it = iter(ld)
        first = [next(it)["index"].tolist() for _ in range(2)]
        state = ld.state_dict()
    with hx.DistributedDataLoader(ds, rank=1, **kw) as ld:
        ld.load_state_dict(state)
        rest = [b["index"].tolist() for b in ld]
    assert first + rest == got[1]
    with hx.DistributedDataLoader(ds, rank=1, **{**kw, "window": 2}) as ld:
        with pytest.raises(ValueError, match="window"):
            ld.load_state_dict(state)


def test_window_one_keeps_every_sample_in_its_step_and_skip_still_substitutes(cluster):
    tokens = [1568, 25088, 7056, 1568, 25088, 7056, 1568, 7056]
    ds = CostedDataset(8, tokens, fail={3: "unreadable"})
    kw = dict(
        batch_size=2,
        coordinator=cluster.address,
        world_size=2,
        shuffle=False,
        balance="tokens",
        window=1,
        on_error="skip",
        config=CFG,
    )
    got, skipped = [], []
    for rank in range(2):
        with hx.DistributedDataLoader(ds, rank=rank, **kw) as ld:
            got.append([b["index"].tolist() for b in ld])
            skipped.append(ld.stats()["skipped"])
    steps = sampler_steps(len(ds), 2, 2)
    for s, step in enumerate(steps):
        want = sorted(i for b in step for i in b)
        have = sorted(i for r in range(2) for i in got[r][s])
        if 3 in want:  # replaced by a substitute from the same rank's shard
            assert len(have) == len(want) and 3 not in have
        else:
            assert have == want
    assert sorted(skipped) == [0, 1]  # counted once, by the rank whose batch held sample 3


def test_cost_feedback_lowers_the_prediction_error_on_a_biased_profile(tmp_path, kmix, cluster):
    root = tmp_path / "biased"
    shutil.copytree(kmix, root)
    lines = (root / "profiles.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[1:]]
    for r in rows:
        r["cost_scale"] *= 5.0  # the offline profile predicts 5x the real cost
        r["path"] = r["path"].replace(str(kmix), str(root))
    (root / "profiles.jsonl").write_text("\n".join([lines[0]] + [json.dumps(r) for r in rows]) + "\n")
    ds = hx.VideoClipDataset(root / "manifest.jsonl", num_frames=4, size=32)
    before = [ds.estimate_cost(i).cpu_s for i in range(len(ds))]
    with hx.DistributedDataLoader(
        ds,
        batch_size=1,
        coordinator=cluster.address,
        rank=0,
        world_size=1,
        scheduler="deadline",
        prefetch_depth=1,
        config=CFG,
    ) as ld:
        for epoch in range(6):
            ld.set_epoch(epoch)
            for _ in ld:
                pass
        stats = ld.stats()
    assert stats["cost_samples"] == 36
    assert stats["cost_error_end"] < 0.5 * stats["cost_error_start"], stats
    after = [ds.estimate_cost(i).cpu_s for i in range(len(ds))]
    assert all(a < b for a, b in zip(after, before))  # the refined estimates are what requests now carry


def test_requests_run_ahead_into_the_next_epoch_and_are_adopted_or_cancelled(cluster):
    ds = IndexDataset(12, delays={i: 0.02 for i in range(12)})
    kw = dict(
        batch_size=2,
        coordinator=cluster.address,
        rank=0,
        world_size=1,
        shuffle=True,
        seed=1,
        prefetch_depth=3,
        config=CFG,
    )
    with hx.DistributedDataLoader(ds, **kw) as ld:
        routed = ld.client.telemetry()["routed"]
        ld.set_epoch(0)  # a training loop: epochs advance, so the next one is requested ahead
        ld.set_epoch(1)
        first = [b["index"].tolist() for b in ld]
        # epoch 1 is done; epoch 2's first 3 batches are routed before anyone asks for them
        wait_for(lambda: ld.client.telemetry()["routed"] == routed + 6 + 3, 10, "requests ahead into epoch 2")
        ld.set_epoch(2)
        second = [b["index"].tolist() for b in ld]  # adopted: still exactly the sampler's epoch 2
        ld.set_epoch(7)  # not the epoch that was requested ahead: those are cancelled, epoch 7 is exact
        seventh = [b["index"].tolist() for b in ld]
        assert ld.state_dict()["epoch"] == 7
    for epoch, got in ((1, first), (2, second), (7, seventh)):
        assert got == [b["index"].tolist() for b in torch_batches(ds, 2, 0, 1, shuffle=True, seed=1, epoch=epoch)]
    # within a second on a quiet machine; a loaded one (the whole suite beside other work) takes longer
    wait_for(lambda: not busy_segments(cluster), 30, "every slab released after close")


def test_a_batch_that_would_miss_its_deadline_fans_out_and_merges_exactly(cluster):
    ds = CostedDataset(16, [1568] * 16, cpu_s=[1.0] * 16, shape=(3, 8, 8))  # predicted 1 s a sample
    with hx.DistributedDataLoader(
        ds, batch_size=4, coordinator=cluster.address, rank=0, world_size=1, prefetch_depth=2, config=CFG
    ) as ld:
        got = []
        for batch in ld:
            got.append(batch)
            ld.report_step_time(0.01)  # a 10 ms GPU window: no single worker prepares 4 s of work in time
        fanouts = ld.stats()["fanouts"]
    assert fanouts > 0
    want = torch_batches(ds, 4, 0, 1)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (
            torch.equal(a["x"], b["x"])
            and torch.equal(a["index"], b["index"])
            and torch.equal(a["tokens"], b["tokens"])
        )
