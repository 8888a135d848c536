"""The data plane's e2e figures: R rank processes over a real kinetics-mixed workload, Helix (one
shared LocalCluster) against torch ``DataLoader`` + ``DistributedSampler`` at the same total
worker processes (``python -m helix_bench.micro.dataplane --only e2e``)."""

from __future__ import annotations

import math
import statistics
import time
import traceback
from pathlib import Path

from helix_bench.report.tables import print_rows
from helix_core.telemetry import percentile

__all__ = ["bench_e2e", "e2e_figures"]


def e2e_figures(system: str, ranks: int, workers: int, results: list[dict]) -> dict:
    """One system's epoch from its ranks' results (each: ``waits_s`` per ``next()``, ``wall_s``,
    ``samples``). Epoch wall = the slowest rank (synchronous training waits for it); samples/s =
    all ranks' samples / that wall; input-wait percentiles pool every step; ``first_wait_s``: the
    median over ranks of the first ``next()`` (native: spawning its workers; helix: first decode).
    ``steady_samples_per_s`` leaves the first batch out (start-up), for a fair comparison."""
    waits = [w for r in results for w in r["waits_s"]]
    wall = max(r["wall_s"] for r in results)
    samples = sum(r["samples"] for r in results)
    steady_wall = max((r["wall_s"] - r["waits_s"][0]) if r["waits_s"] else 0.0 for r in results)
    steady = samples - sum(r.get("first_samples", 0) for r in results)
    return {
        "system": system,
        "ranks": ranks,
        "workers": workers,
        "samples": samples,
        "epoch_wall_s": wall,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "steps": len(waits),
        "steady_samples_per_s": steady / steady_wall if steady_wall > 0 else math.nan,
        "input_wait_p50_s": percentile(waits, 50),
        "input_wait_p95_s": percentile(waits, 95),
        "first_wait_s": statistics.median(r["waits_s"][0] for r in results if r["waits_s"]) if waits else math.nan,
        "cross_ds_bytes": sum(r.get("cross_ds_bytes", 0) for r in results),
    }


# ---- e2e: rank processes, Helix against torch DataLoader ----------------------------------------------
def _rank_main(
    system: str,
    rank: int,
    ranks: int,
    manifest: str,
    address: str,
    workers: int,
    batch_size: int,
    results,
    barrier,
    timeout_s: float,
) -> None:
    """One rank process: build its loader, wait for every rank, time each ``next()`` of an epoch,
    and put ``{"rank", "waits_s", "wall_s", "samples", ...}`` (or ``{"rank", "error"}``) on ``results``."""
    try:
        import torch
        from torch.utils.data import DataLoader, DistributedSampler

        import helix_core as hx

        ds = hx.VideoClipDataset(manifest, model="videomae")
        if system == "helix":
            loader = hx.DistributedDataLoader(
                ds,
                batch_size,
                rank=rank,
                world_size=ranks,
                coordinator=address,
                shuffle=True,
                seed=0,
                collate_fn=hx.pad_collate,
            )
        else:
            loader = DataLoader(
                ds,
                batch_size,
                sampler=DistributedSampler(ds, ranks, rank, shuffle=True, seed=0),
                num_workers=workers,
                collate_fn=hx.pad_collate,
                persistent_workers=False,
                prefetch_factor=2,
                multiprocessing_context="spawn",
            )
        torch.set_num_threads(1)
        barrier.wait(timeout=timeout_s)
        waits, samples, first = [], 0, 0
        t0 = time.perf_counter()
        it = iter(loader)  # native spawns its workers here: part of its epoch, as with persistent_workers=False
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t)
            samples += int(batch["video"].shape[0])
            first = first or samples
            del batch
        wall = time.perf_counter() - t0
        extra = loader.stats() if system == "helix" else {}
        if system == "helix":
            loader.close()
        results.put(
            {
                "rank": rank,
                "waits_s": waits,
                "wall_s": wall,
                "samples": samples,
                "first_samples": first,
                "cross_ds_bytes": extra.get("cross_ds_bytes", 0),
            },
            timeout=timeout_s,
        )
    except BaseException:
        barrier.abort()  # the other ranks stop waiting for this one at once
        results.put({"rank": rank, "error": traceback.format_exc()}, timeout=timeout_s)


def _run_ranks(
    system: str, ranks: int, manifest: str, address: str, workers: int, batch_size: int, timeout_s: float
) -> list[dict]:
    """Start ``ranks`` spawned rank processes (released together by a barrier), collect their
    results within ``timeout_s``, failing fast when a rank dies; every process is joined (or
    killed) before returning."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    results, barrier = ctx.Queue(), ctx.Barrier(ranks)
    procs = [
        ctx.Process(
            target=_rank_main,
            name=f"bench-{system}-rank{r}",  # not daemonic: native ranks have workers
            args=(system, r, ranks, manifest, address, workers, batch_size, results, barrier, timeout_s),
        )
        for r in range(ranks)
    ]
    try:
        for p in procs:
            p.start()
        out, deadline = {}, time.monotonic() + timeout_s
        while len(out) < ranks:
            try:
                res = results.get(timeout=1.0)
            except queue.Empty:
                # an exited rank has flushed its result already: still nothing means it died
                gone = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in out]
                if gone or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{system}: ranks {gone or 'all'} sent no result (exit codes / timeout {timeout_s:.0f} s)"
                    ) from None
                continue
            if "error" in res:
                raise RuntimeError(f"{system} rank {res['rank']} failed:\n{res['error']}")
            out[res["rank"]] = res
        return [out[r] for r in range(ranks)]
    finally:
        barrier.abort()  # ranks still waiting (a failed start) raise instead of hanging
        for p in (p for p in procs if p.pid is not None):  # started ones
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        results.close()


def _workload(data_dir: Path, clips: int) -> Path:
    """The cached kinetics-mixed workload (scale 0.5) with its profile table; returns the manifest."""
    from helix_core.data.media.synth import make_dataset
    from helix_core.data.profiles import profile_dataset

    root = make_dataset(data_dir / f"kinetics-mixed-{clips}", "kinetics-mixed", clips, seed=0, scale=0.5, progress=True)
    manifest = root / "manifest.jsonl"
    if not (root / "profiles.jsonl").exists():  # the folder's clips are fixed by its name and seed 0
        profile_dataset(manifest, calibrate_per_bucket=1, progress=True)
    return manifest


def bench_e2e(
    ranks=(2, 4),
    workers: int = 2,
    clips: int = 24,
    batch_size: int = 2,
    data_dir: Path = Path("~/.cache/helix/bench-dataplane"),
    timeout_s: float = 600.0,
    console=None,
    progress=None,
) -> list[dict]:
    """One epoch per system and rank count; one row per (ranks, system), plus the helix/native
    samples/s ratio on the helix row. ``workers``: total worker processes W, i.e. max(1, W // R)
    per rank (native) or per local DataServer (helix)."""
    from helix_core.launch.cluster import LocalCluster

    manifest = str(_workload(Path(data_dir).expanduser(), clips))
    rows = []
    task = progress.add_task("e2e epochs", total=2 * len(ranks)) if progress else None
    for r in ranks:
        per = max(1, workers // r)
        native = e2e_figures("native", r, per * r, _run_ranks("native", r, manifest, "", per, batch_size, timeout_s))
        if progress:
            progress.advance(task)
        with LocalCluster(local_servers=r, workers_per_server=per) as cluster:
            helix = e2e_figures(
                "helix", r, per * r, _run_ranks("helix", r, manifest, cluster.address, per, batch_size, timeout_s)
            )
        if progress:
            progress.advance(task)
        helix["throughput_vs_native"] = (
            helix["samples_per_s"] / native["samples_per_s"] if native["samples_per_s"] else math.nan
        )
        helix["steady_vs_native"] = (
            helix["steady_samples_per_s"] / native["steady_samples_per_s"]
            if native["steady_samples_per_s"]
            else math.nan
        )
        rows += [native, helix]
    print_rows(
        console,
        f"End to end, one epoch of {clips} kinetics-mixed clips (scale 0.5, videomae, batch {batch_size})",
        [
            "ranks",
            "system",
            "workers",
            "epoch s",
            "samples/s",
            "wait p50 s",
            "wait p95 s",
            "1st wait s",
            "cross-DS MB",
            "vs native",
            "steady samples/s",
            "steady vs native",
        ],
        [
            [
                str(x["ranks"]),
                x["system"],
                str(x["workers"]),
                f"{x['epoch_wall_s']:.2f}",
                f"{x['samples_per_s']:.2f}",
                f"{x['input_wait_p50_s']:.3f}",
                f"{x['input_wait_p95_s']:.3f}",
                f"{x['first_wait_s']:.2f}",
                f"{x['cross_ds_bytes'] / 1e6:.1f}",
                f"{x['throughput_vs_native']:.2f}x" if "throughput_vs_native" in x else "-",
                f"{x['steady_samples_per_s']:.2f}",
                f"{x['steady_vs_native']:.2f}x" if "steady_vs_native" in x else "-",
            ]
            for x in rows
        ],
    )
    return rows
