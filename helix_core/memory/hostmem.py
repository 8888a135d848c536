"""Fresh host memory for the batches a rank assembles itself (a batch merged from its pieces, an
owned copy of a slab's tensors).

A large buffer comes from an anonymous mapping advised for transparent huge pages
(``MADV_HUGEPAGE``), aligned to a huge page. A fresh allocation is paid in first-touch page
faults, not in the copy: merging a batch of a few hundred MB from its pieces into ``torch.cat``'s
fresh memory faults every 4 KiB page, into such a mapping one fault per 2 MiB (the measured gap is
in docs/guide/data-plane.md). The kernel hands the mapping out zero-filled, so a padded merge needs no zeroing
pass of its own. The mapping is unmapped when the last array viewing it is freed (the tensor keeps
the ``mmap`` object alive). Small buffers, and systems without ``MADV_HUGEPAGE``, use the ordinary
allocators; where transparent huge pages are off (``never``) the advice is a no-op and the buffer
costs what ``torch.empty`` does.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import numpy as np
import torch

__all__ = ["HUGE_MIN_BYTES", "fresh_array", "fresh_tensor"]

HUGE_MIN_BYTES = 4 << 20  # below this a buffer comes from the allocator (its pages are mostly reused)
_HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages): a PMD
_ADVISE = getattr(mmap, "MADV_HUGEPAGE", None)


def _mapping(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """``(an anonymous zero-filled mapping, the offset of its first huge-page boundary)``, with
    room for ``nbytes`` from that offset; None where huge pages cannot be asked for."""
    if _ADVISE is None or nbytes < HUGE_MIN_BYTES:
        return None
    try:
        mm = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):  # no address space for it: the allocator will say so properly
        return None
    address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    offset = -address % _HUGE_PAGE
    try:
        mm.madvise(_ADVISE, offset, nbytes)  # offset: a multiple of the page size too
    except OSError:  # a kernel built without transparent huge pages: ordinary pages, still zero-filled
        pass
    return mm, offset


def fresh_tensor(shape, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """A new contiguous tensor of ``shape`` and ``dtype``; zero-filled when ``zero`` (always, when
    it is large enough for a huge-page mapping)."""
    count = math.prod(shape)
    mapped = _mapping(count * dtype.itemsize)
    if mapped is None:
        return torch.zeros(shape, dtype=dtype) if zero else torch.empty(shape, dtype=dtype)
    mm, offset = mapped
    return torch.frombuffer(mm, dtype=dtype, count=count, offset=offset).view(shape)


def fresh_array(shape, dtype, zero: bool = False) -> np.ndarray:
    """:func:`fresh_tensor` for numpy arrays."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    mapped = None if dtype.hasobject else _mapping(count * dtype.itemsize)  # references live in no mapping
    if mapped is None:
        return np.zeros(shape, dtype=dtype) if zero else np.empty(shape, dtype=dtype)
    mm, offset = mapped
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape)
