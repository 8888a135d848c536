"""The data plane with real processes on loopback: equality with torch DataLoader, remote
streaming, order, resume, errors, break — on one shared cluster (2 local servers + 1 sidecar)."""

import gc

import pytest
import torch
from dataplane import CFG, assert_same_batches, busy_segments, helix_children, torch_batches, wait_for

import helix_core as hx
from helix_core.testing.datasets import IndexDataset


@pytest.fixture(scope="module")
def cluster():
    with hx.LocalCluster(local_servers=2, remote_servers=1, workers_per_server=1, config=CFG) as c:
        yield c


def loader(ds, cluster, **kw):
    kw.setdefault("config", CFG)
    # these tests drive every server, the remote one too: least-request spreads requests evenly
    # (deadline placement keeps work local while deadlines are met: tests/loader/test_coscheduling.py)
    kw.setdefault("scheduler", "least-request")
    return hx.DistributedDataLoader(ds, coordinator=cluster.address, **kw)


def test_batches_equal_torch_dataloader_and_all_servers_used(cluster, kmix):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", num_frames=4, size=32)
    for rank in range(2):
        with loader(ds, cluster, batch_size=2, rank=rank, world_size=2, shuffle=True, seed=3, prefetch_depth=3) as ld:
            assert len(ld) == 2
            got = list(ld)  # the user keeps every batch: none may change
            assert_same_batches(got, torch_batches(ds, 2, rank, 2, shuffle=True, seed=3))
    big = IndexDataset(60, shape=(256,), delays={i: 0.05 for i in range(60)})
    with loader(big, cluster, batch_size=2, rank=0, world_size=1, prefetch_depth=6) as ld:
        got = list(ld)
        assert_same_batches(got, torch_batches(big, 2, 0, 1))
        stats = ld.stats()
        tele = ld.client.telemetry(last_decisions=100)
    used = {d["server"] for d in tele["decisions"]}
    assert len(used) == 3, tele["decisions"]
    assert stats["cross_ds_bytes"] > 0 and stats["batches"] == 30


def test_remote_server_delivers_identical_tensors(cluster):
    # 3 x 64 x 64 samples (12 KiB) go through the slab, not inline; enough in flight to reach the remote
    ds = IndexDataset(24, shape=(3, 64, 64), delays={i: 0.05 for i in range(24)})
    with loader(ds, cluster, batch_size=2, world_size=1, rank=0, prefetch_depth=6) as ld:
        got = list(ld)
        moved = ld.stats()["cross_ds_bytes"]
        decisions = ld.client.telemetry(last_decisions=12)["decisions"]
    assert_same_batches(got, torch_batches(ds, 2, 0, 1))
    remote = cluster.servers[2].server_id
    streamed = sum(d["server"] == remote for d in decisions)
    assert streamed > 0 and moved >= streamed * 2 * 3 * 64 * 64  # every remote batch crossed servers


def test_order_kept_when_completions_arrive_out_of_order(cluster):
    # early samples are slow, later ones fast: with 3 servers later batches finish first
    ds = IndexDataset(12, delays={0: 0.6, 1: 0.6, 2: 0.3, 3: 0.3})
    with loader(ds, cluster, batch_size=2, world_size=1, rank=0, prefetch_depth=6) as ld:
        got = [b["index"].tolist() for b in ld]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_resume_mid_epoch_gives_exactly_the_remaining_batches(cluster):
    ds = IndexDataset(40)
    kw = dict(batch_size=3, rank=1, world_size=2, shuffle=True, seed=7)
    want = torch_batches(ds, 3, 1, 2, shuffle=True, seed=7, epoch=2)
    with loader(ds, cluster, **kw) as ld:
        ld.set_epoch(2)
        it = iter(ld)
        first = [next(it) for _ in range(3)]
        state = ld.state_dict()
        del it
    assert state["batches_yielded"] == 3 and state["epoch"] == 2
    assert set(state) >= {"epoch", "seed", "batches_yielded"}
    with loader(ds, cluster, **kw) as ld2:
        ld2.load_state_dict(state)
        rest = list(ld2)
        assert_same_batches(first + rest, want)
        assert_same_batches(
            list(ld2), torch_batches(ds, 3, 1, 2, shuffle=True, seed=7, epoch=2)
        )  # next iter: whole epoch
    with loader(ds, cluster, batch_size=4, rank=1, world_size=2, shuffle=True, seed=7) as other:
        with pytest.raises(ValueError, match="batch_size"):
            other.load_state_dict(state)


def test_set_epoch_changes_order_like_distributed_sampler(cluster):
    ds = IndexDataset(16)
    with loader(ds, cluster, batch_size=4, rank=0, world_size=1, shuffle=True, seed=1) as ld:
        e0 = [b["index"].tolist() for b in ld]
        ld.set_epoch(1)
        e1 = [b["index"].tolist() for b in ld]
    assert e0 != e1
    assert e1 == [b["index"].tolist() for b in torch_batches(ds, 4, 0, 1, shuffle=True, seed=1, epoch=1)]


def test_corrupt_clip_raises_sample_error_naming_the_file(cluster, kmix, tmp_path):
    from conftest import write_manifest

    (tmp_path / "bad.mp4").write_bytes(b"\x00" * 1000)
    clips = sorted(kmix.glob("*.mp4"))
    write_manifest(
        tmp_path, [{"path": str(clips[0])}, {"path": "bad.mp4"}, {"path": str(clips[1])}, {"path": str(clips[2])}]
    )
    ds = hx.VideoClipDataset(tmp_path / "manifest.jsonl", num_frames=2, size=32)
    with loader(ds, cluster, batch_size=2, rank=0, world_size=1) as ld:
        it = iter(ld)
        with pytest.raises(hx.SampleError, match="bad.mp4") as err:
            next(it)
        assert err.value.index == 1 and str(tmp_path / "bad.mp4") == err.value.path
        assert next(it)["index"].tolist() == [2, 3]  # the following batch still arrives
    with loader(ds, cluster, batch_size=2, rank=0, world_size=1, on_error="skip") as ld:
        batches = list(ld)
        assert [len(b["index"]) for b in batches] == [2, 2]  # every batch keeps its size
        assert 1 not in batches[0]["index"].tolist() and ld.stats()["skipped"] == 1


def test_break_cancels_and_frees_slabs(cluster):
    ds = IndexDataset(200, shape=(1 << 16,), delays={i: 0.02 for i in range(200)})
    with loader(ds, cluster, batch_size=4, rank=0, world_size=1, prefetch_depth=8) as ld:
        for i, _batch in enumerate(ld):
            if i == 2:
                break
        del _batch
        try:
            wait_for(lambda: not busy_segments(cluster), 15, "every slab to be released after break")
        except AssertionError:
            raise AssertionError(f"still busy: {busy_segments(cluster)}") from None
        kept = list(ld)  # a new iteration is a full epoch again
        assert len(kept) == 50 and not any(torch.equal(kept[0]["x"], k["x"]) for k in kept[1:3])
        assert busy_segments(cluster)  # kept batches pin their slabs ...
        del kept
        gc.collect()
        wait_for(lambda: not busy_segments(cluster), 10, "slabs released once the batches are dropped")


def test_two_loaders_of_one_rank_never_share_tasks(cluster):
    a, b = IndexDataset(12, shape=(4,)), IndexDataset(12, shape=(8,))
    with (
        loader(a, cluster, batch_size=2, rank=0, world_size=1) as la,
        loader(b, cluster, batch_size=2, rank=0, world_size=1) as lb,
    ):
        pairs = list(zip(la, lb))  # both in flight at once, same rank, same task numbering
    assert_same_batches([p[0] for p in pairs], torch_batches(a, 2, 0, 1))
    assert_same_batches([p[1] for p in pairs], torch_batches(b, 2, 0, 1))


def test_a_user_may_keep_more_batches_than_the_slab_pools_hold(cluster):
    ds = IndexDataset(210, shape=(1 << 13,))  # 8 KiB samples travel in slabs; 210 > 3 servers x 64 kept slabs
    with loader(ds, cluster, batch_size=1, rank=0, world_size=1, prefetch_depth=8) as ld:
        kept = list(ld)
    assert_same_batches(kept, torch_batches(ds, 1, 0, 1))
    del kept
    gc.collect()
    wait_for(lambda: not busy_segments(cluster), 10, "the kept batches' slabs to be released")


def test_resume_survives_set_epoch_and_a_finished_epoch_resumes_to_a_fresh_pass(cluster):
    ds = IndexDataset(24)
    kw = dict(batch_size=3, rank=0, world_size=2, shuffle=True, seed=4)
    with loader(ds, cluster, **kw) as ld:
        ld.set_epoch(1)
        it = iter(ld)
        first = [next(it) for _ in range(2)]
        mid = ld.state_dict()
        del it
        full = list(ld)
        done = ld.state_dict()
    assert mid["batches_yielded"] == 2 and done == {**mid, "batches_yielded": 4}
    with loader(ds, cluster, **kw) as ld2:
        ld2.load_state_dict(mid)
        ld2.set_epoch(mid["epoch"])  # the usual resume loop sets the epoch it resumes: the position stays
        assert_same_batches(first + list(ld2), full)
        ld2.load_state_dict(done)
        assert ld2.state_dict()["batches_yielded"] == 4
        assert_same_batches(list(ld2), full)  # that epoch was finished: a fresh pass, as torchdata's loader does
        ld2.set_epoch(2)
        assert_same_batches(list(ld2), torch_batches(ds, 3, 0, 2, shuffle=True, seed=4, epoch=2))


def test_break_and_close_give_the_coordinator_its_counts_back(cluster):
    ds = IndexDataset(100, delays={i: 0.02 for i in range(100)})
    with loader(ds, cluster, batch_size=2, rank=0, world_size=1, prefetch_depth=8) as ld:
        for i, _ in enumerate(ld):
            if i == 1:
                break
        it = iter(ld)
        next(it)
        fresh = iter(ld)
        with pytest.raises(RuntimeError, match="newer iteration"):
            next(it)  # one loader, one live iteration, as with persistent workers
        next(fresh)
    from helix_core.loader.cluster_client import ClusterClient

    observer = ClusterClient(cluster.address, cluster.token, CFG, 0, 1)
    try:
        wait_for(
            lambda: sum(s["outstanding"] for s in observer.telemetry()["servers"]) == 0,
            10,
            "the Coordinator's outstanding counts to come back to zero",
        )
    finally:
        observer.close()


def test_microbatch_fanout_merges_and_pads(cluster, kmix):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", num_frames=None, size=None)  # S/M/L: variable shapes
    with loader(ds, cluster, batch_size=3, rank=0, world_size=1, microbatch_size=1, collate_fn=hx.pad_collate) as ld:
        batches = list(ld)
    ref = [hx.pad_collate([ds[i] for i in range(3)]), hx.pad_collate([ds[i] for i in range(3, 6)])]
    assert len(batches) == 2
    for got, want in zip(batches, ref):
        assert got["video"].shape == want["video"].shape and torch.equal(got["video"], want["video"])
        assert got["video_lengths"].tolist() == want["video_lengths"].tolist()


def test_microbatches_of_tuple_samples_merge_field_by_field(cluster):
    from helix_core.testing.datasets import pair_collate

    ds = IndexDataset(10)
    with loader(ds, cluster, batch_size=4, rank=0, world_size=1, microbatch_size=2, collate_fn=pair_collate) as ld:
        got = list(ld)
    want = torch_batches(ds, 4, 0, 1, collate_fn=pair_collate)
    assert [len(b) for b in got] == [2, 2, 2]  # (X, indices), never (X1, i1, X2, i2)
    for (x, idx), (wx, widx) in zip(got, want):
        assert torch.equal(x, wx) and torch.equal(idx, widx)


def test_bad_option_values_name_the_argument_and_the_valid_ones(cluster):
    ds = IndexDataset(4)
    with pytest.raises(ValueError, match=r"scheduler='edf'; valid: deadline, least-request"):
        loader(ds, cluster, scheduler="edf")
    with pytest.raises(ValueError, match=r"balance='samples'; valid: None, 'tokens'"):
        loader(ds, cluster, balance="samples")
    for window in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"window=.*int >= 1"):
            loader(ds, cluster, balance="tokens", window=window)
    with pytest.raises(ValueError, match="estimate_cost"):  # nothing to plan by: said before any work
        loader(ds, cluster, balance="tokens")
    with pytest.raises(ValueError, match="raise, skip"):
        loader(ds, cluster, on_error="ignore")
    with pytest.raises(ValueError, match="gpu_cost"):
        loader(ds, cluster, gpu_cost=3)
    with loader(ds, cluster) as ld:
        for bad in (-0.1, float("nan"), float("inf"), "1"):
            with pytest.raises(ValueError, match=r"report_step_time\(seconds="):
                ld.report_step_time(bad)
        ld.report_step_time(0.25)


def test_train_and_val_loaders_share_the_embedded_cluster(monkeypatch):
    monkeypatch.delenv("HELIX_COORDINATOR", raising=False)
    before = {p.pid for p in helix_children()}  # other tests' clusters
    train = hx.DistributedDataLoader(IndexDataset(8), batch_size=2, rank=0, world_size=1, num_workers=1, config=CFG)
    val = hx.DistributedDataLoader(IndexDataset(4), batch_size=2, rank=0, world_size=1, num_workers=1, config=CFG)
    try:
        assert train.coordinator == val.coordinator  # one embedded cluster
        train.close()
        assert [b["index"].tolist() for b in val] == [[0, 1], [2, 3]]  # still served after train closed
    finally:
        train.close()
        val.close()
    wait_for(
        lambda: not [p for p in helix_children() if p.pid not in before],
        15,
        "the embedded cluster's processes to stop with the last loader",
    )


def test_device_copy_releases_the_slab(cluster):
    ds = IndexDataset(8, shape=(1 << 13,))
    with loader(ds, cluster, batch_size=4, rank=0, world_size=1, device="cpu") as ld:
        kept = list(ld)
        assert_same_batches(kept, torch_batches(ds, 4, 0, 1))
        wait_for(lambda: not busy_segments(cluster), 10, "copied batches to release their slabs at once")


def test_set_epoch_during_an_iteration_leaves_the_new_epoch_at_its_start(cluster):
    ds = IndexDataset(16)
    with loader(ds, cluster, batch_size=2, rank=0, world_size=1) as ld:
        it = iter(ld)
        next(it), next(it)
        assert ld.state_dict()["batches_yielded"] == 2
        ld.set_epoch(1)  # a trainer moves on while the old iterator is still in use
        next(it)  # the old iterator's batches belong to epoch 0
        state = ld.state_dict()
        assert (state["epoch"], state["batches_yielded"]) == (1, 0)
        assert [b["index"].tolist() for b in ld] == [b["index"].tolist() for b in torch_batches(ds, 2, 0, 1)]
