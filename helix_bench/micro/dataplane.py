"""`python -m helix_bench.micro.dataplane`: the data plane's own figures, medians over repeats.

- **local**: shared-memory delivery on one host (``bench.transport.bench_local_delivery``).
- **remote**: a sidecar sends a batch to a local one (loopback), by the bulk path and
  by gRPC's ``Deliver`` stream. Stream GB/s = bytes / (wall of ``Execute(deliver_to=local)`` -
  wall of the same ``Execute`` delivered by the sidecar itself), i.e. with the produce time
  subtracted; also per call (each call's own worker time subtracted: steadier, since producing
  dwarfs streaming), end-to-end GB/s, and the receiving server's CPU per MB.
- **route**: Coordinator ``Route`` requests/s from N client threads and its decision time.
- **e2e**: R rank processes over a real kinetics-mixed workload, Helix (one shared LocalCluster)
  against torch ``DataLoader`` + ``DistributedSampler`` at the same total worker processes.

GB/s means 1e9 bytes per second; times are seconds unless a name ends in ``_us``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from helix_bench.micro.e2e import bench_e2e
from helix_bench.report.tables import print_rows
from helix_core.telemetry import percentile

__all__ = ["bench_remote", "bench_route", "main", "route_figures", "stream_figures"]

_MIB = 1 << 20
PARTS = ("local", "remote", "route", "e2e")


# ---- pure figures (tested on hand-made numbers) -----------------------------------------------------
def stream_figures(nbytes: int, remote_s, local_s, remote_exec_s=(), local_exec_s=()) -> dict:
    """Figures of one batch size from per-call wall times (seconds) of ``Execute`` streamed to
    another server (``remote_s``) and delivered by the producing server itself (``local_s``).

    ``stream_gb_s``: nbytes / (median remote - median local), NaN when that is not positive;
    ``e2e_gb_s``: nbytes / median remote; ``stream_per_call_gb_s``: per call, the remote wall minus
    that call's own worker time (``exec_s``) minus the median non-worker overhead of a local call —
    less noisy, as it does not depend on two independent produce times (NaN without exec times).
    """
    rm, lm = statistics.median(remote_s), statistics.median(local_s)
    stream_s = rm - lm
    out = {
        "size_mb": nbytes / _MIB,
        "bytes": nbytes,
        "remote_s": rm,
        "local_s": lm,
        "stream_s": stream_s,
        "stream_gb_s": nbytes / stream_s / 1e9 if stream_s > 0 else math.nan,
        "e2e_gb_s": nbytes / rm / 1e9,
        "stream_per_call_gb_s": math.nan,
        "repeats": len(remote_s),
    }
    if remote_exec_s and local_exec_s:
        overhead = statistics.median(w - e for w, e in zip(local_s, local_exec_s))
        per_call = statistics.median(w - e - overhead for w, e in zip(remote_s, remote_exec_s))
        out["stream_per_call_gb_s"] = nbytes / per_call / 1e9 if per_call > 0 else math.nan
    return out


def route_figures(threads: int, counts, seconds: float, decision_us, route_us=()) -> dict:
    """Routed requests/s of ``threads`` client threads that completed ``counts`` calls in
    ``seconds``; the Coordinator's decision time (µs, from the request's arrival at its handler to
    the reply, locks included) p50/p99; the round trip a client sees (µs) p50/p99."""
    n = sum(counts)
    return {
        "threads": threads,
        "requests": n,
        "seconds": seconds,
        "requests_per_s": n / seconds if seconds > 0 else 0.0,
        "scheduler_overhead_us_p50": percentile(decision_us, 50),
        "scheduler_overhead_us_p99": percentile(decision_us, 99),
        "route_us_p50": percentile(route_us, 50),
        "route_us_p99": percentile(route_us, 99),
    }


# ---- remote: one stream between two DataServers -------------------------------------------------------
def _execute(client, address: str, spec, task_id: int, batch: int, deliver_to: str, timeout_s: float):
    """Wall seconds and worker seconds of one ``Execute``; releases the batch's slab."""
    from helix_core.memory import shm
    from helix_core.wire.messages import slab_handle
    from helix_core.wire.proto import helix_pb2 as pb

    req = pb.ExecuteRequest(
        task_id=task_id,
        spec_id=spec[0],
        indices=list(range(batch)),
        epoch=0,
        on_error="raise",
        deliver_to=deliver_to,
        client_id=client.client_id,
    )
    t = time.perf_counter()
    reply = client.execute(address, spec, req).result(timeout=timeout_s)
    wall = time.perf_counter() - t
    if reply.batch.slab.segment:
        shm.release_segment(slab_handle(reply.batch.slab))
    if reply.error_kind:
        raise RuntimeError(f"Execute on {address} failed: {reply.error_kind} {reply.error}")
    if deliver_to and reply.cross_ds_bytes <= 0:
        raise RuntimeError(f"Execute on {address} with deliver_to={deliver_to} moved no bytes between servers")
    return wall, reply.exec_s, reply.cross_ds_bytes


def bench_remote(sizes_mb=(64, 256), sample_mb: int = 16, repeats: int = 5, console=None, progress=None) -> list[dict]:
    """Stream GB/s from a sidecar to a local one on loopback, per batch size (MiB;
    samples of ``sample_mb`` MiB) and per path: ``bulk`` (wire/bulk/common.py, into the slab) and
    ``grpc`` (the ``Deliver`` stream), each in a cluster of its own. One warm-up round per size,
    then ``repeats`` rounds, each a streamed and a local call on both clusters, so that machine
    noise hits all alike. See ``stream_figures``; ``recv_ms_per_mb``: the receiving DataServer's
    own CPU (all its threads) per MB streamed, the cost a GPU host pays for a sidecar's batch."""
    import contextlib

    import psutil

    from helix_core.config import ClusterConfig
    from helix_core.data.specs import make_spec
    from helix_core.launch.cluster import LocalCluster
    from helix_core.loader.cluster_client import ClusterClient
    from helix_core.testing.datasets import IndexDataset

    rows, ids = [], itertools.count(1)
    paths = ("bulk", "grpc")
    with contextlib.ExitStack() as stack:
        sides = {}
        for path in paths:
            config = ClusterConfig(bulk_delivery=path == "bulk")
            cluster = stack.enter_context(
                LocalCluster(local_servers=1, remote_servers=1, workers_per_server=1, config=config)
            )
            client = ClusterClient(cluster.address, cluster.token, config, 0, 1)
            stack.callback(client.close)
            sides[path] = (
                client,
                cluster.servers[0].address,
                cluster.servers[1].address,
                psutil.Process(cluster.servers[0].pid),
                config,
            )
        task = progress.add_task("remote stream", total=len(sizes_mb) * (repeats + 1)) if progress else None
        for mb in sizes_mb:
            batch = max(1, mb // sample_mb)
            calls = {p: [] for p in paths}  # (streamed wall, its exec_s, local wall, its exec_s, bytes, recv CPU-s)
            for _ in range(repeats + 1):
                for path in paths:
                    client, local, remote, receiver, config = sides[path]
                    spec = make_spec(IndexDataset(batch, (sample_mb * _MIB,)), None, client.pickle_allowed)
                    c0 = sum(receiver.cpu_times()[:2])
                    streamed = _execute(client, remote, spec, next(ids), batch, local, config.execute_timeout_s)
                    recv_cpu = sum(receiver.cpu_times()[:2]) - c0
                    calls[path].append(
                        streamed[:2]
                        + _execute(client, remote, spec, next(ids), batch, "", config.execute_timeout_s)[:2]
                        + streamed[2:]
                        + (recv_cpu,)
                    )
                if progress:
                    progress.advance(task)
            for path in paths:
                rs, re_, ls, le, moved, recv = zip(*calls[path][1:])  # the first round loads, first-touches slabs
                row = stream_figures(moved[-1], rs, ls, re_, le)
                row.update(path=path, recv_ms_per_mb=statistics.median(recv) * 1e3 / (moved[-1] / 1e6))
                rows.append(row)
    print_rows(
        console,
        f"Remote stream, remote → local DataServer on loopback (medians of {repeats})",
        [
            "path",
            "MiB",
            "stream GB/s (median diff)",
            "stream GB/s (per call)",
            "end-to-end GB/s",
            "receiver CPU ms/MB",
            "streamed s",
            "local s",
        ],
        [
            [
                r["path"],
                f"{r['size_mb']:.0f}",
                f"{r['stream_gb_s']:.2f}",
                f"{r['stream_per_call_gb_s']:.2f}",
                f"{r['e2e_gb_s']:.2f}",
                f"{r['recv_ms_per_mb']:.2f}",
                f"{r['remote_s']:.3f}",
                f"{r['local_s']:.3f}",
            ]
            for r in rows
        ],
    )
    return rows


# ---- route: Coordinator throughput -----------------------------------------------------------------------
def _add_candidates(cluster, n: int, config) -> None:
    """Register ``n`` placeholder sidecars (TEST-NET addresses nobody dials) so that each
    placement decision scores as many candidates as a large cluster would."""
    from helix_core.security.auth import call_metadata
    from helix_core.wire.proto import helix_pb2 as pb
    from helix_core.wire.proto import helix_pb2_grpc as pbg
    from helix_core.wire.rpc import connect

    channel = connect(cluster.address, config)
    try:
        stub = pbg.CoordinatorStub(channel)
        for i in range(n):
            stub.RegisterServer(
                pb.RegisterServerRequest(
                    address=f"192.0.2.{1 + i % 254}:{1 + i // 254}",
                    kind="remote",
                    local_rank=-1,
                    host="bench-placeholder",
                    workers=1,
                ),
                timeout=config.rpc_timeout_s,
                metadata=call_metadata(cluster.token),
            )
    finally:
        channel.close()


def bench_route(
    threads=(1, 4, 16),
    seconds: float = 3.0,
    candidates: int = 64,
    console=None,
    progress=None,
    schedulers=("least-request", "deadline"),
) -> list[dict]:
    """Routed requests/s from N threads sharing one client for ``seconds`` each, against a
    Coordinator with ``candidates`` servers (1 real local one plus placeholders), per placement
    policy (the deadline policy's requests carry a predicted cost and a deadline)."""
    from helix_core.config import ClusterConfig
    from helix_core.data.descriptors import CostProfile
    from helix_core.launch.cluster import LocalCluster
    from helix_core.loader.cluster_client import ClusterClient
    from helix_core.wire.messages import Part

    config = ClusterConfig(heartbeat_timeout_s=3600.0)  # placeholders send no heartbeats: keep them alive
    rows, ids = [], itertools.count(1)
    with LocalCluster(local_servers=1, workers_per_server=1, config=config) as cluster:
        _add_candidates(cluster, max(0, candidates - 1), config)
        client = ClusterClient(cluster.address, None, config, 0, 1)
        try:
            client.route(Part(next(ids), [0]))  # warm the channel
            cost = CostProfile(cpu_s=0.1, io_bytes=1 << 20, out_bytes=16 << 20, tokens=1568, profile="16x224x224")
            task = progress.add_task("route", total=len(threads) * len(schedulers)) if progress else None
            for sched, n in itertools.product(schedulers, threads):
                counts, decisions, trips, errors = [0] * n, [[] for _ in range(n)], [[] for _ in range(n)], []
                deadline = time.perf_counter() + seconds
                budget = 0.5 if sched == "deadline" else None

                def loop(k: int) -> None:
                    try:
                        while time.perf_counter() < deadline:
                            t0 = time.perf_counter()
                            reply = client.route(Part(next(ids), [0], cost), budget, sched)
                            trips[k].append((time.perf_counter() - t0) * 1e6)
                            decisions[k].append(reply.decision_us)
                            counts[k] += 1
                    except Exception as e:  # re-raised below, naming the thread count
                        errors.append(e)

                pool = [
                    threading.Thread(target=loop, args=(k,), name=f"bench-route-{k}", daemon=True) for k in range(n)
                ]
                t0 = time.perf_counter()
                for t in pool:
                    t.start()
                for t in pool:
                    t.join(timeout=seconds + config.coordinator_timeout_s + 5)
                    if t.is_alive():
                        raise RuntimeError(f"a route thread did not finish within {seconds} s + timeouts")
                if errors:
                    raise RuntimeError(f"Route failed with {n} threads: {errors[0]!r}") from errors[0]
                rows.append(
                    {
                        "scheduler": sched,
                        **route_figures(
                            n,
                            counts,
                            time.perf_counter() - t0,
                            [d for ds in decisions for d in ds],
                            [t for ts in trips for t in ts],
                        ),
                    }
                )
                if progress:
                    progress.advance(task)
            tele = client.telemetry()
            for r in rows:
                r["candidates"] = len(tele["servers"])
            # the Coordinator's own window (its last 10,000 decisions), as a cross-check of the last row
            rows[-1].update(
                telemetry_us_p50=tele["scheduler_overhead_us_p50"], telemetry_us_p99=tele["scheduler_overhead_us_p99"]
            )
        finally:
            client.close()
    print_rows(
        console,
        f"Coordinator Route, {rows[0]['candidates']} candidate servers ({seconds:g} s per row)",
        [
            "scheduler",
            "threads",
            "requests/s",
            "decision µs p50",
            "decision µs p99",
            "client route µs p50",
            "client route µs p99",
        ],
        [
            [
                r["scheduler"],
                str(r["threads"]),
                f"{r['requests_per_s']:.0f}",
                f"{r['scheduler_overhead_us_p50']:.1f}",
                f"{r['scheduler_overhead_us_p99']:.1f}",
                f"{r['route_us_p50']:.0f}",
                f"{r['route_us_p99']:.0f}",
            ]
            for r in rows
        ],
    )
    return rows


# ---- command line --------------------------------------------------------------------------------
def _plain(obj):
    """JSON-safe copy: NaN and infinities become null."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def _parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"--only {text!r}: valid parts are {', '.join(PARTS)} (comma-separated)")
    return parts


def main(argv=None) -> dict:
    """Run the selected parts; print their tables; return (and with ``--out`` write as JSON)
    ``{"local": [...], "remote": [...], "route": [...], "e2e": [...], "meta": {...}}``."""
    from rich.console import Console
    from rich.progress import Progress

    from helix_bench.micro.transport import bench_local_delivery

    p = argparse.ArgumentParser(
        prog="python -m helix_bench.micro.dataplane",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", type=_parts, default=list(PARTS), help=f"comma-separated parts of {','.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="small sizes and counts (a smoke run, not a measurement)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per size (local, remote)")
    p.add_argument("--route-seconds", type=float, default=3.0, help="seconds per thread count (route)")
    p.add_argument("--route-candidates", type=int, default=64, help="servers the Coordinator scores per decision")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts (e2e)")
    p.add_argument("--workers", type=int, default=2, help="total worker processes W (e2e)")
    p.add_argument("--clips", type=int, default=24, help="kinetics-mixed clips (e2e)")
    p.add_argument("--data", type=Path, default=Path("~/.cache/helix/bench-dataplane"), help="workload cache folder")
    p.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = p.parse_args(argv)
    if min(args.repeats, args.route_candidates, args.clips, args.workers, *args.ranks) < 1 or args.route_seconds <= 0:
        p.error("--repeats, --route-candidates, --ranks, --clips, --workers must be >= 1 and --route-seconds > 0")

    q = args.quick
    console = Console(width=None if sys.stdout.isatty() else 150)
    figures: dict = {
        "meta": {
            "argv": list(sys.argv[1:] if argv is None else argv),
            "quick": q,
            "cpus": os.cpu_count(),
            "parts": args.only,
        }
    }
    with Progress(console=console, transient=True) as progress:
        if "local" in args.only:
            figures["local"] = bench_local_delivery((4, 16) if q else (16, 64, 256), 2 if q else args.repeats, console)
        if "remote" in args.only:
            figures["remote"] = bench_remote(
                (16,) if q else (64, 256), 4 if q else 16, 2 if q else args.repeats, console, progress
            )
        if "route" in args.only:
            figures["route"] = bench_route(
                (1, 4) if q else (1, 4, 16), 0.5 if q else args.route_seconds, args.route_candidates, console, progress
            )
        if "e2e" in args.only:
            figures["e2e"] = bench_e2e(
                (2,) if q else tuple(args.ranks),
                args.workers,
                4 if q else args.clips,
                2,
                args.data,
                console=console,
                progress=progress,
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(_plain(figures), indent=2) + "\n")
        console.print(f"figures written to {args.out}")
    return figures


if __name__ == "__main__":
    main()
