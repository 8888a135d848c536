"""Batch trees without pickle: split a collated batch into a JSON structure and a list of tensors,
lay the tensors out in a slab payload, and map them back zero-copy on the client.

A batch is a tree of dict (str keys) / list / tuple / torch.Tensor / numpy array / str / int /
float / bool / None. The tree travels as JSON with placeholders (`{"__t": i}` for tensor i,
`{"__t": i, "np": true}` for a numpy array, `{"__tuple": [...]}` for a tuple); anything else needs
cloudpickle, which only an authenticated cluster reached over loopback or TLS allows (`allow_pickle=True`).
Tensor metas match the `TensorMeta` message: dtype, shape, offset, nbytes, is_inline, inline_data.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from helix_core.errors import PICKLING
from helix_core.memory.hostmem import fresh_tensor

__all__ = ["INLINE_BYTES", "copy_tensors", "flatten", "layout", "read_tensors", "unflatten", "write_tensors"]

INLINE_BYTES = 4096  # tensors smaller than this (bytes) travel inside the message
_ALIGN = 64  # payload offsets of non-inline tensors (bytes): cache-line and any dtype's alignment

_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bool",
    )
    if hasattr(torch, name)
}
_JSON_SCALARS = (str, int, float, bool, type(None))
_RESERVED_KEYS = ("__t", "__tuple")


class _Unsupported(Exception):
    def __init__(self, path: str, what: str):
        self.path, self.what = path, what


def _dtype_name(t: torch.Tensor) -> str | None:
    name = str(t.dtype).removeprefix("torch.")
    return name if name in _DTYPES else None


def _as_plain_tensor(obj) -> tuple[torch.Tensor, bool] | None:
    """(contiguous CPU tensor, came from numpy) for tensors and arrays we can ship, else None."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            return None
        try:
            # a read-only array would make torch warn on every batch; copying it is cheap by comparison
            t = torch.from_numpy(np.ascontiguousarray(obj) if obj.flags.writeable else obj.copy())
        except TypeError:
            return None  # a dtype torch lacks (e.g. strings)
        return (t, True) if _dtype_name(t) else None
    if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and _dtype_name(obj):
        return obj.detach().cpu().resolve_conj().resolve_neg().contiguous(), False
    return None


class _Extractor:
    """Collects tensors in visiting order; the same object twice shares one entry (aliasing kept)."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self._keep: list = []  # keeps visited objects alive so their id() stays unique

    def ref(self, obj) -> tuple[int, bool] | None:
        found = self._index.get(id(obj))
        if found is not None:
            return found, isinstance(obj, np.ndarray)
        plain = _as_plain_tensor(obj)
        if plain is None:
            return None
        self._index[id(obj)] = len(self.tensors)
        self._keep.append(obj)
        self.tensors.append(plain[0])
        return len(self.tensors) - 1, plain[1]


def _to_json_tree(obj, path: str, ex: _Extractor):
    kind = type(obj)
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        ref = ex.ref(obj)
        if ref is None:
            raise _Unsupported(path, f"{kind.__name__} of dtype {obj.dtype}")
        return {"__t": ref[0], "np": True} if ref[1] else {"__t": ref[0]}
    if kind in _JSON_SCALARS:  # exact types: an IntEnum or a str subclass would come back changed
        return obj
    if kind is list:
        return [_to_json_tree(v, f"{path}[{i}]", ex) for i, v in enumerate(obj)]
    if kind is tuple:
        return {"__tuple": [_to_json_tree(v, f"{path}[{i}]", ex) for i, v in enumerate(obj)]}
    if kind is dict:
        out = {}
        for k, v in obj.items():
            if type(k) is not str:
                raise _Unsupported(f"{path}[{k!r}]", f"a {type(k).__name__} dict key (keys must be str)")
            if k in _RESERVED_KEYS:
                raise _Unsupported(f"{path}[{json.dumps(k)}]", f"the reserved dict key {k!r}")
            out[k] = _to_json_tree(v, f"{path}[{json.dumps(k)}]", ex)
        return out
    raise _Unsupported(path, kind.__qualname__)


def _pickle_tree(batch, ex: _Extractor) -> bytes:
    """cloudpickle `batch` with every tensor/array, wherever it sits (even inside custom objects),
    replaced by a reference into `ex.tensors`, so tensors still travel as raw bytes."""
    import io

    import cloudpickle

    class _Pickler(cloudpickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, (torch.Tensor, np.ndarray)):
                return ex.ref(obj)  # None: pickle it normally
            return None

    buf = io.BytesIO()
    _Pickler(buf).dump(batch)
    return buf.getvalue()


def flatten(batch, allow_pickle: bool = False) -> tuple[str, bytes, list[torch.Tensor]]:
    """(tree_json, tree_pickle, tensors): exactly one of tree_json / tree_pickle is non-empty.
    Raises TypeError naming the path of the first leaf JSON cannot carry unless `allow_pickle`."""
    ex = _Extractor()
    try:
        return json.dumps(_to_json_tree(batch, "batch", ex), separators=(",", ":")), b"", ex.tensors
    except _Unsupported as e:
        if not allow_pickle:
            raise TypeError(
                f"{e.path} is {e.what}, which Helix can only send with cloudpickle: use "
                f"{PICKLING} or return plain "
                f"types (dict/list/tuple/tensor/ndarray/str/int/float/bool/None)"
            ) from None
    ex = _Extractor()
    return "", _pickle_tree(batch, ex), ex.tensors


def _from_json_tree(node, tensors: list):
    if type(node) is list:
        return [_from_json_tree(v, tensors) for v in node]
    if type(node) is dict:
        if "__t" in node:
            t = tensors[node["__t"]]
            return t.numpy() if node.get("np") else t
        if "__tuple" in node:
            return tuple(_from_json_tree(v, tensors) for v in node["__tuple"])
        return {k: _from_json_tree(v, tensors) for k, v in node.items()}
    return node


def unflatten(tree_json: str, tree_pickle: bytes, tensors: list):
    """The batch `flatten` split. Unpickles (arbitrary code!) only when tree_json is empty; the
    caller decides whether its peer may send pickles."""
    if tree_json:
        return _from_json_tree(json.loads(tree_json), tensors)
    import io
    import pickle

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            index, was_numpy = pid
            return tensors[index].numpy() if was_numpy else tensors[index]

    return _Unpickler(io.BytesIO(tree_pickle)).load()


def layout(
    tensors: list[torch.Tensor], pinned: dict[int, tuple[int, int]] | None = None, reserve: int = 0
) -> tuple[list[dict], int]:
    """(metas, payload bytes): non-inline tensors packed in order at 64-byte-aligned offsets.
    ``pinned``: ``{tensor position: (offset, nbytes)}`` of tensors already written in place in the
    payload (decoded straight into it); the others are packed after them, and after ``reserve``
    bytes (room for a pinned tensor to grow into: a batch whose other rows come in a piece)."""
    pinned = pinned or {}
    metas, end = [], max((off + n for off, n in pinned.values()), default=0)
    end = max(end, reserve)
    for k, t in enumerate(tensors):
        if k in pinned:
            name = _dtype_name(t)
            metas.append(
                {
                    "dtype": name,
                    "shape": list(t.shape),
                    "offset": pinned[k][0],
                    "nbytes": pinned[k][1],
                    "is_inline": False,
                }
            )
            continue
        name = _dtype_name(t)
        if name is None:
            raise TypeError(f"tensor dtype {t.dtype} is not one of {sorted(_DTYPES)}")
        nbytes = t.numel() * t.element_size()
        inline = nbytes < INLINE_BYTES
        offset = 0 if inline else -(-end // _ALIGN) * _ALIGN
        if not inline:
            end = offset + nbytes
        metas.append({"dtype": name, "shape": list(t.shape), "offset": offset, "nbytes": nbytes, "is_inline": inline})
    return metas, end


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def write_tensors(payload: memoryview, tensors: list[torch.Tensor], metas: list[dict]) -> list[dict]:
    """Copy non-inline tensors into `payload` at their offsets (one memcpy-speed torch copy each);
    returns the metas with `inline_data` (bytes) filled for inline tensors."""
    out = []
    dst = None
    for t, meta in zip(tensors, metas, strict=True):
        meta = dict(meta)
        if meta["is_inline"]:
            meta["inline_data"] = _bytes_of(t).numpy().tobytes()
        else:
            if dst is None:
                dst = torch.frombuffer(payload, dtype=torch.uint8)
            off, n = meta["offset"], meta["nbytes"]
            if off + n > dst.numel():
                raise ValueError(f"tensor needs payload bytes [{off}, {off + n}); the payload has {dst.numel()}")
            if not (n and t.data_ptr() == dst[off:].data_ptr()):  # else already in place (decoded into it)
                dst[off : off + n].copy_(_bytes_of(t))
        out.append(meta)
    return out


def _typed(flat_u8: torch.Tensor, meta: dict) -> torch.Tensor:
    return flat_u8.view(_DTYPES[meta["dtype"]]).view(meta["shape"])


def _inline_tensor(meta: dict) -> torch.Tensor:
    data = meta.get("inline_data", b"")
    if meta["nbytes"] == 0:
        return torch.empty(meta["shape"], dtype=_DTYPES[meta["dtype"]])
    if len(data) != meta["nbytes"]:
        raise ValueError(f"inline tensor carries {len(data)} bytes, its meta says {meta['nbytes']}")
    return _typed(torch.frombuffer(bytearray(data), dtype=torch.uint8), meta)


def read_tensors(buffer, metas: list[dict], on_release: Callable[[], Any] | None = None) -> list[torch.Tensor]:
    """Tensors viewing `buffer` (a writable mmap/memoryview of the payload) without copying.

    `on_release()` runs exactly once, when the last tensor or view sharing the buffer has been
    garbage-collected (in whichever thread drops it: keep it short and thread-safe); at once when
    every tensor is inline. This is how a client frees a slab only after the user dropped the batch.
    """
    spans = [(m["offset"], m["offset"] + m["nbytes"]) for m in metas if not m["is_inline"]]
    base_t = None
    if spans:
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        if hi > len(buffer):
            raise ValueError(f"metas need buffer bytes [{lo}, {hi}); the buffer has {len(buffer)}")
        # to the buffer's end: a tensor may grow into room left after it (``merge_batches(grow=)``)
        base = np.frombuffer(buffer, dtype=np.uint8, count=len(buffer) - lo, offset=lo)
        if on_release is not None:
            # torch.from_numpy keeps `base` alive as long as any tensor shares its memory
            weakref.finalize(base, on_release)
        base_t = torch.from_numpy(base)
        del base
    out = [
        _inline_tensor(m) if m["is_inline"] else _typed(base_t[m["offset"] - lo : m["offset"] - lo + m["nbytes"]], m)
        for m in metas
    ]
    if base_t is None and on_release is not None:
        on_release()
    return out


def copy_tensors(buffer, metas: list[dict]) -> list[torch.Tensor]:
    """Owned copies of the tensors (e.g. to pin or stage on a device); the caller may release the
    slab as soon as this returns."""
    return [
        t if m["is_inline"] else fresh_tensor(t.shape, t.dtype).copy_(t)
        for t, m in zip(read_tensors(buffer, metas), metas)
    ]
