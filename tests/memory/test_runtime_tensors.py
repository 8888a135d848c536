"""Batch trees without pickle: flatten/unflatten, slab layout, zero-copy reads, streams, merging."""

from __future__ import annotations

import gc
import os
import secrets

import numpy as np
import pytest
import torch

from helix_core.memory import shm
from helix_core.memory import tensors as T
from helix_core.memory.merge import merge_batches
from helix_core.memory.reader import SlabReader
from helix_core.memory.slabpool import SlabPool
from helix_core.wire import chunks


@pytest.fixture
def pool():
    prefix = f"helix-test{os.getpid()}{secrets.token_hex(3)}-"
    with SlabPool(prefix) as p:
        yield p
    assert shm.sweep(prefix) == 0, f"/dev/shm segments leaked under {prefix}"


def _in_slab(pool, tensors):
    """layout -> a slab from ``pool`` -> write: what a worker does with a batch."""
    metas, total = T.layout(tensors)
    slab = pool.acquire(total)
    return slab, T.write_tensors(slab.payload, tensors, metas), total


def _roundtrip(batch, allow_pickle=False):
    """flatten -> layout -> write into a bytearray -> read -> unflatten."""
    tree_json, tree_pickle, tensors = T.flatten(batch, allow_pickle=allow_pickle)
    metas, total = T.layout(tensors)
    payload = bytearray(max(total, 1))
    metas = T.write_tensors(memoryview(payload), tensors, metas)
    return T.unflatten(tree_json, tree_pickle, T.read_tensors(payload, metas))


class _Clip:  # a custom object: only the pickle path can carry it
    def __init__(self, frames, tag):
        self.frames, self.tag = frames, tag


def test_nested_tree_roundtrip_keeps_types_values_and_dtypes():
    batch = {
        "video": torch.randint(0, 255, (2, 8, 3, 16, 16), dtype=torch.uint8),
        "label": torch.tensor([3, 7]),
        "meta": {"paths": ["a.mp4", "b.mp4"], "fps": 29.97, "n": 2, "ok": True, "none": None},
        "pair": (torch.ones(2, 2000), np.arange(12, dtype=np.float32).reshape(3, 4)),
        "bf": torch.randn(3000).to(torch.bfloat16),
        "mask": np.array([True, False]),
        "empty": torch.zeros(0, 5),
        "nested": [[1, "x"], ({"deep": torch.tensor(2.5)},)],
    }
    out = _roundtrip(batch)
    assert out.keys() == batch.keys()
    assert torch.equal(out["video"], batch["video"]) and torch.equal(out["label"], batch["label"])
    assert out["meta"] == batch["meta"]
    assert isinstance(out["pair"], tuple) and torch.equal(out["pair"][0], batch["pair"][0])
    assert isinstance(out["pair"][1], np.ndarray) and out["pair"][1].dtype == np.float32
    np.testing.assert_array_equal(out["pair"][1], batch["pair"][1])
    assert out["bf"].dtype == torch.bfloat16 and torch.equal(out["bf"], batch["bf"])
    np.testing.assert_array_equal(out["mask"], batch["mask"])
    assert out["empty"].shape == (0, 5)
    assert out["nested"][0] == [1, "x"] and isinstance(out["nested"][1], tuple)
    assert out["nested"][1][0]["deep"].item() == 2.5 and out["nested"][1][0]["deep"].shape == ()


@pytest.mark.parametrize(
    "dtype", ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"]
)
@pytest.mark.parametrize("numel", [7, 5000])  # inline and in the payload
def test_every_dtype_roundtrips(dtype, numel):
    t = (torch.arange(numel) % 3 == 0) if dtype == "bool" else (torch.arange(numel) % 100).to(getattr(torch, dtype))
    out = _roundtrip({"t": t.view(-1, 1)})["t"]
    assert out.dtype == t.dtype and out.shape == (numel, 1) and torch.equal(out.view(-1), t)


def test_non_contiguous_tensors_and_aliases():
    base = torch.arange(6000, dtype=torch.float32).view(60, 100)
    tree_json, _, tensors = T.flatten([base.t(), base.t()[::2], base])
    assert all(t.is_contiguous() for t in tensors)
    same = torch.ones(10)
    _, _, tensors = T.flatten({"a": same, "b": same})
    assert len(tensors) == 1  # the same tensor twice travels once
    out = _roundtrip([base.t(), base[:, ::3]])
    assert torch.equal(out[0], base.t()) and torch.equal(out[1], base[:, ::3])


def test_unsupported_leaves_raise_naming_the_path_without_pickle():
    with pytest.raises(TypeError, match=r'batch\["meta"\]\[2\] is bytes.*cloudpickle.*allow_pickle=False'):
        T.flatten({"meta": [1, 2, b"raw"]})
    with pytest.raises(TypeError, match=r"batch\[1\] is a int dict key"):
        T.flatten({1: "x"})
    with pytest.raises(TypeError, match=r'batch\["__t"\] is the reserved dict key'):
        T.flatten({"__t": 0})
    with pytest.raises(TypeError, match=r"batch\[0\]\[1\] is _Clip"):
        T.flatten([(1, _Clip(None, "x"))])
    with pytest.raises(TypeError, match=r'batch\["s"\] is ndarray of dtype <U1'):
        T.flatten({"s": np.array(["a", "b"])})


def test_pickle_path_keeps_tensors_out_of_the_pickle():
    frames = torch.randint(0, 255, (4, 64, 64), dtype=torch.uint8)
    batch = {"clip": _Clip(frames, tag=b"\x00raw"), "ids": {3: "three"}, "arr": np.ones(5000)}
    tree_json, tree_pickle, tensors = T.flatten(batch, allow_pickle=True)
    assert tree_json == "" and tree_pickle
    assert len(tensors) == 2 and len(tree_pickle) < frames.numel()  # the frames are not inside
    out = _roundtrip(batch, allow_pickle=True)
    assert isinstance(out["clip"], _Clip) and out["clip"].tag == b"\x00raw"
    assert torch.equal(out["clip"].frames, frames) and out["ids"] == {3: "three"}
    assert isinstance(out["arr"], np.ndarray) and out["arr"].sum() == 5000


def test_layout_packs_aligned_offsets_and_inlines_small_tensors():
    tensors = [
        torch.zeros(5000, dtype=torch.uint8),
        torch.zeros(3),
        torch.zeros(1025, dtype=torch.int32),
        torch.zeros(T.INLINE_BYTES, dtype=torch.uint8),
    ]
    metas, total = T.layout(tensors)
    assert [m["is_inline"] for m in metas] == [False, True, False, False]
    assert [m["offset"] for m in metas] == [0, 0, 5056, 9216]
    assert all(m["offset"] % 64 == 0 for m in metas)
    assert total == 9216 + T.INLINE_BYTES
    written = T.write_tensors(memoryview(bytearray(total)), tensors, metas)
    assert written[1]["inline_data"] == bytes(12) and "inline_data" not in metas[1]


def test_all_inline_batches_need_no_buffer_and_release_at_once():
    tree_json, _, tensors = T.flatten({"label": torch.tensor([1, 2, 3]), "w": torch.tensor(0.5)})
    metas, total = T.layout(tensors)
    assert total == 0 and all(m["is_inline"] for m in metas)
    metas = T.write_tensors(memoryview(bytearray(0)), tensors, metas)
    released = []
    out = T.unflatten(tree_json, b"", T.read_tensors(b"", metas, on_release=lambda: released.append(1)))
    assert released == [1]
    assert out["label"].tolist() == [1, 2, 3] and out["w"].item() == 0.5
    out["label"][0] = 9  # inline tensors own writable memory


def test_read_tensors_are_zero_copy_and_release_after_the_last_view(pool):
    video = torch.arange(1 << 16, dtype=torch.int32).view(256, 256)
    label = torch.arange(2000, dtype=torch.int64)
    _, _, tensors = T.flatten({"video": video, "label": label})
    slab, metas, total = _in_slab(pool, tensors)
    handle = slab.handle(total)
    reader = SlabReader()
    released = []
    out = T.read_tensors(reader.view(handle), metas, on_release=lambda: released.append(reader.release(handle)))
    assert torch.equal(out[0], video) and torch.equal(out[1], label)
    mm = reader.attach(handle.segment)
    at = shm.HEADER_BYTES + metas[0]["offset"]
    mm[at : at + 4] = (12345).to_bytes(4, "little")  # writing the mapping changes the tensor
    assert out[0][0, 0].item() == 12345
    row = out[0][3]  # a view outlives the list
    del out
    gc.collect()
    assert released == [] and not slab.free
    del row
    gc.collect()
    assert released == [True] and slab.free  # exactly once, and the server may reuse the slab
    gc.collect()
    assert released == [True]
    reader.close()


def test_release_fires_when_the_batch_dies_in_a_reference_cycle(pool):
    _, _, tensors = T.flatten([torch.ones(10_000)])
    slab, metas, total = _in_slab(pool, tensors)
    handle, reader = slab.handle(total), SlabReader()
    cycle = {"batch": T.read_tensors(reader.view(handle), metas, on_release=lambda: reader.release(handle))}
    cycle["self"] = cycle  # only the cycle collector can free it
    del cycle
    assert not slab.free
    gc.collect()
    assert slab.free
    reader.close()


def test_copy_tensors_owns_its_memory(pool):
    _, _, tensors = T.flatten([torch.ones(10_000)])
    slab, metas, total = _in_slab(pool, tensors)
    copies = T.copy_tensors(slab.payload[:total], metas)
    slab.payload[:total] = bytes(total)
    assert copies[0].sum().item() == 10_000


def test_read_tensors_checks_the_buffer_size():
    metas, _ = T.layout([torch.zeros(5000, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="buffer has 100"):
        T.read_tensors(bytearray(100), metas)


def test_chunks_roundtrip_and_overflow():
    data = secrets.token_bytes(10_000)
    parts = list(chunks.iter_chunks(memoryview(data), 9_999, chunk_bytes=4096))
    assert [len(c) for c in parts] == [4096, 4096, 1807] and all(type(c) is memoryview for c in parts)
    target = bytearray(9_999)
    writer = chunks.ChunkWriter(memoryview(target), 9_999)
    for c in parts:
        assert not writer.done
        writer.write(c)
    assert writer.done and bytes(target) == data[:9_999]
    with pytest.raises(ValueError, match="overflow"):
        writer.write(b"x")
    with pytest.raises(ValueError):
        list(chunks.iter_chunks(memoryview(data), 10_001))


def test_merge_batches_concatenates_and_pads():
    a = {
        "video": torch.ones(2, 3, 4),
        "ids": [0, 1],
        "pair": (5, 6),
        "arr": np.ones((2, 2)),
        "fps": 30.0,
        "inner": {"x": torch.tensor([1])},
    }
    b = {
        "video": torch.full((1, 5, 2), 2.0),
        "ids": [2],
        "pair": (7,),
        "arr": np.ones((1, 3)),
        "fps": 30.0,
        "inner": {"x": torch.tensor([2, 3])},
    }
    out = merge_batches([a, b])
    assert out["video"].shape == (3, 5, 4)
    assert out["video"][:2, :3, :].eq(1).all() and out["video"][:2, 3:].eq(0).all()
    assert out["video"][2, :, :2].eq(2).all() and out["video"][2, :, 2:].eq(0).all()
    assert out["ids"] == [0, 1, 2] and out["pair"] == (5, 6, 7)
    np.testing.assert_array_equal(out["arr"], [[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    assert out["fps"] == 30.0 and out["inner"]["x"].tolist() == [1, 2, 3]
    assert merge_batches([a]) is a


def _samples(kind: str, n: int):
    if kind == "tuple":  # (x, y) samples: default_collate gives an (X, Y) pair of columns
        return [(torch.full((3,), float(i)), i) for i in range(n)]
    if kind == "nested":  # dict samples with a caption, a pair and a nested dict
        return [
            {"x": torch.arange(i, i + 2), "caption": f"clip {i}", "pair": (i, [i, i]), "meta": {"fps": 30.0 + i}}
            for i in range(n)
        ]
    return [[torch.tensor([i]), f"p{i}"] for i in range(n)]  # list samples


@pytest.mark.parametrize("kind", ["tuple", "nested", "list"])
@pytest.mark.parametrize("parts", [[1, 1], [2, 2], [2, 1, 3]])
def test_merged_microbatches_equal_one_collated_batch(kind, parts):
    from torch.utils.data import default_collate

    samples = _samples(kind, sum(parts))
    bounds = np.cumsum([0, *parts])
    micro = [default_collate(samples[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    want, got = default_collate(samples), merge_batches(micro, rows=parts)
    assert type(got) is type(want)
    assert repr(got) == repr(want)


def test_merge_batches_keeps_per_sample_tensor_lists():
    a = [torch.zeros(16, 2), torch.zeros(16, 2)]  # a custom collate's list of per-sample clips
    b = [torch.ones(16, 2)]
    out = merge_batches([a, b], rows=[2, 1])
    assert isinstance(out, list) and len(out) == 3 and out[2].eq(1).all()
    same = merge_batches([[torch.zeros(16, 2)] * 2, [torch.ones(16, 2)] * 2], rows=[2, 2])
    assert len(same) == 4  # equal lengths, but 16 rows per part where 2 samples were asked: per-sample


def test_merge_batches_handles_namedtuples_and_collates_that_drop_samples():
    import collections

    from torch.utils.data import default_collate

    pair = collections.namedtuple("Pair", "x y")
    samples = [pair(torch.full((2,), float(i)), i) for i in range(4)]
    out = merge_batches([default_collate(samples[:2]), default_collate(samples[2:])], rows=[2, 2])
    assert type(out) is pair and out.x.shape == (4, 2) and out.y.tolist() == [0, 1, 2, 3]
    dropped = default_collate([(torch.zeros(3), 0)])  # a "filter out None" collate kept 1 of 2 samples
    full = default_collate([(torch.ones(3), 1), (torch.ones(3), 2)])
    x, y = merge_batches([dropped, full], rows=[2, 2])
    assert x.shape == (3, 3) and y.tolist() == [0, 1, 2]


def test_merge_batches_names_what_disagrees():
    with pytest.raises(ValueError, match="'mask'"):
        merge_batches([{"x": [1], "mask": [1]}, {"x": [2]}])
    with pytest.raises(ValueError, match=r"batch\['fps'\].*disagree"):
        merge_batches([{"fps": 30}, {"fps": 25}])
    with pytest.raises(ValueError, match="dtypes differ"):
        merge_batches([torch.zeros(1), torch.zeros(1, dtype=torch.int64)])
    with pytest.raises(ValueError, match="nothing to merge"):
        merge_batches([])


def test_transport_benchmark_runs_and_cleans_up():
    import io

    from rich.console import Console

    from helix_bench.micro.transport import bench_local_delivery

    rows = bench_local_delivery(sizes_mb=(1,), repeats=1, console=Console(file=io.StringIO()))
    assert rows[0]["size_mb"] == 1 and rows[0]["reused_gb_s"] > 0 and rows[0]["read_us"] > 0
    assert shm.list_segments(f"helix-bench{os.getpid()}") == []


def test_take_rows_gives_the_batch_collating_those_samples_would_give():
    from torch.utils.data import default_collate

    from helix_core.data.collate import pad_collate
    from helix_core.memory.merge import take_rows

    samples = [
        {
            "x": torch.full((3,), i),
            "index": i,
            "caption": f"c{i}",
            "pair": (torch.tensor(i), i * 2),
            "video": torch.ones(i + 1, 3, 2, 2, dtype=torch.uint8),
        }
        for i in range(4)
    ]
    plain = [{k: v for k, v in s.items() if k != "video"} for s in samples]
    got = take_rows(default_collate(plain), [2, 0], 4)
    want = default_collate([plain[2], plain[0]])
    assert got.keys() == want.keys() and got["caption"] == want["caption"]
    for k in ("x", "index"):
        assert torch.equal(got[k], want[k])
    assert all(torch.equal(a, b) for a, b in zip(got["pair"], want["pair"]))
    padded = take_rows(pad_collate(samples), [1], 4)  # the padding of the whole batch stays
    assert padded["video"].shape == (1, 4, 3, 2, 2) and padded["video_lengths"].tolist() == [2]
    assert padded["video"][0, :2].min() == 1 and padded["video"][0, 2:].max() == 0
    back = merge_batches([take_rows(default_collate(plain), [0, 1], 4), take_rows(default_collate(plain), [2, 3], 4)])
    assert torch.equal(back["x"], default_collate(plain)["x"]) and back["caption"] == ["c0", "c1", "c2", "c3"]


def test_rows_that_follow_each_other_are_read_in_place_and_copied_once_by_the_merge():
    from torch.utils.data import default_collate

    from helix_core.memory.merge import take_rows
    from helix_core.tier2.rank import consecutive_runs

    batch = default_collate([{"x": torch.full((3,), i), "caption": f"c{i}"} for i in range(4)])
    assert consecutive_runs([2, 3, 0, 1, 3]) == [[2, 3], [0, 1], [3]] and consecutive_runs([]) == []
    view = take_rows(batch, [1, 2], 4, view=True)
    assert view["x"].data_ptr() == batch["x"][1].data_ptr() and view["caption"] == ["c1", "c2"]  # no copy
    assert take_rows(batch, [2, 0], 4, view=True)["x"].data_ptr() != batch["x"][2].data_ptr()  # a copy
    merged = merge_batches([take_rows(batch, [3], 4, view=True), take_rows(batch, [0, 1], 4, view=True)], rows=[1, 2])
    batch["x"].zero_()  # the slab is handed out again: the merged batch is its own memory
    assert merged["x"][:, 0].tolist() == [3, 0, 1] and merged["caption"] == ["c3", "c0", "c1"]
