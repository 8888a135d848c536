"""`python -m helix_bench.micro.transport`: how fast a batch moves through a shared-memory slab on
one host. Per tensor size: write_tensors into a reused slab (GB/s), into a fresh slab each time
(GB/s, creating the segment included: tmpfs page allocation is the first-touch cost), and the
client's attach + read_tensors on an already cached mapping (microseconds). Medians over repeats.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time

import torch

from helix_core.memory import shm
from helix_core.memory.reader import SlabReader
from helix_core.memory.slabpool import SlabPool
from helix_core.memory.tensors import layout, read_tensors, write_tensors

__all__ = ["bench_local_delivery", "main"]


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _one_size(prefix: str, size_mb: int, repeats: int) -> dict:
    nbytes = size_mb << 20
    tensors = [torch.full((nbytes,), 7, dtype=torch.uint8)]  # filled: its pages are resident
    metas, total = layout(tensors)
    with SlabPool(prefix) as pool:
        slab = pool.acquire(total)
        write_tensors(slab.payload, tensors, metas)  # warm: the pages exist from now on
        reused = []
        for _ in range(repeats):
            slab.release()
            again = pool.acquire(total)
            assert again is slab, "the pool should reuse the released slab"
            t = time.perf_counter()
            write_tensors(slab.payload, tensors, metas)
            reused.append(time.perf_counter() - t)

        reader = SlabReader()
        handle = slab.handle(total)
        read_tensors(reader.attach(handle.segment), metas)  # caches the mapping
        reads, releases = [], []
        for _ in range(max(20, repeats * 20)):  # microsecond timings: more samples
            released = []
            t = time.perf_counter()
            mm = reader.attach(handle.segment)
            out = read_tensors(
                memoryview(mm)[shm.HEADER_BYTES : shm.HEADER_BYTES + total],
                metas,
                on_release=lambda: released.append(reader.release(handle)),
            )
            reads.append(time.perf_counter() - t)
            t = time.perf_counter()
            del out  # no reference cycles: the finalizer runs here, not at a later gc
            releases.append(time.perf_counter() - t)
            assert released == [True]
        reader.close()

    fresh = []
    for _ in range(repeats):
        with SlabPool(prefix) as pool:  # a new segment each time, unlinked right after
            t = time.perf_counter()
            slab = pool.acquire(total)
            write_tensors(slab.payload, tensors, metas)
            fresh.append(time.perf_counter() - t)
    return {
        "size_mb": size_mb,
        "reused_gb_s": _gbps(nbytes, reused),
        "fresh_gb_s": _gbps(nbytes, fresh),
        "read_us": statistics.median(reads) * 1e6,
        "release_us": statistics.median(releases) * 1e6,
    }


def bench_local_delivery(sizes_mb=(16, 64, 256), repeats: int = 5, console=None) -> list[dict]:
    """One dict per size: size_mb (MiB), reused_gb_s and fresh_gb_s (1e9 bytes/s),
    read_us and release_us (microseconds). Prints a table; leaves nothing in /dev/shm."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    prefix = f"helix-bench{os.getpid()}{secrets.token_hex(3)}-"
    try:
        rows = [_one_size(prefix, mb, repeats) for mb in sizes_mb]
    finally:
        shm.sweep(prefix)
    table = Table(
        title=f"Helix local delivery through /dev/shm (one uint8 tensor, medians of {repeats}; "
        f"torch threads: {torch.get_num_threads()})"
    )
    for col in ("MiB", "write, reused slab GB/s", "write, fresh slab GB/s", "attach+read µs", "release µs"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["size_mb"]),
            f"{r['reused_gb_s']:.1f}",
            f"{r['fresh_gb_s']:.1f}",
            f"{r['read_us']:.1f}",
            f"{r['release_us']:.1f}",
        )
    console.print(table)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m helix_bench.micro.transport", description=__doc__)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256], help="tensor sizes (MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    bench_local_delivery(tuple(args.sizes_mb), args.repeats)


if __name__ == "__main__":
    main()
