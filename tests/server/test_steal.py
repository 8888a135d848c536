"""Work stealing inside a DataServer: a worker with nothing queued takes the unstarted tail of a
batch another worker is preparing, and the batch still comes out exactly as torch makes it."""

import multiprocessing as mp

import pytest
import torch
from dataplane import CFG, assert_same_batches, busy_segments, busy_with_prefix, torch_batches, wait_for

import helix_core as hx
from helix_core.data.specs import make_spec
from helix_core.memory import shm
from helix_core.memory.shm import SlabHandle
from helix_core.server.pool import WorkerPool
from helix_core.server.steal import Claim, Pieces
from helix_core.server.worker import TaskResult
from helix_core.testing.datasets import IndexDataset
from helix_core.wire.messages import ErrorKind


# ---- the claim record and the pieces (pure) ------------------------------------------------------------
def test_claim_gives_away_the_larger_half_of_what_is_not_started_and_never_the_first_sample(tmp_path):
    c = Claim(mp.get_context("spawn"), str(tmp_path / "claim"))
    c.reset(4)
    assert c.steal() == (2, 4)  # nothing started yet: sample 0 stays, the thief takes 2 and 3
    assert [c.take(k) for k in range(4)] == [True, True, False, False]
    assert c.steal() is None  # sample 1 started: nothing left
    c.reset(5)
    assert c.take(0) and c.take(1)
    assert c.steal() == (3, 5)  # 2, 3, 4 unstarted: the thief takes 3 and 4, the worker keeps 2
    assert c.take(2) and not c.take(3)
    c.reset(1)
    assert c.steal() is None


def _hold_claim(claim, ready):
    claim._locked()  # inside take's critical section, for ever
    ready.set()
    import time

    time.sleep(600)


def test_a_claim_held_by_a_process_that_dies_is_free_at_once(tmp_path):
    import os
    import signal
    import time

    ctx = mp.get_context("spawn")
    c = Claim(ctx, str(tmp_path / "claim"))
    c.reset(4)
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_claim, args=(c, ready), daemon=True)
    holder.start()
    try:
        assert ready.wait(60)
        assert c.steal() is None  # held by a live (stuck) process: the supervisor does not wait on it
        os.kill(holder.pid, signal.SIGKILL)  # killed inside its critical section
        holder.join(10)
        t0 = time.monotonic()
        assert c.steal() == (2, 4) and time.monotonic() - t0 < 0.05  # the kernel released it
    finally:
        if holder.is_alive():
            holder.kill()
    c.unlink()
    assert not (tmp_path / "claim").exists()


def _semaphores() -> set[str]:
    import os

    return {n for n in os.listdir("/dev/shm") if n.startswith("sem.")}


def test_a_dataserver_killed_with_its_whole_process_tree_leaves_no_named_semaphore():
    import psutil

    before = _semaphores()
    ds = IndexDataset(16, shape=(8,))
    with hx.LocalCluster(local_servers=1, workers_per_server=2, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, config=CFG
        ) as ld:
            assert len(list(ld)) == 8
        server = psutil.Process(cluster.servers[0].pid)
        tree = [server] + server.children(recursive=True)  # workers and multiprocessing's resource tracker
        assert len(tree) >= 3
        for p in tree:  # all at once, as Ray's kill or the OOM killer of a job does: nobody cleans up after it
            p.kill()
        psutil.wait_procs(tree, timeout=10)
    assert _semaphores() - before == set()
    assert segments_of(cluster) == []


def segments_of(cluster):
    return shm.list_segments(f"helix-{cluster.cluster_id}-")


def test_pieces_complete_in_order_and_an_error_frees_the_other_pieces():
    p = Pieces()
    p.add(2)
    assert not p.finish(2, TaskResult(SlabHandle("b", 1), rows=2, decoded=[7, 8], decode_cpu_s=[0.1, 0.2]))
    assert p.finish(0, TaskResult(SlabHandle("a", 1), rows=2, decoded=[5, 6], decode_cpu_s=[0.3, 0.4]))
    result, unused = p.combine()
    assert [r.rows for r in result.pieces] == [2, 2] and result.decoded == [5, 6, 7, 8] and unused == []
    assert result.rows == 4 and result.features is None and result.handle is None
    assert [h.segment for h in result.handles()] == ["a", "b"]
    q = Pieces()
    q.add(1)
    q.finish(1, TaskResult(error_kind=ErrorKind.SAMPLE, error="bad sample 9"))
    q.finish(0, TaskResult(SlabHandle("a", 1), rows=1))
    result, unused = q.combine()
    assert result.error == "bad sample 9" and [h.segment for h in unused[0].handles()] == ["a"]


def test_host_layout_gives_every_server_two_workers_or_more():
    from helix_core.launch.cluster import host_layout

    assert host_layout(4, 4) == (2, 2)  # ranks share servers rather than each getting one worker
    assert host_layout(4, 16) == (4, 4)  # one server per rank while the budget allows
    assert host_layout(2, 3) == (1, 3)
    assert host_layout(1, 1) == (1, 1)  # one worker: nothing to split, one server
    assert host_layout(8, 12) == (6, 2)


# ---- a real pool ----------------------------------------------------------------------------------------
@pytest.fixture
def pool():
    p = WorkerPool(2, "helix-teststeal-", False, CFG)
    yield p
    wait_for(lambda: not busy_with_prefix("helix-teststeal-"), 10, "every slab released before close")
    p.close()


def _configure(pool, ds):
    spec_id, payload, fmt = make_spec(ds, None, False)
    pool.configure(spec_id, payload, fmt)
    return spec_id


def test_an_idle_worker_takes_the_tail_of_a_running_batch(pool):
    ds = IndexDataset(8, delays={i: 0.2 for i in range(8)})
    spec_id = _configure(pool, ds)
    task = {"task_id": 1, "spec_id": spec_id, "indices": [4, 5, 6, 7], "epoch": 0, "on_error": "raise"}
    split = pool.submit(dict(task, splittable=True)).result(30)
    assert split.rows == 4 and len(split.pieces) >= 2 and split.decoded == [4, 5, 6, 7]
    assert pool.stats()["steals"] >= 1
    whole = pool.submit(dict(task, task_id=2, splittable=False)).result(30)
    assert not whole.pieces and whole.rows == 4  # a collate whose merge is not exact is never split
    for h in split.handles() + whole.handles():
        shm.release_segment(h)


def test_a_resubmitted_task_never_gets_a_piece_of_the_cancelled_one():
    p = WorkerPool(3, "helix-teststeal-", False, CFG)
    try:
        ds = IndexDataset(8, delays={i: (0.4 if i < 4 else 0.05) for i in range(8)})
        spec_id = _configure(p, ds)
        task = {
            "task_id": 1,
            "spec_id": spec_id,
            "indices": list(range(8)),
            "epoch": 0,
            "on_error": "raise",
            "splittable": True,
        }
        first = p.submit(dict(task))
        wait_for(lambda: p.stats()["steals"] >= 2, 30, "two steals")
        p.cancel([1])  # the client gave up on it (a lost reply) ...
        again = p.submit(dict(task))  # ... and sends the same task id again, while its pieces still run
        result = again.result(60)
        assert first.cancelled()
        assert result.decoded == list(range(8)) and result.rows == 8
        for h in result.handles():
            shm.release_segment(h)
        wait_for(lambda: p.stats()["inflight"] == 0, 30, "the first submission's pieces to finish")
        wait_for(lambda: not busy_with_prefix("helix-teststeal-"), 10, "their slabs released")
    finally:
        p.close()


def test_a_worker_killed_by_a_sample_of_a_stolen_piece_names_it(pool):
    ds = IndexDataset(4, delays={0: 0.5, 1: 0.5}, crash={3: "exit"})
    spec_id = _configure(pool, ds)
    result = pool.submit(
        {"task_id": 1, "spec_id": spec_id, "indices": [0, 1, 2, 3], "epoch": 0, "on_error": "raise", "splittable": True}
    ).result(60)
    assert pool.stats()["steals"] >= 1  # sample 3 was in the stolen tail
    assert result.error_kind == ErrorKind.SAMPLE and result.failure.index == 3
    assert not result.pieces and not result.handles()  # the head's slab went back with the error


def test_a_cancelled_split_batch_frees_every_piece(pool):
    ds = IndexDataset(8, delays={i: 0.2 for i in range(8)})
    spec_id = _configure(pool, ds)
    fut = pool.submit(
        {"task_id": 1, "spec_id": spec_id, "indices": [0, 1, 2, 3], "epoch": 0, "on_error": "raise", "splittable": True}
    )
    wait_for(lambda: pool.stats()["steals"] >= 1, 30, "a steal")
    pool.cancel([1])
    assert fut.cancelled()
    wait_for(lambda: pool.stats()["inflight"] == 0, 30, "both pieces to finish")
    wait_for(lambda: not busy_with_prefix("helix-teststeal-"), 10, "every slab back")


# ---- end to end -------------------------------------------------------------------------------------------
def test_split_batches_equal_torch_with_default_and_pad_collate(kmix):
    slow = IndexDataset(24, shape=(3, 5), delays={i: 0.05 for i in range(24)})
    video = hx.VideoClipDataset(kmix / "manifest.jsonl", num_frames=None, size=None)  # S/M/L: shapes differ
    with hx.LocalCluster(local_servers=1, workers_per_server=2, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            slow, batch_size=4, rank=0, world_size=1, coordinator=cluster.address, prefetch_depth=1, config=CFG
        ) as ld:  # one batch at a time: a worker idles
            got = list(ld)
            assert ld.stats()["stolen"] >= 1
        assert_same_batches(got, torch_batches(slow, 4, 0, 1))
        with hx.DistributedDataLoader(
            video,
            batch_size=3,
            rank=0,
            world_size=1,
            coordinator=cluster.address,
            prefetch_depth=1,
            collate_fn=hx.pad_collate,
            config=CFG,
        ) as ld:
            got = list(ld)  # decoded in place, stopped short, padded by the merge as pad_collate pads
            stolen = ld.stats()["stolen"]
        want = [hx.pad_collate([video[i] for i in range(k, k + 3)]) for k in (0, 3)]
        assert stolen >= 1
        assert_same_batches(got, want)
        # a split batch's video may be a view of its first piece's slab (grown in place): the
        # slabs go back once the batches are dropped
        del got
        wait_for(lambda: not busy_segments(cluster), 10, "every slab released once the batches are dropped")


def test_a_sample_that_kills_the_worker_of_a_stolen_piece_is_named():
    ds = IndexDataset(4, delays={0: 0.5, 1: 0.5}, crash={3: "exit"})
    with hx.LocalCluster(local_servers=1, workers_per_server=2, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=4, rank=0, world_size=1, coordinator=cluster.address, prefetch_depth=1, config=CFG
        ) as ld:
            with pytest.raises(hx.SampleError, match="worker process died") as err:
                next(iter(ld))
            assert err.value.index == 3
        wait_for(lambda: not busy_segments(cluster), 10, "every slab released")


def test_pieces_of_a_default_collate_batch_that_torch_could_not_stack_raise():
    from torch.utils.data import default_collate

    from helix_core.memory.merge import merge_batches

    a, b = default_collate([{"x": torch.zeros(3)}]), default_collate([{"x": torch.zeros(4)}])
    with pytest.raises(ValueError, match=r"batch\['x'\]: stack expects each tensor to be equal size"):
        merge_batches([a, b], rows=[1, 1], pad=False)  # torch raises for the whole batch: so do its pieces
    assert merge_batches([a, b], rows=[1, 1])["x"].shape == (2, 4)  # microbatch_size= asked for padding


def test_pad_collate_pads_to_a_larger_video_out_and_merges_back_exactly():
    from helix_core.memory.merge import merge_batches

    g = torch.Generator().manual_seed(0)
    samples = [
        {"video": torch.randint(0, 255, (t, 3, h, w), dtype=torch.uint8, generator=g), "label": i}
        for i, (t, h, w) in enumerate([(2, 4, 5), (3, 2, 6), (4, 6, 3)])
    ]
    whole = hx.pad_collate(samples)  # [3, 4, 3, 6, 6]
    head = hx.pad_collate(samples[:1], video_out=torch.full((1, 4, 3, 6, 6), 7, dtype=torch.uint8))
    assert head["video_mask"].shape == (1, 4) and head["video"][0, 2:].eq(0).all()  # padding zeroed
    merged = merge_batches([head, hx.pad_collate(samples[1:])], rows=[1, 2])
    assert_same_batches([merged], [whole])
    with pytest.raises(ValueError, match="at least"):
        hx.pad_collate(samples, video_out=torch.zeros((3, 3, 3, 6, 6), dtype=torch.uint8))  # T 3 < 4


def test_a_first_piece_with_room_after_its_video_grows_in_place_and_the_others_are_padded_into_it():
    """A worker that stopped short lays its small tensors after the whole batch's video (the room
    of the rows a thief took): the client's merge then copies only the thief's rows, into that
    room (whose old bytes it zeroes where they are padding), and the batch is still pad_collate's."""
    from helix_core.loader.replies import _grower
    from helix_core.memory.merge import merge_batches
    from helix_core.memory.tensors import flatten, layout, read_tensors, unflatten, write_tensors

    g = torch.Generator().manual_seed(1)
    samples = [
        {
            "video": torch.randint(0, 255, (t, 3, h, w), dtype=torch.uint8, generator=g),
            "label": i,
            "tokens": torch.arange(2000) + i,
        }
        for i, (t, h, w) in enumerate([(4, 6, 6), (3, 2, 6), (4, 6, 3)])
    ]
    whole = hx.pad_collate(samples)  # [3, 4, 3, 6, 6]
    payload = memoryview(bytearray(b"\xff" * 65536))  # a reused slab: old bytes everywhere
    room = whole["video"].numel()
    video = torch.frombuffer(payload, dtype=torch.uint8)[:room].view(whole["video"].shape)[:1]
    head = hx.pad_collate(samples[:1], video_out=video)  # decoded in place, stopped after one sample
    tree_json, tree_pickle, tensors = flatten(head)
    at = next(k for k, x in enumerate(tensors) if x.data_ptr() == video.data_ptr())
    metas, total = layout(tensors, pinned={at: (0, video.numel())}, reserve=room)
    assert total > room and all(m["offset"] >= room for k, m in enumerate(metas) if k != at and not m["is_inline"])
    metas = write_tensors(payload, tensors, metas)
    got = read_tensors(payload[:total], metas)
    first = unflatten(tree_json, tree_pickle, got)
    merged = merge_batches([first, hx.pad_collate(samples[1:])], rows=[1, 2], grow=_grower(got, metas))
    assert_same_batches([merged], [whole])
    assert merged["video"].data_ptr() == first["video"].data_ptr()  # grown in place: its rows never copied
    fresh = merge_batches([first, hx.pad_collate(samples[1:])], rows=[1, 2])  # without room: a fresh batch
    assert fresh["video"].data_ptr() != first["video"].data_ptr()
    past = (4, *whole["video"].shape[1:])  # a row more than the room: it would run into the tokens
    assert _grower(got, metas)(first["video"], past) is None
    assert _grower(got, metas)(first["tokens"], (3, 2000)) is None  # nothing was left room after them


def test_a_fanned_out_video_batch_grows_in_its_first_parts_slab_and_equals_pad_collate(kmix):
    """Past its deadline a batch fans out to several workers; its first part's worker leaves the
    others' rows' room in its slab (padded as the whole batch), so the merge copies only the later
    parts' rows: each batch the user holds holds exactly one slab (a fresh merge would hold none)."""
    video = hx.VideoClipDataset(kmix / "manifest.jsonl", num_frames=None, size=None)
    with hx.LocalCluster(local_servers=2, workers_per_server=2, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            video,
            batch_size=3,
            rank=0,
            world_size=1,
            coordinator=cluster.address,
            prefetch_depth=1,
            collate_fn=hx.pad_collate,
            config=CFG,
        ) as ld:
            got = []
            for _ in range(3):  # an epoch's first batch has no deadline yet; the later ones fan out
                for b in ld:
                    got.append(b)
                    ld.report_step_time(0.001)  # a 1 ms GPU window: every batch is due at once
            fanouts = ld.stats()["fanouts"]
            assert fanouts > 0
            want = [hx.pad_collate([video[i] for i in range(k, k + 3)]) for k in (0, 3)] * 3
            assert_same_batches(got, want)
            held = len(got)
            wait_for(lambda: len(busy_segments(cluster)) == held, 10, f"one slab per batch held ({fanouts} fanned out)")
            del got, b
        wait_for(lambda: not busy_segments(cluster), 10, "every slab released once the batches are dropped")
