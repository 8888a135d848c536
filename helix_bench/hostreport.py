"""The report of ``helix bench --hosts`` (``hosts.py``): ``results.json``, ``report.md`` (a table of
the sweep's points) and ``fig_sidecars.png`` (throughput and bound against sidecars)."""
from __future__ import annotations

import json
from pathlib import Path


def _write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    c = result["config"]
    lines = ["# Helix on emulated hosts: the sidecar sweep", "",
             f"- {c['hosts']} hosts x {c['ranks_per_host']} ranks, {c['host_cpus']} CPU each; sidecars at "
             f"{c['sidecar_cpus']} CPU; link {c['link_mbps'] or 'unlimited'} Mbit/s; {c['workload']}, batch "
             f"{c['batch_size']}, {result['steps']} measured steps after {result['warmup']}"
             + (f"; planner's estimates off by a log-normal factor (sigma {c['estimate_noise']:g})"
                if c.get("estimate_noise") else ""),
             f"- decode {', '.join(f'{d:.2f}' for d in result.get('decode_s_rounds', [result['decode_s']]))} CPU-s of the "
             f"measured samples (the yardstick, measured again before each round); token-balanced GPU "
             f"{result['gpu_s']:.2f} s",
             f"- {c['repeats']} interleaved round(s): each point is its median round; vs native is the median "
             "ratio to the same round's native; the range is every round's throughput",
             "- GPU hosts' DataServers: their processes' CPU-s over the whole point (serving their ranks and "
             "receiving the sidecars' batches), spent inside the GPU hosts' quotas; the bound does not count it",
             "", "| System | Sidecars | CPUs | Throughput (samples/s) | Range | Bound (samples/s) | Bound (%) | Limited by "
             "| vs native | Miss rate (%) | Cross-DS (MB) | Link util. (%) | Input wait mean (s) | Remote requests "
             "| GPU hosts' DataServers (CPU-s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        util = f"{100 * p['link_utilisation']:.1f}" if p["link_utilisation"] is not None else "n/a"
        vs = f"{p['vs_native']:.2f}x" if p["vs_native"] else "n/a"
        rounds = p.get("rounds_sps") or [p["throughput_sps"]]
        remote = f"{p['routed_remote']} of {p['routed']}" if "routed" in p else "n/a"
        ds_cpu = f"{p['local_dataserver_cpu_s']:.1f}" if p.get("local_dataserver_cpu_s") is not None else "n/a"
        lines.append(f"| {p['system']} | {p['sidecars']} | {p['cpus']:g} | {p['throughput_sps']:.2f} | "
                     f"{min(rounds):.2f}–{max(rounds):.2f} | {p['bound_sps']:.2f} | {100 * p['bound_fraction']:.1f} | "
                     f"{p['limited_by']} | {vs} | {100 * p.get('miss_rate', float('nan')):.1f} | "
                     f"{p['cross_ds_bytes'] / 1e6:.1f} | {util} | "
                     f"{p['input_wait_mean_s']:.4f} | {remote} | {ds_cpu} |")
    tier2 = [p for p in result["points"] if p.get("tier2")]
    if tier2:  # helix-tier2: what its rounds moved, and what crossed hosts (each host's member, all_to_all)
        lines += ["", "| Tier-2 at sidecars | Batches sent to rounds | Moved / kept (ranks' views) | Rows moved "
                  "| Moved (MB) | Rows' takes across hosts | Across hosts (MB) |", "|---|---|---|---|---|---|---|"]
        for p in tier2:
            t = p["tier2"]
            across = sum(v for k, v in t.items() if k.startswith("crossed_") and k != "crossed_bytes")
            lines.append(f"| {p['sidecars']} | {t.get('asked', 0):.0f} | {t.get('moved', 0):.0f} / {t.get('kept', 0):.0f} | "
                         f"{t.get('moved_in', 0):.0f} | "
                         f"{t.get('moved_bytes', 0) / 1e6:.1f} | {across:.0f} | {t.get('crossed_bytes', 0) / 1e6:.1f} |")
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
