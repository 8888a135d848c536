"""Merging microbatches (or a batch's pieces) into the batch that collating all their samples at
once would give: tensors and arrays concatenated on dim 0, other dims zero-padded to the largest."""

from __future__ import annotations

import numpy as np
import torch

from helix_core.memory.hostmem import fresh_array, fresh_tensor

__all__ = ["merge_batches", "take_rows"]


def _pad_cat(parts: list, path: str, fresh, cat, pad: bool, grow=None):
    """``parts`` concatenated on dim 0 into ``fresh(shape, dtype, zero)`` memory (huge pages for a
    large batch: see ``hostmem``), other dims zero-padded to the largest when ``pad``; or into
    ``grow(parts[0], shape)``, when it gives one: a view of that shape whose first rows are
    ``parts[0]`` itself (memory reserved after it), so only the other parts are copied."""
    shapes = [tuple(p.shape) for p in parts]
    if any(len(s) != len(shapes[0]) for s in shapes) or not shapes[0]:
        raise ValueError(f"{path}: cannot concatenate arrays of shapes {shapes} along dim 0")
    if len({p.dtype for p in parts}) > 1:
        raise ValueError(f"{path}: dtypes differ across microbatches: {[p.dtype for p in parts]}")
    rows = sum(s[0] for s in shapes)
    same = all(s[1:] == shapes[0][1:] for s in shapes)
    if not same and not pad:
        raise ValueError(
            f"{path}: stack expects each tensor to be equal size, but the batch's samples have shapes "
            f"{shapes} across its parts (torch's default_collate raises here too; hx.pad_collate pads)"
        )
    rest = tuple(max(s[d] for s in shapes) for d in range(1, len(shapes[0])))
    out = grow(parts[0], (rows, *rest)) if grow is not None else None
    if out is not None:  # parts[0] is in place: the others' rows, their padding zeroed (the room held old bytes)
        row = shapes[0][0]
        for p in parts[1:]:
            dst = out[row : row + p.shape[0]]
            if tuple(p.shape[1:]) != rest:
                dst.zero_()
            dst[(slice(None), *(slice(0, n) for n in p.shape[1:]))] = p
            row += p.shape[0]
        return out
    if same:
        return cat(parts, out=fresh((rows, *shapes[0][1:]), parts[0].dtype, False))
    out = fresh((rows, *rest), parts[0].dtype, True)
    row = 0
    for p in parts:
        out[(slice(row, row + p.shape[0]), *(slice(0, n) for n in p.shape[1:]))] = p
        row += p.shape[0]
    return out


def _rows(x) -> int | None:
    """The leading (sample) dimension of a collated batch part, or None where it has none."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.shape[0] if x.ndim else None
    if isinstance(x, dict):
        rows = {_rows(v) for v in x.values()}
        return rows.pop() if len(rows) == 1 else None
    if isinstance(x, (list, tuple)):
        rows = _columns_rows(x)
        return len(x) if rows is None else rows
    return None


def _columns_rows(x: list | tuple) -> int | None:
    """If ``x`` is what ``default_collate`` makes of sequence samples (one collated column per
    field, all with the same number of rows), that number; else None (a list of per-sample values)."""
    if not x or not all(isinstance(c, (torch.Tensor, np.ndarray, dict, list, tuple)) for c in x):
        return None
    rows = {_rows(c) for c in x}
    return rows.pop() if len(rows) == 1 and None not in rows else None


def _are_columns(items: list, rows: list | None) -> bool:
    """Whether microbatch lists are collated columns (merge field by field) rather than per-sample
    values (concatenate): equal lengths, every element a collated part with one row count per
    microbatch. With ``rows`` (samples asked per microbatch), a list as long as its microbatch
    whose parts don't have that many rows is per-sample (clips of their own sizes); a collate that
    dropped samples still merges by column. Per-sample tensors whose first dimension equals the
    microbatch size look exactly like columns: keep such values in a dict or a padded tensor."""
    lead = [_columns_rows(x) for x in items]
    if len({len(x) for x in items}) != 1 or None in lead:
        return False
    if rows is None:
        return True
    per_sample_shaped = all(len(x) == r for x, r in zip(items, rows))
    return not per_sample_shaped or any(n == r for n, r in zip(lead, rows))


def _merge(items: list, path: str, rows: list | None, pad: bool, grow=None):
    first = items[0]
    if any(type(x) is not type(first) for x in items):
        raise ValueError(f"{path}: types differ across microbatches: {[type(x).__name__ for x in items]}")
    if isinstance(first, torch.Tensor):
        return _pad_cat(items, path, fresh_tensor, torch.cat, pad, grow)
    if isinstance(first, np.ndarray):
        return _pad_cat(items, path, fresh_array, np.concatenate, pad)
    if isinstance(first, (list, tuple)):
        if _are_columns(items, rows):  # (X, Y) batches of tuple samples: field by field, never (X1, Y1, X2, Y2)
            merged = [_merge([x[j] for x in items], f"{path}[{j}]", rows, pad, grow) for j in range(len(first))]
        else:  # per-sample values (captions, paths, clips of their own sizes): concatenate
            merged = [x for item in items for x in item]
        if type(first) is list:
            return merged
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)  # namedtuples too
    if isinstance(first, dict):
        for item in items[1:]:
            if item.keys() != first.keys():
                diff = sorted(map(repr, item.keys() ^ first.keys()))
                raise ValueError(f"{path}: microbatches have different keys: {', '.join(diff)}")
        return {k: _merge([item[k] for item in items], f"{path}[{k!r}]", rows, pad, grow) for k in first}
    if any(x != first for x in items[1:]):
        raise ValueError(f"{path}: microbatches disagree on a value that is not a batch: {items}")
    return first


def merge_batches(batches: list, rows: list[int] | None = None, pad: bool = True, grow=None):
    """One batch from microbatches of the same structure, equal to collating all their samples at
    once: tensors/arrays concatenated on dim 0 (other dims zero-padded to the largest), dicts merged
    key by key, equal scalars kept. A list or tuple is merged field by field when it is
    ``default_collate``'s batch of sequence samples (equal lengths, every element a collated column
    with the microbatch's row count — ``rows[k]`` samples for microbatch ``k`` when given), and
    concatenated when it holds per-sample values (strings, or tensors of their own sizes). Raises
    ValueError naming the path where the structures disagree — and, with ``pad=False``, where
    tensors differ beyond dim 0 (as ``default_collate`` of all the samples would). ``grow(tensor,
    shape)``: a view of ``shape`` that starts with the first batch's ``tensor`` in place, or None
    (the merge then makes fresh memory) — a split batch's first piece leaves room for the rest."""
    if not batches:
        raise ValueError("merge_batches([]): nothing to merge")
    if rows is not None and len(rows) != len(batches):
        raise ValueError(f"merge_batches: {len(rows)} row counts for {len(batches)} microbatches")
    return batches[0] if len(batches) == 1 else _merge(list(batches), "batch", rows, pad, grow)


def take_rows(batch, rows: list[int], n: int, view: bool = False):
    """Rows ``rows`` (in that order) of a collated ``batch`` of ``n`` samples, as the batch that
    collating just those samples would give (copies: nothing refers to ``batch`` afterwards;
    ``view``: rows that follow each other, ``a, a+1, ...``, are a view of ``batch`` instead),
    up to zero padding kept from ``batch``. The inverse of :func:`merge_batches`: tensors and
    arrays are indexed on dim 0, dicts key by key, ``default_collate``'s columns field by field,
    per-sample lists element by element; values that are not per sample are kept."""
    if isinstance(batch, (torch.Tensor, np.ndarray)) and batch.ndim:
        if view and rows and list(rows) == list(range(rows[0], rows[0] + len(rows))):
            return batch[rows[0] : rows[0] + len(rows)]
        if isinstance(batch, torch.Tensor):
            return batch[torch.as_tensor(rows, dtype=torch.long)]
        return batch[np.asarray(rows, dtype=np.int64)]
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch
    if isinstance(batch, dict):
        return {k: take_rows(v, rows, n, view) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        if _columns_rows(batch) == n:
            out = [take_rows(c, rows, n, view) for c in batch]
        elif len(batch) == n:
            out = [batch[i] for i in rows]
        else:
            return batch
        if type(batch) is list:
            return out
        return type(batch)(*out) if hasattr(batch, "_fields") else type(batch)(out)
    return batch
