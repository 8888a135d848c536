"""Collation for variable-shape video batches."""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

__all__ = ["pad_collate"]


def pad_collate(batch: list[dict], pad_token_id: int = 0, video_out: torch.Tensor | None = None) -> dict:
    """Collate samples whose ``"video"`` differ in T, H or W, and whose ``"input_ids"`` differ in
    length, by zero-padding at the end of each dimension.

    Returns ``"video"`` uint8 [B, T_max, 3, H_max, W_max] with ``"video_lengths"`` (frames per
    sample), ``"video_sizes"`` ([B, 2]: H, W per sample) and ``"video_mask"`` (bool [B, T_max]:
    True on real frames); ``"input_ids"`` padded with ``pad_token_id`` plus ``"attention_mask"``.
    Every other key goes through torch's ``default_collate``.

    ``video_out``: a preallocated [B, T, 3, H, W] tensor to collate the videos into (a DataServer
    worker passes one in shared memory), at least T_max, H_max, W_max: the videos are padded to its
    size (``video_mask`` has its T columns); a sample's video that already is its slot's view
    (decoded in place) is not copied, and only the padding is zeroed.
    """
    if not batch:
        raise ValueError("pad_collate got an empty batch")
    out = {}
    rest = [{k: v for k, v in s.items() if k not in ("video", "input_ids")} for s in batch]
    if rest[0]:
        out.update(default_collate(rest))
    if "video" in batch[0]:
        vids = [s["video"] for s in batch]
        t, c, h, w = (max(v.shape[d] for v in vids) for d in range(4))
        if video_out is None:
            video = vids[0].new_zeros((len(vids), t, c, h, w))
        else:
            got = tuple(video_out.shape)
            fits = len(got) == 5 and got[0] == len(vids) and got[2] == c and got[1] >= t and got[3] >= h and got[4] >= w
            if not fits or video_out.dtype != vids[0].dtype:
                raise ValueError(
                    f"pad_collate: video_out is {got} {video_out.dtype}, the batch needs at least "
                    f"{(len(vids), t, c, h, w)} {vids[0].dtype}"
                )
            video = video_out
            t = got[1]
        for i, v in enumerate(vids):
            slot = video[i, : v.shape[0], :, : v.shape[2], : v.shape[3]]
            if video_out is not None:
                _zero_padding(video[i], v.shape)
                if slot.data_ptr() == v.data_ptr() and slot.stride() == v.stride():
                    continue  # decoded in place
            slot.copy_(v)
        lengths = torch.tensor([v.shape[0] for v in vids], dtype=torch.int64)
        out["video"] = video
        out["video_lengths"] = lengths
        out["video_sizes"] = torch.tensor([[v.shape[2], v.shape[3]] for v in vids], dtype=torch.int64)
        out["video_mask"] = torch.arange(t)[None, :] < lengths[:, None]
    if "input_ids" in batch[0]:
        ids = [torch.as_tensor(s["input_ids"]) for s in batch]
        n = max(len(x) for x in ids)
        padded = torch.full((len(ids), n), pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(ids), n), dtype=torch.int64)
        for i, x in enumerate(ids):
            padded[i, : len(x)] = x
            mask[i, : len(x)] = 1
        out["input_ids"], out["attention_mask"] = padded, mask
    return out


def _zero_padding(dst: torch.Tensor, shape) -> None:
    """Zero what lies outside ``shape`` = (t, c, h, w) in one sample's padded [T, C, H, W] slot."""
    t, _, h, w = shape
    dst[t:].zero_()
    dst[:t, :, h:].zero_()
    dst[:t, :, :h, w:].zero_()
