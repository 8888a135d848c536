"""Fresh host memory for the batches a rank assembles (hostmem): large buffers on huge-page-advised
anonymous mappings — zero-filled, aligned, alive as long as any view — and merges into them equal
to torch's and numpy's own concatenation."""

import gc
import mmap

import numpy as np
import pytest
import torch

from helix_core.memory.hostmem import HUGE_MIN_BYTES, fresh_array, fresh_tensor
from helix_core.memory.merge import merge_batches
from helix_core.memory.tensors import copy_tensors, layout, write_tensors

LARGE = (3, 1024, 1024, 3)  # 9 MiB of uint8: over HUGE_MIN_BYTES


def test_a_large_tensor_is_zero_filled_aligned_and_outlives_the_name_that_made_it():
    t = fresh_tensor(LARGE, torch.uint8, zero=True)
    assert t.shape == LARGE and t.dtype == torch.uint8 and t.is_contiguous() and not t.any()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % (2 << 20) == 0  # starts on a huge page
    row = t[2]
    del t
    gc.collect()
    row.fill_(7)  # the mapping lives while a view does
    assert int(row.sum()) == 7 * row.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_a_tensor_has_the_asked_dtype_and_shape_large_or_small(dtype):
    for shape in [(4, 5), (HUGE_MIN_BYTES // 2, 2), (0, 3)]:
        t = fresh_tensor(shape, dtype, zero=True)
        assert t.shape == shape and t.dtype == dtype and not t.any()


def test_numpy_arrays_too_and_object_arrays_never_on_a_mapping():
    a = fresh_array(LARGE, np.float32, zero=True)
    assert a.shape == LARGE and a.dtype == np.float32 and not a.any() and a.flags.writeable
    o = fresh_array((3,), object)
    o[:] = ["a", {"b": 1}, None]  # references: an ordinary array
    assert o.tolist() == ["a", {"b": 1}, None]


def test_a_large_merge_equals_concatenation_and_a_padded_one_pads_with_zeros():
    g = torch.Generator().manual_seed(0)
    a = {
        "video": torch.randint(0, 255, (2, 8, 3, 256, 256), dtype=torch.uint8, generator=g),
        "index": torch.tensor([0, 1]),
    }
    b = {
        "video": torch.randint(0, 255, (3, 8, 3, 256, 256), dtype=torch.uint8, generator=g),
        "index": torch.tensor([2, 3, 4]),
    }
    m = merge_batches([a, b])
    assert torch.equal(m["video"], torch.cat([a["video"], b["video"]])) and m["index"].tolist() == [0, 1, 2, 3, 4]
    c = {"video": torch.randint(1, 255, (1, 8, 3, 300, 256), dtype=torch.uint8, generator=g)}
    p = merge_batches([{"video": a["video"]}, c])["video"]  # 8 x 300 x 256 against 8 x 256 x 256: padded
    assert p.shape == (3, 8, 3, 300, 256)
    assert torch.equal(p[:2, :, :, :256], a["video"]) and not p[:2, :, :, 256:].any()
    assert torch.equal(p[2], c["video"][0])
    x, y = np.random.default_rng(0).random((2, 700, 1000)), np.random.default_rng(1).random((1, 700, 1000))
    assert np.array_equal(merge_batches([x, y]), np.concatenate([x, y]))


def test_owned_copies_of_a_slabs_tensors_equal_them_and_do_not_share_its_memory():
    tensors = [torch.arange(3 << 20, dtype=torch.int32).reshape(3, -1), torch.tensor([1.5])]
    metas, nbytes = layout(tensors)
    buf = bytearray(nbytes)
    metas = write_tensors(memoryview(buf), tensors, metas)
    copies = copy_tensors(memoryview(buf), metas)
    assert all(torch.equal(c, t) for c, t in zip(copies, tensors))
    buf[:] = bytes(nbytes)  # the slab is reused: the copies keep their values
    assert torch.equal(copies[0], tensors[0])
