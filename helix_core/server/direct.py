"""Batches decoded straight into their shared-memory slab (the worker side of zero-copy delivery).

The generic path decodes each sample into memory of its own, collates (a copy into a freshly
allocated, zero-filled batch tensor) and writes the batch into a slab (a second copy) — for a
batch of two 64-frame 448² clips that is a hundred-odd MB of page faults and copies, CPU taken from
decoding. When the dataset can tell a sample's video shape before decoding it (``video_shape``)
and decode into a given array (``fetch(index, out=)``), and the collate function is torch's
``default_collate`` or ``hx.pad_collate`` (whose result we can lay out in advance), the worker
reserves the batch's slab first, decodes every clip straight into its slot (a reused, already
mapped slab: no page faults either) and collates the small fields only. The result is byte for
byte what the generic path gives; anything unexpected (a transform that changed a shape) returns
None so the caller takes the generic path, which reports errors as usual. A bad sample raises its
``SampleError`` (the slab given back) so the generic path reports it without reading it again (a
remote clip that times out would take its timeout twice).
"""

from __future__ import annotations

import logging
import time

import torch
from torch.utils.data import default_collate

from helix_core.data.collate import pad_collate
from helix_core.data.contract import DirectDecode
from helix_core.errors import SampleError
from helix_core.memory.tensors import flatten, layout, write_tensors

__all__ = ["direct_batch", "getitem_is_fetch", "storage_reads", "supports_direct"]

log = logging.getLogger("helix.workers")
_said: list = []  # a feature_fn that fails in place is said once per worker, not once per batch


def _said_once(e: Exception) -> None:
    if not _said:
        _said.append(e)
        log.warning(
            "feature_fn failed on a batch decoded in its slab (%s: %s): such batches decode again the generic "
            "way. feature_fn sees each sample's video as a strided view of the batch's slab (non-contiguous "
            "where clips differ in size): use .reshape, not .view",
            type(e).__name__,
            e,
        )


HEADROOM = 1 << 20  # slab bytes reserved for the batch's other non-inline tensors


def supports_direct(dataset, collate) -> bool:
    """The collate is one whose layout we know, and the dataset decodes into given memory
    (``video_shape``, ``fetch(index, out=)``) with a ``__getitem__`` that is ``fetch``'s."""
    return collate in (default_collate, pad_collate) and getitem_is_fetch(dataset)


def getitem_is_fetch(dataset) -> bool:
    """The dataset has ``fetch`` (``DirectDecode``) and its ``__getitem__`` is ``fetch``'s sample:
    a subclass that overrides ``__getitem__`` below the class defining ``fetch`` is read by
    ``dataset[i]``, or its override would be skipped."""
    if not isinstance(dataset, DirectDecode):
        return False
    mro = type(dataset).__mro__
    definer = {name: next(i for i, cls in enumerate(mro) if name in cls.__dict__) for name in ("__getitem__", "fetch")}
    return definer["__getitem__"] >= definer["fetch"]


def storage_reads(measured) -> tuple[int, float]:
    """``(bytes fetched from storage, seconds waited for them)`` of one sample, from the
    measurements its ``fetch`` returned (``Decoded``); ``(0, 0.0)`` where it reports none."""
    try:
        return max(int(getattr(measured, "read_bytes", 0) or 0), 0), max(
            float(getattr(measured, "read_s", 0.0) or 0.0), 0.0
        )
    except (TypeError, ValueError):  # a user dataset's own measurements, of another shape
        return 0, 0.0


def direct_batch(
    dataset,
    collate,
    indices: list[int],
    pool,
    allow_pickle: bool,
    progress=lambda index: None,
    may_start=lambda k: True,
    featurize=None,
    room=(),
    decoding=None,
):
    """``(slab, total, tree_json, tree_pickle, metas, decode_cpu_s, features, reads)`` with the
    batch written in ``slab``, or None when this batch needs the generic path (nothing is held
    then); ``reads``: each decoded sample's ``storage_reads``.
    ``progress(index)`` is called before each sample is decoded; ``may_start(k)`` says whether
    sample ``k`` is still this worker's (when not, the batch is the samples before it).
    ``featurize(samples, indices)`` (Tier 2's features) sees the samples decoded in place, before
    the collate; ``features`` is its list, or None without it. One that raises sends the batch to
    the generic path, which names the sample. ``room``: the samples of the batch's later parts
    (fan-out): the slab keeps their rows' room after these, the video padded as the whole batch's.
    ``decoding``: the task's host decode slot (``worker.DecodeSlot``; None: no cap), held from the first sample's
    decode to the last one's only."""
    try:
        shapes = [tuple(int(x) for x in dataset.video_shape(i)) for i in indices]
        later = [tuple(int(x) for x in dataset.video_shape(i)) for i in room]
    except SampleError as e:
        if e.index in indices:
            raise  # this batch's sample: the generic path reports it
        return None  # a later part's: that part meets it
    except Exception:
        return None
    if collate is default_collate and len(set(shapes)) > 1:
        return None  # the generic path raises default_collate's own error
    if collate is default_collate and len(set(shapes + later)) > 1:
        later = []  # the merge raises default_collate's error: no room for rows that cannot stack
    b = len(indices) + len(later)
    t, c, h, w = (max(s[d] for s in shapes + later) for d in range(4))
    video_bytes = b * t * c * h * w
    try:
        slab = pool.acquire(video_bytes + HEADROOM)
    except Exception:
        return None  # the generic path reports it
    try:
        got = _fill(
            dataset,
            collate,
            indices,
            shapes,
            slab,
            (b, t, c, h, w),
            allow_pickle,
            progress,
            may_start,
            featurize,
            decoding,
        )
    except SampleError:
        slab.release()
        raise
    except Exception:
        got = None
    if got is None:
        slab.release()
        return None
    return (slab, *got)


def _fill(dataset, collate, indices, shapes, slab, dims, allow_pickle, progress, may_start, featurize, decoding):
    b, t, c, h, w = dims
    video_bytes = b * t * c * h * w
    payload = torch.frombuffer(slab.payload, dtype=torch.uint8)
    video = payload[:video_bytes].view(dims)
    samples, cpu, slots, reads = [], [], [], []
    for k, (index, shape) in enumerate(zip(indices, shapes)):
        if not may_start(k):  # the rest was stolen: the batch is the samples before it
            break
        slot = video[k, : shape[0], :, : shape[2], : shape[3]]
        if decoding is not None:
            decoding.enter()
        progress(index)
        c0 = time.thread_time()
        sample, measured = dataset.fetch(index, out=slot.numpy())
        cpu.append(time.thread_time() - c0)
        reads.append(storage_reads(measured))
        v = sample.get("video") if isinstance(sample, dict) else None
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != torch.uint8:
            return None
        if v.data_ptr() != slot.data_ptr():  # a transform made a new tensor: one copy into place
            slot.copy_(v)
        sample["video"] = slot
        samples.append(sample)
        slots.append(slot)
    if decoding is not None:
        decoding.leave()  # the rest (features, collate, layout) leaves the core to another decode
    features = None
    if featurize is not None:
        try:
            features = featurize(samples, [int(i) for i in indices[: len(samples)]])
        except Exception as e:  # the generic path decodes again and names the sample, or works
            _said_once(e)
            return None
        if any(s.get("video") is not slot for s, slot in zip(samples, slots)):
            return None  # feature_fn replaced a video: the generic path collates what it made
    # a batch stopped short keeps the whole batch's padded size (the merge pads the other pieces to
    # it), and the room of its missing rows: its small tensors go after the whole batch's video, so
    # the client grows the video in place with the other pieces' rows (one copy of theirs, none of these)
    room = video.numel()
    video = video[: len(samples)]
    video_bytes = video.numel()
    if collate is pad_collate:
        batch = pad_collate(samples, video_out=video)
    else:
        rest = default_collate([{k: v for k, v in s.items() if k != "video"} for s in samples])
        batch = {k: (video if k == "video" else rest[k]) for k in samples[0]}
    del samples, slots
    tree_json, tree_pickle, tensors = flatten(batch, allow_pickle=allow_pickle)
    at = [k for k, x in enumerate(tensors) if x.data_ptr() == video.data_ptr() and x.shape == video.shape]
    if len(at) != 1:
        return None
    metas, total = layout(tensors, pinned={at[0]: (0, video_bytes)}, reserve=room)
    if total > len(slab.payload):
        return None
    metas = write_tensors(slab.payload, tensors, metas)
    del batch, tensors, video, payload
    return total, tree_json, tree_pickle, metas, cpu, features, reads
