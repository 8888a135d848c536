"""``helix bench --hosts``: the paper's multi-node result in miniature, on emulated hosts.

``hosts`` GPU hosts (``ranks_per_host`` ranks each, ``host_cpus`` CPUs each by a cgroup quota)
and up to ``max(sidecars)`` sidecar hosts (``sidecar_cpus`` each), every one a network + mount +
UTS namespace (``helix_core.testing.emulated_hosts``), optionally behind a ``link_mbps`` link. ``native``
decodes with its own host's CPU only (a per-rank torch DataLoader); ``helix`` with its hosts' CPU
plus the sidecars': a Coordinator on host 0, a local DataServer per host, a remote one per
sidecar host, all started with the ``helix`` command over TLS. The emulated GPU window is set so
that the hosts' CPU alone is short of the GPU by the sidecars' CPU at the sweep's end. The bound
counts the CPU each system may use and the link: ``max(decode CPU-s / CPUs, token-balanced GPU s,
streamed bits / link rate of the busiest link)``, one single-decoder's work per CPU of quota (the
quota is a hard cap, so no contention term as on the unquoted machine).

This module holds the sweep's loop; ``config.py`` its configuration, ``point.py`` runs one point
(one system at one sidecar count), ``report.py`` writes the report.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from helix_bench.hosts.config import SYSTEMS, HostBenchConfig

__all__ = ["run_hosts_bench"]

MISS_TOLERANCE_S = 0.010  # as the loader's ddl_tolerance_s
_ENV_DROP = ("HELIX_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ENV_DROP)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0", **extra)
    return env


def run_hosts_bench(cfg: HostBenchConfig, out_dir, console=None) -> dict:
    """Run the sweep; write ``results.json``, ``report.md`` and ``fig_sidecars.png`` in ``out_dir``."""
    import numpy as np

    from helix_bench.benchconfig import BenchConfig
    from helix_bench.emulate import REGIMES, measure_decode, window_scale
    from helix_bench.harness import bench_dataset, expected_indices, measured_gpu_s, steps_per_epoch
    from helix_bench.hosts.point import run_point
    from helix_bench.hosts.report import write_report
    from helix_bench.metrics import Bound
    from helix_bench.ranks import RankPlan
    from helix_bench.samples import round_to_windows
    from helix_bench.timed import TimedClipDataset
    from helix_core.planning.gpu import GPU_COSTS
    from helix_core.security.auth import new_token
    from helix_core.security.tls import write_certificates
    from helix_core.testing.emulated_hosts import EmulatedHosts

    why = EmulatedHosts.unavailable()
    if why:
        raise RuntimeError(f"helix bench --hosts: {why}")
    say = console.print if console is not None else (lambda *a, **k: None)
    bc = BenchConfig(
        workload=cfg.workload,
        model=cfg.model,
        ranks=cfg.ranks,
        batch_size=cfg.batch_size,
        budget=cfg.ranks,
        systems=("native",),
        warmup=cfg.warmup,
        steps=cfg.steps,
        prefetch=cfg.prefetch,
        clips=cfg.clips,
        scale=cfg.scale,
        seed=cfg.seed,
        data_dir=cfg.data_dir,
    )
    ds = bench_dataset(bc, progress=console is not None)
    spe = steps_per_epoch(len(ds), bc)
    warmup, steps = round_to_windows(bc.warmup, bc.steps, spe, bc.window)
    bc = replace(bc, warmup=warmup, steps=steps)
    expected = [rank[warmup:] for rank in expected_indices(len(ds), bc)]
    flat = [i for rank in expected for b in rank for i in b]
    say(
        f"[bold]hosts bench[/] {cfg.hosts} hosts x {cfg.ranks_per_host} ranks at {cfg.host_cpus} CPU, sidecars "
        f"{list(cfg.sidecars)} at {cfg.sidecar_cpus} CPU: measuring the decode yardstick ..."
    )
    decode = measure_decode(ds, flat)
    tokens = {i: ds.estimate_cost(i).tokens for i in decode}
    cost = GPU_COSTS[cfg.model]
    cpus_max = cfg.hosts * cfg.host_cpus + max(cfg.sidecars) * cfg.sidecar_cpus
    factor = REGIMES[cfg.regime] if cfg.regime else 1.0
    scale = window_scale(
        factor, [decode[i] for i in flat], [tokens[i] for i in flat], cfg.batch_size, cfg.ranks, cpus_max, cost
    )
    decode_s, gpu_s = sum(decode[i] for i in flat), measured_gpu_s(expected, tokens, cost, scale)
    plan = RankPlan(
        system="",
        ranks=cfg.ranks,
        port=0,
        dataset=ds.helix_spec(),
        batch_size=cfg.batch_size,
        warmup=warmup,
        steps=steps,
        window_scale=scale,
        cost=(cost.a, cost.b, cost.c),
        workers_per_rank=1,
        prefetch=cfg.prefetch,
        seed=cfg.seed,
        window=bc.window,
    )
    names = [f"h{h}" for h in range(cfg.hosts)] + [f"s{s}" for s in range(max(cfg.sidecars))]
    cpus = {n: (cfg.host_cpus if n.startswith("h") else cfg.sidecar_cpus) for n in names}
    links = {n: cfg.link_mbps for n in names} if cfg.link_mbps else {}
    storage_s = 0.0
    if cfg.storage:  # a storage host without a CPU quota (its server must not be what limits), behind its link
        names.append("store")
        if cfg.storage_mbps:
            links["store"] = cfg.storage_mbps
            sizes = {i: ds.descriptor(i).bytes for i in set(flat)}
            storage_s = sum(sizes[i] for i in flat) * 8 / (cfg.storage_mbps * 1e6)
    points = []
    with (
        tempfile.TemporaryDirectory(prefix="helix-hosts-") as tmp,
        EmulatedHosts(names, cpus=cpus, link_mbps=links or None) as hosts,
    ):
        certs = write_certificates(os.path.join(tmp, "certs"), [hosts.address(n) for n in names])
        env = _env(
            {
                "HELIX_TLS_CERT": certs["cert"],
                "HELIX_TLS_KEY": certs["key"],
                "HELIX_TLS_CA": certs["ca"],
                "HELIX_TOKEN": new_token(),
            }
        )  # the services and ranks get it by their environment
        plan = replace(plan, master_addr=hosts.address("h0"))
        if cfg.storage:
            spec, storage_env = _start_storage(hosts, cfg, ds)
            plan = replace(plan, dataset=spec)
            env.update(storage_env)
            say(f"  storage: {spec['kwargs']['manifest']} on host store ({cfg.storage_mbps:g} Mbit/s)")
        runs = [("native", 0)] if "native" in cfg.systems else []
        runs += [(s, k) for k in cfg.sidecars for s in SYSTEMS[1:] if s in cfg.systems]  # A/B pairs per count
        decode_rounds = [decode_s]
        for rnd, (system, k) in enumerate(runs * cfg.repeats):
            if rnd and rnd % len(runs) == 0:  # the machine's speed drifts: each round's bound by its own yardstick
                say("  measuring the decode yardstick again ...")
                again = measure_decode(ds, flat)
                decode_s = sum(again[i] for i in flat)
                decode_rounds.append(decode_s)
            say(
                f"  {system} with {k} sidecar(s)"
                + (f" (round {rnd // len(runs) + 1} of {cfg.repeats})" if cfg.repeats > 1 else "")
                + " ..."
            )
            point_plan = plan
            if cfg.estimate_noise > 0:  # estimates the planner sees are off; the decoded samples keep their tokens
                point_plan = replace(
                    plan,
                    dataset=TimedClipDataset(
                        ds.manifest_path,
                        model=cfg.model,
                        decode_log=Path(tmp) / f"decode-{system}-{k}-{rnd}",
                        estimate_noise=cfg.estimate_noise,
                        noise_seed=cfg.seed,
                    ).helix_spec(),
                )
            got = run_point(cfg, hosts, system, k, point_plan, Path(tmp), env)
            rank0 = [r for r in got["records"] if r["rank"] == 0]
            wall = sum(r["step_s"] for r in rank0)
            samples = sum(r["samples"] for r in got["records"])
            cpus_used = cfg.hosts * cfg.host_cpus + (k * cfg.sidecar_cpus if system != "native" else 0.0)
            bound = Bound(
                decode_s=decode_s,
                gpu_s=gpu_s,
                cpu_slots=max(1, math.ceil(cpus_used)),
                samples=len(flat),
                capacity=cpus_used,
            )
            # the link term: the bytes over the busiest link, all at link_mbps. Each GPU host's link
            # carries its share of the streamed batches and of Tier 2's rows that change host; each
            # sidecar's its share of the streamed batches.
            crossed = got["cross_ds_bytes"] + int(got.get("tier2", {}).get("crossed_bytes", 0))
            busiest = max(crossed / cfg.hosts, got["cross_ds_bytes"] / k if k else 0.0)
            link_s = busiest * 8 / (cfg.link_mbps * 1e6) if cfg.link_mbps else 0.0
            bound_sps = len(flat) / max(bound.time_s, link_s, storage_s)
            points.append(
                {
                    "system": system,
                    "sidecars": k,
                    "round": rnd // len(runs),
                    "cpus": cpus_used,
                    "decode_s": decode_s,
                    "throughput_sps": samples / wall,
                    "cpu_bound_sps": cpus_used * len(flat) / decode_s,  # one yardstick decoder per CPU
                    "bound_sps": bound_sps,
                    "bound_fraction": samples / wall / bound_sps,
                    "limited_by": "storage" if storage_s > max(bound.time_s, link_s) else bound.limited_by,
                    "cross_ds_bytes": got["cross_ds_bytes"],
                    "link_utilisation": (crossed * 8 / wall / (cfg.link_mbps * 1e6) if cfg.link_mbps else None),
                    "input_wait_mean_s": float(np.mean([r["input_wait_s"] for r in got["records"]])),
                    # the paper's DDL miss: a rank-step that waited for its batch longer than the tolerance
                    "miss_rate": float(np.mean([r["input_wait_s"] > MISS_TOLERANCE_S for r in got["records"]])),
                    "placement_reasons": got["placement_reasons"],
                    **{
                        k: got[k]
                        for k in (
                            "routed",
                            "routed_remote",
                            "server_cross_ds_bytes",
                            "bulk_bytes",
                            "local_dataserver_cpu_s",
                            "deadline_p50_s",
                            "window_s_per_unit",
                            "tier2",
                            "host_cpu",
                        )
                        if k in got
                    },
                }
            )
            say(f"    {points[-1]['throughput_sps']:.2f} samples/s, {points[-1]['bound_fraction']:.0%} of the bound")
    result = {
        "config": {**asdict(cfg), "sidecars": list(cfg.sidecars), "systems": list(cfg.systems)},
        "steps": steps,
        "warmup": warmup,
        "window_scale": scale,
        "decode_s": decode_rounds[0],
        "decode_s_rounds": decode_rounds,
        "gpu_s": gpu_s,
        "storage_s": storage_s,
        "runs": points,
        "points": _medians(points),
    }
    write_report(result, Path(out_dir))
    return result


def _start_storage(hosts, cfg: HostBenchConfig, ds) -> tuple[dict, dict]:
    """Serve the workload's folder from host ``store`` (``helix_core.testing.objectstore``); return
    the dataset's spec reading it by URL and the environment the readers need (moto's credentials)."""
    import subprocess
    import sys

    from helix_core.testing.objectstore import S3_TEST_ENV

    root = Path(ds.manifest_path).parent
    addr = hosts.address("store")
    env = dict(S3_TEST_ENV) if cfg.storage == "s3" else {}
    proc = hosts.popen(
        "store",
        [
            sys.executable,
            "-m",
            "helix_core.testing.objectstore",
            cfg.storage,
            "--root",
            str(root),
            "--host",
            addr,
            "--port",
            "9000",
            "--bucket",
            "bench",
        ],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().split()
    if not line or line[0] != "ready":
        raise RuntimeError(f"helix bench --hosts --storage {cfg.storage}: the storage server did not start")
    endpoint = line[1]
    if cfg.storage == "s3":
        url, options = "s3://bench/manifest.jsonl", {"endpoint_url": endpoint}
    else:
        url, options = f"{endpoint}/manifest.jsonl", None
    # the spec is written here, not built (this process cannot reach the storage host's address)
    kwargs = {**ds.helix_spec()["kwargs"], "manifest": url, "profiles": False}
    if options:
        kwargs["storage_options"] = options
    return {"target": ds.helix_spec()["target"], "kwargs": kwargs}, env


def _medians(runs: list[dict]) -> list[dict]:
    """One point per (system, sidecars): its median-throughput round, with every round's
    throughput (``rounds_sps``) and ``vs_native``, the median of the ratios to the same round's native."""
    import statistics

    native = {p["round"]: p["throughput_sps"] for p in runs if p["system"] == "native"}
    points = []
    for key in dict.fromkeys((p["system"], p["sidecars"]) for p in runs):
        group = sorted((p for p in runs if (p["system"], p["sidecars"]) == key), key=lambda p: p["throughput_sps"])
        point = dict(group[(len(group) - 1) // 2])
        point["rounds_sps"] = [p["throughput_sps"] for p in group]
        ratios = [p["throughput_sps"] / native[p["round"]] for p in group if native.get(p["round"])]
        point["vs_native"] = statistics.median(ratios) if ratios else None
        points.append(point)
    return points
