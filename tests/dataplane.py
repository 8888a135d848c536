"""Helpers for data-plane tests: clusters with test timings, leak checks, torch references."""

from __future__ import annotations

import copy
import gc
import os
import stat
import time

import psutil
import torch
from torch.utils.data import DataLoader, DistributedSampler

import helix_core as hx
from helix_core.memory import shm

CFG = hx.ClusterConfig.for_tests()


def segments(cluster) -> list[str]:
    return shm.list_segments(f"helix-{cluster.cluster_id}-")


def busy_segments(cluster) -> list[str]:
    """Segments of the cluster whose header says a client still holds them."""
    return busy_with_prefix(f"helix-{cluster.cluster_id}-")


def busy_with_prefix(prefix: str) -> list[str]:
    """Segments named ``prefix*`` whose header says a client still holds them."""
    out = []
    for name in shm.list_segments(prefix):
        path = os.path.join(shm.SHM_DIR, name)
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                continue  # a decode-slot waiter's FIFO
            with open(path, "rb") as f:
                head = f.read(shm.HEADER_BYTES)
        except FileNotFoundError:
            continue
        if head[:8] == shm.MAGIC and int.from_bytes(head[16:24], "little") != shm.FREE:  # a slab (not a decode slot)
            out.append(name)
    return out


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gc.collect()
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def children() -> list[psutil.Process]:
    return [
        p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]


def torch_batches(ds, batch_size, rank, world_size, shuffle=False, seed=0, epoch=0, collate_fn=None, drop_last=False):
    if getattr(ds, "delays", None):  # a delay slows a sample and changes nothing in it: the reference needs none
        ds = copy.copy(ds)
        ds.delays = {}
    sampler = DistributedSampler(
        ds, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    sampler.set_epoch(epoch)
    return list(DataLoader(ds, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last))


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert torch.equal(a[k], b[k]), k
            else:
                assert a[k] == b[k], k


def helix_children() -> list:
    """This process's live Helix service processes (Coordinator, DataServers)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "helix_core.launch.process" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out
