"""The Ray baselines on a tiny workload: idle-actor dispatch shared by ranks, zero-copy numpy
payloads, the exact DistributedSampler batches, process ids by role; ``ray-rr`` still works."""

import multiprocessing as mp
import os
import time
from types import SimpleNamespace

import psutil
import pytest
import torch

pytest.importorskip("ray")

from helix_bench.raypool import RayPool, ray_loader
from helix_core.data.specs import resolve
from helix_core.data.video import VideoClipDataset

RANKS, BATCH = 2, 2


def _plan(ds, info) -> SimpleNamespace:
    """The fields of the harness's RankPlan that a Ray loader reads."""
    return SimpleNamespace(ranks=RANKS, dataset=ds.helix_spec(), batch_size=BATCH, prefetch=3, seed=0, ray=info)


def _expected(n: int, rank: int, epochs) -> list[list[int]]:
    sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=RANKS, rank=rank, shuffle=True, seed=0)
    out = []
    for e in epochs:
        sampler.set_epoch(e)
        idx = list(sampler)
        out += [idx[i : i + BATCH] for i in range(0, len(idx), BATCH)]
    return out


def _consume(plan, rank, epochs, check=None) -> list[list[int]]:
    ds = resolve(plan.dataset["target"])(**plan.dataset["kwargs"])
    loader, set_epoch = ray_loader(plan, rank, ds)
    try:
        got = []
        for e in epochs:
            set_epoch(e)
            for batch in loader:
                assert isinstance(batch["index"], torch.Tensor) and isinstance(batch["tokens"], torch.Tensor)
                if check is not None:
                    check(batch)
                got.append(batch["index"].tolist())
        return got
    finally:
        loader.close()


def _rank_process(plan, rank, epochs, results) -> None:
    try:
        results.put(("ok", _consume(plan, rank, epochs)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put(("error", repr(e)))


def _mapping_of(address: int) -> str:
    """The file this process has mapped at ``address`` ("" for anonymous memory)."""
    for m in psutil.Process().memory_maps(grouped=False):
        lo, hi = (int(x, 16) for x in m.addr.split("-"))
        if lo <= address < hi:
            return m.path
    return ""


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_a_bad_mode_is_refused_before_ray_starts():
    with pytest.raises(ValueError, match="idle, rr"):
        RayPool(2, {}, mode="fifo")


@pytest.mark.timeout(120)
def test_idle_dispatch_serves_every_rank_its_sampler_batches_zero_copy(kmix):
    ds = VideoClipDataset(kmix / "manifest.jsonl", model="videomae")
    ctx = mp.get_context("spawn")
    results, proc = ctx.Queue(), None
    pool = RayPool(2, ds.helix_spec())
    try:
        info = pool.info()
        assert info["mode"] == "idle" and info["dispatcher"]
        pids = pool.pids()
        decoders, system = pids["ray-decoders"], pids["ray-system"]
        assert len(set(decoders)) == 2 and len(system) >= 2 and not set(decoders) & set(system)
        assert os.getpid() not in system and all(psutil.pid_exists(p) for p in decoders + system)
        plan = _plan(ds, info)
        proc = ctx.Process(target=_rank_process, args=(plan, 1, [0, 1], results), daemon=True)
        proc.start()  # rank 1 in a process of its own, rank 0 here: both share the dispatcher

        def zero_copy(batch):  # the tensors are the object store's pages, not copies
            assert "plasma" in _mapping_of(batch["video"].data_ptr())

        assert _consume(plan, 0, [0, 1], check=zero_copy) == _expected(len(ds), 0, [0, 1])
        status, got = results.get(timeout=90)
        assert status == "ok", got
        assert got == _expected(len(ds), 1, [0, 1])
    finally:
        if proc is not None:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        pool.close()
    assert _wait_gone(decoders + system) == []


@pytest.mark.timeout(120)
def test_round_robin_baseline_still_works(kmix):
    ds = VideoClipDataset(kmix / "manifest.jsonl", model="videomae")
    pool = RayPool(2, ds.helix_spec(), mode="rr")
    try:
        info = pool.info()
        assert info["mode"] == "rr" and info["dispatcher"] == ""

        def torch_payload(batch):
            assert batch["video"].dtype == torch.uint8 and batch["video"].dim() == 5

        assert _consume(_plan(ds, info), 0, [0], check=torch_payload) == _expected(len(ds), 0, [0])
        assert len(pool.pids()["ray-decoders"]) == 2
    finally:
        pool.close()
