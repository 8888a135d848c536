"""The ``helix`` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from helix_core.config import cache_dir
from helix_core.launch.cluster_cli import add_cluster_commands

__all__ = ["main"]


def _print_profile(table, console) -> None:
    from rich.table import Table

    t = Table(title=f"profile table: {len(table)} clips, fit from {table.fit.points} calibration decodes")
    for col in ("bucket", "clips", "frames", "size", "MB", "cost scale"):
        t.add_column(col, justify="right" if col != "bucket" else "left")
    for row in table.summary():
        if row["bucket"] == "(failed)":
            t.add_row("[red](failed)", str(row["clips"]), "", "", "", "")
            continue
        t.add_row(
            row["bucket"],
            str(row["clips"]),
            f"{row['frames']:.0f}",
            f"{row['width']:.0f}x{row['height']:.0f}",
            f"{row['mb']:.2f}",
            f"{row['cost_scale']:.2f}",
        )
    console.print(t)
    f = table.fit
    console.print(
        f"CPU-cost fit: {f.intercept_s * 1e3:.2f} ms + {f.s_per_decoded_px * 1e9:.2f} ns/decoded px "
        f"+ {f.s_per_output_px * 1e9:.2f} ns/output px"
    )


def _cmd_synth(a, console) -> int:
    from helix_core.data.media.synth import make_dataset

    root = make_dataset(
        a.out,
        workload=a.workload,
        num_clips=a.clips,
        seed=a.seed,
        scale=a.scale,
        workers=a.workers,
        progress=True,
        manifest_format=a.format,
        shards=a.shards,
    )
    console.print(f"wrote {a.clips} {a.workload} clips and {root / f'manifest.{a.format}'}")
    if a.shards:
        console.print(f"and WebDataset shards of {a.shards} samples in {root / 'shards'}")
    return 0


def _cmd_profile(a, console) -> int:
    from helix_core.data.profiles import default_out, profile_dataset

    out = a.out or default_out(a.manifest)  # a manifest at a URL: --out is needed (ValueError says so)
    table = profile_dataset(
        a.manifest,
        out,
        calibrate_per_bucket=a.calibrate,
        workers=a.workers,
        progress=True,
        storage_options=_storage_options(a.storage_option),
    )
    _print_profile(table, console)
    console.print(f"saved {out}")
    return 0


def _storage_options(pairs: list[str] | None) -> dict:
    """``--storage-option KEY=VALUE`` flags as fsspec options: a value that parses as JSON is that
    (``true``, ``8``, ``{"max_pool_connections": 64}``), else the string itself. Credentials are
    refused where the options are checked (``check_storage_options``)."""
    import json

    options: dict = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {pair!r}: expected KEY=VALUE (e.g. endpoint_url=http://host:9000)")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _need_bench() -> None:
    """The bench lives in ``helix_bench`` behind the ``bench`` extra: say so when it is missing."""
    import importlib.util

    for module in ("helix_bench", "matplotlib", "psutil"):
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"this command needs the bench extra ({module} is missing): "
                "pip install 'helix[bench]' (from a checkout: pip install -e '.[bench]')"
            )


def _cmd_demo(a, console) -> int:
    """The embedded default job: a small kinetics-mixed run, native DataLoader against Helix."""
    _need_bench()
    from helix_bench.benchconfig import BenchConfig
    from helix_bench.harness import run_bench

    out = Path(a.out) if a.out else cache_dir() / "demo-report"
    console.print(
        f"[bold]Helix demo[/]: {a.ranks} emulated ranks (gloo) on kinetics-mixed, {a.budget} decode workers "
        f"in all, native torch DataLoader vs Helix; data cached in {cache_dir()}"
    )
    cfg = BenchConfig(
        workload="kinetics-mixed",
        model="videomae",
        ranks=a.ranks,
        batch_size=2,
        budget=a.budget,
        systems=("native", "helix"),
        warmup=a.warmup,
        steps=a.steps,
        regime="gpu-bound",
        clips=a.clips,
        scale=a.scale,
        data_dir=str(cache_dir() / "bench-data"),
    )
    run_bench([cfg], out, console=console)
    return 0


def _models() -> tuple[str, ...]:
    from helix_core.data.families import MODELS  # the one table of model families

    return MODELS


def _split(text: str, kind=str) -> list:
    return [kind(x) for x in str(text).split(",") if x.strip()]


_ALL = "native,ray,helix"


def _cmd_bench(a, console) -> int:
    _need_bench()
    if a.manifest:
        from helix_bench.micro.manifest import run_manifest_bench

        run_manifest_bench(
            rows=a.manifest,
            formats=tuple(_split(a.manifest_formats)),
            model=a.model,
            data_dir=a.data,
            out=a.out,
            console=console,
            shard_members=a.shard_members,
        )
        if a.out:
            console.print(f"saved {Path(a.out) / 'manifest.json'}")
        return 0
    if a.overhead:
        from helix_bench.micro.overhead import run_overhead

        run_overhead(out=Path(a.out) / "overhead.json" if a.out else None, console=console)
        return 0
    if a.redistribute:
        from helix_bench.micro.redistribute import run_redistribute

        run_redistribute(
            servers=a.ranks,
            clips=a.redistribute,
            repeats=a.repeats if a.repeats != 1 else 5,
            scale=a.scale,
            model=a.model,
            out=Path(a.out) if a.out else None,
            console=console,
            hosts=a.hosts,
        )
        return 0
    if not a.out:
        raise ValueError("helix bench needs --out DIR (where the report goes)")
    if a.hosts:
        from helix_bench.hosts.config import HostBenchConfig
        from helix_bench.hosts.sweep import run_hosts_bench

        cfg = HostBenchConfig(
            hosts=a.hosts,
            ranks_per_host=a.ranks_per_host,
            host_cpus=a.host_cpus,
            sidecars=tuple(_split(a.sidecars, int)),
            sidecar_cpus=a.sidecar_cpus,
            link_mbps=a.link_mbps,
            repeats=a.repeats,
            systems=tuple(_split(a.systems)) if a.systems != _ALL else ("native", "helix"),
            workload=_split(a.workload)[0],
            model=a.model,
            batch_size=_split(a.batch_size, int)[0],
            warmup=a.warmup,
            steps=a.steps,
            prefetch=a.prefetch,
            clips=a.clips,
            scale=a.scale,
            seed=a.seed,
            estimate_noise=a.estimate_noise,
            data_dir=a.data or str(cache_dir() / "bench-data"),
            regime=a.regime,
            storage=a.storage,
            storage_mbps=a.storage_mbps,
        )
        run_hosts_bench(cfg, a.out, console=console)
        return 0
    from helix_bench.benchconfig import BenchConfig
    from helix_bench.harness import run_bench

    configs = [
        BenchConfig(
            workload=w,
            model=a.model,
            ranks=a.ranks,
            batch_size=b,
            budget=a.budget,
            systems=tuple(_split(a.systems)),
            warmup=a.warmup,
            steps=a.steps,
            regime=r,
            window_scale=a.window_scale,
            remote_servers=rd,
            prefetch=a.prefetch,
            clips=a.clips,
            scale=a.scale,
            seed=a.seed,
            ddl_tolerance_s=a.ddl_tolerance_ms / 1e3,
            window=a.window,
            compute=a.compute,
            device=a.device,
            gpu_cost=a.gpu_cost,
            profiles=not a.no_profiles,
            estimate_noise=a.estimate_noise,
            data_dir=a.data or str(cache_dir() / "bench-data"),
        )
        for w in _split(a.workload)
        for r in _split(a.regime or "gpu-bound")
        for b in _split(a.batch_size, int)
        for rd in _split(a.remote_servers, int)
    ]
    run_bench(configs, a.out, console=console)
    return 0


def _cmd_soak(a, console) -> int:
    _need_bench()
    from helix_bench.micro.soak import SoakConfig, run_soak

    rows = run_soak(
        SoakConfig(
            minutes=a.minutes,
            report_every_s=a.report_every,
            fault_every_s=a.fault_every,
            clients=a.clients,
            faults=a.faults,
        ),
        console=console,
    )
    return 0 if rows and rows[-1]["lost"] == 0 and rows[-1]["repeated"] == 0 else 1


def _cmd_planner(a, console) -> int:
    _need_bench()
    from helix_bench.micro.planner import run_planner_bench

    run_planner_bench(
        _split(a.workload),
        _split(a.models),
        _split(a.windows, int),
        ranks=a.ranks,
        batch_size=a.batch_size,
        clips=a.clips,
        epochs=a.epochs,
        seed=a.seed,
        data_dir=a.data or cache_dir() / "bench-data",
        out=a.out,
        console=console,
    )
    if a.out:
        console.print(f"saved {a.out}")
    return 0


def _cmd_microbench(a, console) -> int:
    _need_bench()
    from helix_bench.micro.media import run_microbench

    run_microbench(a.out, clips=a.clips, rows=a.rows, console=console)
    return 0


def _cmd_storagebench(a, console) -> int:
    _need_bench()
    from helix_bench.micro.storage import run_storage_bench

    run_storage_bench(
        a.out,
        seconds=a.seconds,
        long_seconds=a.long_seconds,
        blocks_kib=tuple(_split(a.blocks_kib, int)),
        model=a.model,
        console=console,
    )
    return 0


def _run_service(role: str, rest: list[str]) -> int:
    from helix_core.launch.process import main as process_main

    return process_main([role, *rest])


def build_parser() -> argparse.ArgumentParser:
    from helix_core.data.media.synth import MANIFEST_FORMATS, WORKLOADS

    p = argparse.ArgumentParser(
        prog="helix", description="Helix: a CPU–GPU co-scheduling data plane for video training"
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth", help="write a synthetic H.264 workload and its manifest (JSON lines, CSV or Parquet)")
    s.add_argument("out")
    s.add_argument("--workload", choices=WORKLOADS, default="kinetics-mixed")
    s.add_argument("--clips", type=int, default=48)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--scale", type=float, default=1.0, help="shrink resolution and duration (tests: 0.25)")
    s.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoder processes")
    s.add_argument("--format", choices=MANIFEST_FORMATS, default="jsonl", help="the manifest's: manifest.FORMAT")
    s.add_argument(
        "--shards", type=int, default=None, metavar="N", help="also pack the clips as WebDataset shards of N samples"
    )
    s.set_defaults(fn=_cmd_synth)
    s = sub.add_parser("profile", help="probe a manifest's clips and calibrate the cost table (profiles.jsonl)")
    s.add_argument("manifest")
    s.add_argument(
        "--out", default=None, help="default: profiles.jsonl beside a local manifest (required for one at a URL)"
    )
    s.add_argument("--calibrate", type=int, default=2, help="clips decoded per bucket for the CPU-cost fit")
    s.add_argument("--workers", type=int, default=None, help="probe threads (default: 32 for clips at URLs, else 1)")
    s.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="an fsspec option for a manifest or clips at URLs, e.g. endpoint_url=http://host:9000 (repeatable; "
        "never credentials: they come from the environment)",
    )
    s.set_defaults(fn=_cmd_profile)
    s = sub.add_parser("demo", help="the embedded default job: native DataLoader vs Helix on a small workload")
    s.add_argument("--ranks", type=int, default=2)
    s.add_argument("--budget", type=int, default=2, help="decode worker processes in all")
    s.add_argument("--clips", type=int, default=24)
    s.add_argument("--scale", type=float, default=1.0, help="shrink the synthetic clips (resolution, duration)")
    s.add_argument("--warmup", type=int, default=10)
    s.add_argument("--steps", type=int, default=60)
    s.add_argument("--out", default=None, help="report folder (default: in the cache)")
    s.set_defaults(fn=_cmd_demo)
    s = sub.add_parser("bench", help="the paper's evaluation: native vs Ray actor pool vs Helix, emulated GPU")
    s.add_argument("--workload", default="kinetics-mixed", help="comma-separated list (a sweep)")
    s.add_argument("--model", default="videomae", choices=_models())
    s.add_argument("--ranks", type=int, default=4)
    s.add_argument("--batch-size", default="2", help="comma-separated list (a sweep)")
    s.add_argument("--budget", type=int, default=4, help="worker processes in all, for every system")
    s.add_argument(
        "--systems",
        default=_ALL,
        help="native, ray (idle-actor dispatch), ray-rr (round robin), helix, and the ablation variants "
        "helix-pool, helix-transport, helix-prefetch, helix-tier1, helix-nosteal, helix-tier2; with "
        "--hosts: native, helix, helix-grpc, helix-tier2",
    )
    s.add_argument("--window", type=int, default=8, help="Tier-1 planning window (global steps) of balanced systems")
    s.add_argument("--warmup", type=int, default=20)
    s.add_argument("--steps", type=int, default=100)
    s.add_argument(
        "--regime",
        default=None,
        help="gpu-bound (default), cpu-bound, or both comma-separated; with --hosts: one regime (default: the "
        "GPU window matches the CPU of the hosts and the most sidecars)",
    )
    s.add_argument("--window-scale", type=float, default=None, help="seconds per GPU cost unit (overrides --regime)")
    s.add_argument(
        "--compute",
        choices=("emulate", "model"),
        default="emulate",
        help="emulate: sleep for the GPU window; model: a real tiny model's forward and backward",
    )
    s.add_argument("--device", default="cpu", help="with --compute model: cpu or cuda")
    s.add_argument("--remote-servers", default="0", help="comma-separated list: the rd sweep")
    s.add_argument("--prefetch", type=int, default=4, help="batches in flight per rank (all systems)")
    s.add_argument(
        "--gpu-cost",
        choices=("family", "linear"),
        default="family",
        help="emulated GPU cost: the model family's (attention: superlinear in tokens) or linear in tokens",
    )
    s.add_argument("--no-profiles", action="store_true", help="no profile table: costs from probing each clip")
    s.add_argument(
        "--estimate-noise",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="the loaders plan with costs off by a seeded log-normal factor (Tier 2 has something to correct)",
    )
    s.add_argument("--clips", type=int, default=48)
    s.add_argument("--scale", type=float, default=1.0, help="shrink the synthetic clips (resolution, duration)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ddl-tolerance-ms", type=float, default=10.0)
    s.add_argument("--data", default=None, help="where workloads are synthesized (cached)")
    s.add_argument("--out", default=None, help="report folder (required, except with --overhead / --redistribute)")
    s.add_argument(
        "--overhead",
        action="store_true",
        help="instead: Helix's own CPU (idle, per batch by role) and wake-up latency, near-free samples",
    )
    s.add_argument(
        "--redistribute",
        type=int,
        nargs="?",
        const=64,
        default=0,
        metavar="CLIPS",
        help="instead: move CLIPS (64) decoded clips among --ranks processes: gloo all_to_all vs one gRPC "
        "call a clip vs a handle exchange (Tier 2's paths; --repeats rounds, default 5)",
    )
    s.add_argument(
        "--manifest",
        type=int,
        nargs="?",
        const=1_000_000,
        default=0,
        metavar="ROWS",
        help="instead: build a dataset on a ROWS-row (1,000,000) manifest stating its clips' geometry, per "
        "format, each in a fresh process: seconds, peak RSS, estimate_cost, cost_arrays (clips never opened)",
    )
    s.add_argument(
        "--manifest-formats",
        default="parquet,csv,jsonl,shards",
        help="with --manifest: comma-separated (shards: a WebDataset shard set's index, built then read)",
    )
    s.add_argument("--shard-members", type=int, default=10_000, help="with --manifest: tar members of the shard set")
    s.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="instead: the sidecar sweep on this many emulated GPU hosts (root; native and helix by default)",
    )
    s.add_argument("--ranks-per-host", type=int, default=2)
    s.add_argument("--host-cpus", type=float, default=0.5, help="each emulated host's CPU quota (cores)")
    s.add_argument("--sidecars", default="0,1,2", help="comma-separated sidecar counts (the sweep)")
    s.add_argument("--sidecar-cpus", type=float, default=0.5, help="each sidecar host's CPU quota (cores)")
    s.add_argument("--link-mbps", type=float, default=None, help="each emulated host's link rate (tc tbf)")
    s.add_argument(
        "--storage",
        choices=("s3", "http"),
        default=None,
        help="with --hosts: the workload is read from an S3 (moto) or HTTP server on an emulated storage host",
    )
    s.add_argument(
        "--storage-mbps", type=float, default=200.0, help="with --storage: the storage host's link rate (tc tbf)"
    )
    s.add_argument("--repeats", type=int, default=1, help="with --hosts: interleaved rounds of the sweep (medians)")
    s.set_defaults(fn=_cmd_bench)
    s = sub.add_parser(
        "soak",
        help="loaders against a cluster for a long time with faults injected: RSS, "
        "/dev/shm, descriptors, threads, samples lost / repeated",
    )
    s.add_argument("--minutes", type=float, default=30.0)
    s.add_argument("--report-every", type=float, default=120.0, help="seconds between rows")
    s.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults")
    s.add_argument("--clients", type=int, default=2, help="loader processes (ranks of one job)")
    s.add_argument(
        "--faults",
        type=int,
        default=0,
        help="end after this many faults and an epoch a client after them (0: run the minutes)",
    )
    s.set_defaults(fn=_cmd_soak)
    s = sub.add_parser("planner", help="Tier-1 planner: GPU-cost imbalance per window size, and planner time")
    s.add_argument("--workload", default="kinetics-mixed,openvid-mixed", help="comma-separated list")
    s.add_argument("--models", default="videomae,qwen2-vl,wan", help="comma-separated model families")
    s.add_argument("--windows", default="1,2,4,8", help="comma-separated window sizes (global steps)")
    s.add_argument("--ranks", type=int, default=4)
    s.add_argument("--batch-size", type=int, default=2)
    s.add_argument("--clips", type=int, default=48)
    s.add_argument("--epochs", type=int, default=20)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--data", default=None, help="where workloads are synthesized (cached; default: as helix bench)")
    s.add_argument("--out", default=None, help="write the results as JSON")
    s.set_defaults(fn=_cmd_planner)
    for role, text in (
        ("coordinator", "run a Coordinator (the metadata-only control plane)"),
        ("dataserver", "run a DataServer (--local-rank R | --remote) with its worker pool"),
    ):
        sub.add_parser(role, help=text, add_help=False)  # handled in main()
    add_cluster_commands(sub)
    s = sub.add_parser("microbench", help="decode frames/s per profile, probe ms/file, profile-table load time")
    s.add_argument("--out", default=str(cache_dir() / "microbench"), help="folder for the generated clips and table")
    s.add_argument("--clips", type=int, default=6, help="clips per kinetics profile")
    s.add_argument("--rows", type=int, default=1_000_000, help="rows of the synthetic profile table")
    s.set_defaults(fn=_cmd_microbench)
    s = sub.add_parser("storagebench", help="bytes a sampled decode fetches from S3 by range reads, per clip profile")
    s.add_argument("--out", default=str(cache_dir() / "storagebench"), help="folder for the clips and the results")
    s.add_argument("--seconds", type=float, default=10.0, help="length of the usual clips")
    s.add_argument("--long-seconds", type=float, default=60.0, help="length of the long clips")
    s.add_argument("--blocks-kib", default="32,64,256", help="range-read sizes to compare, KiB")
    s.add_argument("--model", default="videomae", help="the model family whose sampling is decoded")
    s.set_defaults(fn=_cmd_storagebench)
    return p


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from helix_core.errors import ClusterError, ManifestError, SampleError

    console = Console()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("coordinator", "dataserver"):  # their own parser: helix_core.launch.process
        return _run_service(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    # SIGTERM (a job scheduler's, `kill`) unwinds like Ctrl-C, so every owner's cleanup runs: the
    # bench's emulated hosts, a demo's cluster (the default SIGTERM would strand their processes)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.fn(args, console)
    except (ManifestError, SampleError, ClusterError, FileNotFoundError, ValueError) as e:  # named, exit 2
        console.print(f"[red]error:[/] {e}")
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
