"""The report of ``helix bench --hosts`` (``sweep.py``): ``results.json``, ``report.md`` (a table of
the sweep's points) and ``fig_sidecars.png`` (throughput and bound against sidecars)."""

from __future__ import annotations

import json
from pathlib import Path

_ROLES = ("decode", "dataserver", "ranks", "coordinator")


def _cpu_table(points: list[dict]) -> list[str]:
    """Where each kind of host's CPU went over the measured steps (``cpu.py``): what its quota
    allowed, what it used and in which role, and how long the quota held it back."""
    from helix_bench.hosts.cpu import summarize

    rows = []
    for p in points:
        for kind, name in (("h", "GPU hosts"), ("s", "sidecars")):
            t = summarize(p.get("host_cpu") or {}, kind)
            if not t or not t["quota_s"] or not t["used_s"]:
                continue
            share = " | ".join(f"{t['roles'].get(r, 0.0):.1f}" for r in _ROLES)
            rows.append(
                f"| {p['system']} | {p['sidecars']} | {name} ({t['hosts']}) | {t['quota_s']:.1f} | "
                f"{t['used_s']:.1f} ({100 * t['used_s'] / t['quota_s']:.0f} %) | {share} | {t['other_s']:.1f} | "
                f"{100 * t['throttled_periods'] / max(1.0, t['periods']):.0f} |"
            )
    if not rows:
        return []
    return [
        *_factors(points),
        "",
        "Where the CPU went over the measured steps (CPU-s; the roles count their children: a DataServer's "
        "decode workers, a native rank's DataLoader workers, under decode; other is what the host used outside "
        "those processes: untracked processes and the skew of reading the counters (kernel work in a process's own "
        "context, such as moving packets between namespaces, counts in its role); throttled is the share of the "
        "quota's 100 ms periods with work in which a host ran out of it):",
        "",
        "| System | Sidecars | Hosts | Quota | Used | Decode | DataServer | Ranks | Coordinator | Other "
        "| Throttled (%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _factors(points: list[dict]) -> list[str]:
    """Each point's throughput against the CPU it may use (its quotas at the yardstick's decode
    rate), as three factors whose product it is: the share of the quotas used, the share of that
    spent by the decode workers, and their efficiency (the yardstick's CPU-s per sample over the
    run's). What is left of 100 % in each says which term holds the point."""
    from helix_bench.hosts.cpu import summarize

    rows = []
    for p in points:
        kinds = [summarize(p.get("host_cpu") or {}, k) for k in ("h", "s")]
        kinds = [t for t in kinds if t and t["quota_s"] and t["used_s"]]
        if not kinds or not p.get("cpu_bound_sps"):
            continue
        quota, used = sum(t["quota_s"] for t in kinds), sum(t["used_s"] for t in kinds)
        decode = sum(t["roles"].get("decode", 0.0) for t in kinds)
        window = kinds[0]["window_s"] / kinds[0]["hosts"]
        per_sample = p["cpu_bound_sps"] * window / quota  # samples per CPU-s at the yardstick's rate
        efficiency = p["throughput_sps"] * window / decode / per_sample if decode else 0.0
        rows.append(
            f"| {p['system']} | {p['sidecars']} | {p['cpu_bound_sps']:.2f} | {100 * used / quota:.0f} | "
            f"{100 * decode / used:.0f} | {100 * efficiency:.0f} | "
            f"{100 * p['throughput_sps'] / p['cpu_bound_sps']:.0f} |"
        )
    if not rows:
        return []
    return [
        "",
        "Throughput against the CPU each system may use (CPU bound: its quotas at the yardstick's decode "
        "rate), as the product of three shares over the measured steps: the quotas used, the decode workers' "
        "part of that, and their efficiency (the yardstick's CPU-s per sample over the run's):",
        "",
        "| System | Sidecars | CPU bound (samples/s) | Quota used (%) | Decode workers' part (%) "
        "| Decode efficiency (%) | Throughput (% of CPU bound) |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def write_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    c = result["config"]
    lines = [
        "# Helix on emulated hosts: the sidecar sweep",
        "",
        f"- {c['hosts']} hosts x {c['ranks_per_host']} ranks, {c['host_cpus']} CPU each; sidecars at "
        f"{c['sidecar_cpus']} CPU; link {c['link_mbps'] or 'unlimited'} Mbit/s; {c['workload']}, batch "
        f"{c['batch_size']}, {result['steps']} measured steps after {result['warmup']}"
        + (
            f"; planner's estimates off by a log-normal factor (sigma {c['estimate_noise']:g})"
            if c.get("estimate_noise")
            else ""
        ),
        f"- decode {', '.join(f'{d:.2f}' for d in result.get('decode_s_rounds', [result['decode_s']]))} CPU-s of the "
        f"measured samples (the yardstick, measured again before each round); token-balanced GPU "
        f"{result['gpu_s']:.2f} s",
        *(
            [
                f"- data read from {c['storage']} on an emulated storage host behind a {c['storage_mbps']:g} Mbit/s "
                f"link (native: each rank's DataLoader workers read it; helix: the DataServers); the bound counts "
                f"that link: {result.get('storage_s', 0.0):.2f} s for the measured samples' bytes"
                + (f"; the GPU window is the {c['regime']} regime's" if c.get("regime") else "")
            ]
            if c.get("storage")
            else ([f"- the GPU window is the {c['regime']} regime's"] if c.get("regime") else [])
        ),
        f"- {c['repeats']} interleaved round(s): each point is its median round; vs native is the median "
        "ratio to the same round's native; the range is every round's throughput",
        "- GPU hosts' DataServers: their processes' CPU-s over the whole point (serving their ranks and "
        "receiving the sidecars' batches), spent inside the GPU hosts' quotas; the bound does not count it",
        "",
        "| System | Sidecars | CPUs | Throughput (samples/s) | Range | Bound (samples/s) | Bound (%) | Limited by "
        "| vs native | Miss rate (%) | Cross-DS (MB) | Link util. (%) | Input wait mean (s) | Remote requests "
        "| GPU hosts' DataServers (CPU-s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        util = f"{100 * p['link_utilisation']:.1f}" if p["link_utilisation"] is not None else "n/a"
        vs = f"{p['vs_native']:.2f}x" if p["vs_native"] else "n/a"
        rounds = p.get("rounds_sps") or [p["throughput_sps"]]
        remote = f"{p['routed_remote']} of {p['routed']}" if "routed" in p else "n/a"
        ds_cpu = f"{p['local_dataserver_cpu_s']:.1f}" if p.get("local_dataserver_cpu_s") is not None else "n/a"
        lines.append(
            f"| {p['system']} | {p['sidecars']} | {p['cpus']:g} | {p['throughput_sps']:.2f} | "
            f"{min(rounds):.2f}–{max(rounds):.2f} | {p['bound_sps']:.2f} | {100 * p['bound_fraction']:.1f} | "
            f"{p['limited_by']} | {vs} | {100 * p.get('miss_rate', float('nan')):.1f} | "
            f"{p['cross_ds_bytes'] / 1e6:.1f} | {util} | "
            f"{p['input_wait_mean_s']:.4f} | {remote} | {ds_cpu} |"
        )
    tier2 = [p for p in result["points"] if p.get("tier2")]
    if tier2:  # helix-tier2: what its rounds moved, and what crossed hosts (each host's member, all_to_all)
        lines += [
            "",
            "| Tier-2 at sidecars | Batches sent to rounds | Moved / kept (ranks' views) | Rows moved "
            "| Moved (MB) | Rows' takes across hosts | Across hosts (MB) |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in tier2:
            t = p["tier2"]
            across = sum(v for k, v in t.items() if k.startswith("crossed_") and k != "crossed_bytes")
            lines.append(
                f"| {p['sidecars']} | {t.get('asked', 0):.0f} | {t.get('moved', 0):.0f} / {t.get('kept', 0):.0f} | "
                f"{t.get('moved_in', 0):.0f} | "
                f"{t.get('moved_bytes', 0) / 1e6:.1f} | {across:.0f} | {t.get('crossed_bytes', 0) / 1e6:.1f} |"
            )
    lines += _cpu_table(result["points"])
    lines += ["", "![Throughput and bound against sidecars](fig_sidecars.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("helix", "o-"), ("helix-grpc", "s:"), ("helix-tier2", "^-.")):
        pts = [p for p in result["points"] if p["system"] == name]
        if pts:
            ax.plot([p["sidecars"] for p in pts], [p["throughput_sps"] for p in pts], style, label=name)
            if name == "helix":
                ax.plot([p["sidecars"] for p in pts], [p["bound_sps"] for p in pts], "k--", label="helix bound")
    for p in result["points"]:
        if p["system"] == "native":
            ax.axhline(p["throughput_sps"], color="tab:red", label="native (hosts' CPU only)")
    ax.set_xticks(sorted({p["sidecars"] for p in result["points"]}))
    ax.set_xlabel("sidecars")
    ax.set_ylabel("samples/s")
    ax.set_title("Throughput against sidecar CPU (emulated hosts)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fig_sidecars.png", dpi=110)
    plt.close(fig)
