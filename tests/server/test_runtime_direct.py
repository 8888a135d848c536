"""Batches decoded straight into their shared-memory slab equal the generic path byte for byte."""

import json

import pytest
import torch
from conftest import write_manifest
from dataplane import CFG, torch_batches
from torch.utils.data import default_collate

import helix_core as hx
from helix_core.memory.slabpool import SlabPool
from helix_core.memory.tensors import read_tensors, unflatten
from helix_core.server.direct import direct_batch, supports_direct


def _read(slab, total, tree_json, metas):
    tensors = [t.clone() for t in read_tensors(slab.payload[:total], metas)]
    return unflatten(tree_json, b"", tensors)


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def test_decoded_in_place_equals_collating_decoded_samples(kmix, tmp_path):
    mixed = hx.VideoClipDataset(kmix / "manifest.jsonl")  # S / M / L clips: videos of three shapes
    flipped = hx.VideoClipDataset(kmix / "manifest.jsonl", num_frames=4, size=32, random_flip=1.0)
    with SlabPool(f"helix-test-direct-{tmp_path.name[-8:]}-") as pool:
        for ds, collate, idx in (
            (mixed, hx.pad_collate, [0, 1, 2]),
            (flipped, default_collate, [3, 4]),
            (flipped, hx.pad_collate, [5, 0]),
        ):
            assert supports_direct(ds, collate)
            slab, total, tree_json, _, metas, cpu, _, reads = direct_batch(ds, collate, idx, pool, allow_pickle=False)
            _same(_read(slab, total, tree_json, metas), collate([ds[i] for i in idx]))
            assert len(cpu) == len(idx) and all(c > 0 for c in cpu)
            assert reads == [(0, 0.0)] * len(idx)  # local files: nothing fetched from storage
            slab.release()
        # slabs are reused: stale bytes of a bigger batch must not leak into the padding
        slab, total, tree_json, _, metas, _, _, _ = direct_batch(
            mixed, hx.pad_collate, [0, 3], pool, allow_pickle=False
        )
        _same(_read(slab, total, tree_json, metas), hx.pad_collate([mixed[0], mixed[3]]))
        slab.release()
        # what the direct path can't do goes back to the generic path, holding nothing
        assert direct_batch(mixed, default_collate, [0, 1], pool, allow_pickle=False) is None  # shapes differ
        busy = pool.stats()["busy"]
        assert busy == 0


def test_a_bad_clip_is_its_sample_error_read_once_and_holds_no_slab(kmix, tmp_path):
    """The slab path raises a bad sample's error (no slab held) and the task reports it without
    reading the clip again (a remote one that times out would take its timeout twice)."""
    from helix_core.server.worker import _run_task
    from helix_core.wire.messages import ErrorKind

    records = [json.loads(line) for line in (kmix / "manifest.jsonl").read_text().splitlines()]
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    records[1] = {**records[1], "path": str(tmp_path / "broken.mp4")}
    for r in records:
        r["path"] = str(kmix / r["path"]) if not r["path"].startswith("/") else r["path"]
    ds = hx.VideoClipDataset(write_manifest(tmp_path, records), profiles=False)
    opened = []
    probe = ds.descriptor
    ds.descriptor = lambda i: (opened.append(i), probe(i))[1]
    with SlabPool(f"helix-test-direct-bad-{tmp_path.name[-8:]}-") as pool:
        with pytest.raises(hx.SampleError, match="broken.mp4"):
            direct_batch(ds, hx.pad_collate, [0, 1], pool, allow_pickle=False)
        assert pool.stats()["busy"] == 0
        opened.clear()
        task = {"task_id": 1, "spec_id": "s", "indices": [0, 1], "epoch": 0}
        got = _run_task(task, {"s": (ds, hx.pad_collate, None)}, pool, None, False, lambda k: True)
        assert got.error_kind == ErrorKind.SAMPLE and got.failure.index == 1 and got.failure.path.endswith("broken.mp4")
        assert opened.count(1) == 1 and pool.stats()["busy"] == 0


def test_a_cluster_delivers_variable_shapes_exactly_as_torch(kmix):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl")
    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=CFG) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=3, coordinator=cluster.address, rank=0, world_size=1, collate_fn=hx.pad_collate, config=CFG
        ) as ld:
            got = list(ld)
    want = torch_batches(ds, 3, 0, 1, collate_fn=hx.pad_collate)
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        _same(a, b)


def test_tier2_features_are_taken_from_the_samples_decoded_in_place(kmix, tmp_path):
    """A batch that carries Tier-2 features decodes into its slab too (no copy out of worker
    memory): the features are what ``feature_fn`` gives on the generic path, the batch is the same,
    and a ``feature_fn`` that raises sends the batch to the generic path holding nothing."""
    from helix_core.server.worker import sample_features
    from helix_core.tier2.rebalance import default_features

    ds = hx.VideoClipDataset(kmix / "manifest.jsonl")

    def frames(sample):
        return {"frames": int(sample["video"].shape[0]), "sum": int(sample["video"][:, 0, 0, 0].sum())}

    def featurize(fn):
        return lambda samples, decoded: sample_features(samples, decoded, fn, ds)

    idx = [2, 0, 1]
    with SlabPool(f"helix-test-direct-feat-{tmp_path.name[-8:]}-") as pool:
        for fn in (None, frames):
            slab, total, tree_json, _, metas, _, features, _ = direct_batch(
                ds, hx.pad_collate, idx, pool, allow_pickle=False, featurize=featurize(fn)
            )
            samples = [ds[i] for i in idx]
            assert features == [(fn or default_features)(s) for s in samples]
            _same(_read(slab, total, tree_json, metas), hx.pad_collate(samples))
            slab.release()

        def broken(sample):
            raise RuntimeError("no features today")

        def replaces(sample):  # a feature_fn that swaps the video: the generic path collates what it made
            sample["video"] = sample["video"].flip(0)
            return {}

        assert direct_batch(ds, hx.pad_collate, idx, pool, allow_pickle=False, featurize=featurize(broken)) is None
        assert pool.stats()["busy"] == 0
        assert (
            direct_batch(ds, default_collate, [0, 0], pool, allow_pickle=False, featurize=featurize(replaces)) is None
        )
        assert pool.stats()["busy"] == 0


def test_a_feature_fn_that_raises_is_a_sample_error_naming_the_sample_and_holds_no_slab(kmix, tmp_path):
    """Through the worker's own task code: the slab path gives way to the generic one, which names
    the sample and the policy's function; a good ``feature_fn`` gives the batch with its features."""
    from helix_core.memory.shm import release_segment
    from helix_core.server.worker import _run_task
    from helix_core.wire.messages import ErrorKind

    ds = hx.VideoClipDataset(kmix / "manifest.jsonl")

    def picky(sample):
        if int(sample["index"]) == 4:
            raise ValueError("index 4 has no features")
        return {"frames": int(sample["video"].shape[0])}

    with SlabPool(f"helix-test-direct-task-{tmp_path.name[-8:]}-") as pool:
        task = {"task_id": 1, "spec_id": "s", "indices": [3, 4], "epoch": 0, "features": True}
        got = _run_task(task, {"s": (ds, hx.pad_collate, picky)}, pool, None, False, lambda k: True)
        assert got.error_kind == ErrorKind.SAMPLE and got.failure.index == 4
        assert "Rebalance.feature_fn" in got.error and "index 4 has no features" in got.error
        assert pool.stats()["busy"] == 0
        got = _run_task(
            {**task, "indices": [3, 5]}, {"s": (ds, hx.pad_collate, picky)}, pool, None, False, lambda k: True
        )
        assert got.features == [{"frames": int(ds[i]["video"].shape[0])} for i in (3, 5)] and got.rows == 2
        assert pool.stats()["busy"] == 1  # the batch's slab, until its reader releases it
        release_segment(got.handle)
        assert pool.stats()["busy"] == 0


def test_a_task_holds_its_decode_slot_only_while_its_samples_decode(kmix, tmp_path):
    """The host's decode slot is a core: a worker takes it before its first sample's decode and
    gives it back as soon as its last one is decoded, so collating and writing its batch (direct
    path, and a custom collate's generic path) run while another worker decodes."""
    from helix_core.memory.shm import release_segment
    from helix_core.server.worker import _run_task

    events = []

    class Slot:
        held = False

        def enter(self):
            if not self.held:
                events.append("enter")
            self.held = True

        def leave(self):
            if self.held:
                events.append("leave")
            self.held = False

    class Logged(hx.VideoClipDataset):
        def fetch(self, index, out=None):
            assert slot.held, "decoded without the slot"
            events.append("decode")
            return super().fetch(index, out)

    def collate(samples):
        assert not slot.held, "collated holding the slot"
        events.append("collate")
        return hx.pad_collate(samples)

    ds = Logged(kmix / "manifest.jsonl")
    with SlabPool(f"helix-test-direct-slot-{tmp_path.name[-8:]}-") as pool:
        for fn in (hx.pad_collate, collate):  # the slab path, then the generic one
            slot, events[:] = Slot(), []
            task = {"task_id": 1, "spec_id": "s", "indices": [3, 5], "epoch": 0}
            got = _run_task(task, {"s": (ds, fn, None)}, pool, None, False, lambda k: True, slot)
            assert got.rows == 2, got
            assert events[:4] == ["enter", "decode", "decode", "leave"] and not slot.held
            release_segment(got.handle)
