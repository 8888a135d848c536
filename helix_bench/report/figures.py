"""Bench figures (PNG): paper Fig. 2 (per-rank step-time p95), Fig. 8 (wait breakdown), Fig. 10
(throughput against the bound), and where each system's CPU went (stacked CPU-seconds by role).

Every function takes the validated runs of ``report`` and a path, draws with matplotlib's
object API (no global state, no display) and returns the path.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from helix_bench.slots import draw_timeline

__all__ = ["FIGURES", "draw_figures"]

FIGURES = (
    "fig2_step_time_p95.png",
    "fig8_wait_breakdown.png",
    "fig10_throughput.png",
    "fig_cpu_by_role.png",
    "fig_decode_slots.png",
)
CAPTIONS = {
    "fig2_step_time_p95.png": "Per-rank step-time p95 (paper Fig. 2)",
    "fig8_wait_breakdown.png": "Mean step breakdown: input wait, compute, sync wait (paper Fig. 8)",
    "fig10_throughput.png": "Throughput per run and system against the physical bound (paper Fig. 10)",
    "fig_cpu_by_role.png": "Where the CPU went over the measured steps: CPU-seconds by role per system",
    "fig_decode_slots.png": "Decode slots over the measured steps: each decoding process's decodes (gaps: idle CPU)",
}
_SYSTEM_COLORS = {"native": "tab:gray", "ray": "tab:orange", "helix": "tab:blue"}
_OTHER_COLORS = ("tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:red")


def _num(v) -> float:
    return math.nan if v is None else float(v)


def _fmt(v, spec: str) -> str:
    v = _num(v)
    return "n/a" if math.isnan(v) else f"{v:{spec}}"


def _ran(run) -> dict:
    return {n: m for n, m in run["systems"].items() if "skipped" not in m}


def _colors(runs: list[dict]) -> dict[str, str]:
    names = dict.fromkeys(n for r in runs for n in r["systems"])
    others = iter(_OTHER_COLORS * (1 + len(names) // len(_OTHER_COLORS)))
    return {n: _SYSTEM_COLORS.get(n) or next(others) for n in names}


def _grid(fig, runs: list, per_plot: tuple[float, float]):
    """One axes per run: a column up to three runs, two columns beyond. ``per_plot``: inches."""
    cols = 1 if len(runs) <= 3 else 2
    rows = math.ceil(len(runs) / cols)
    fig.set_size_inches(per_plot[0] * cols, per_plot[1] * rows)
    return [fig.add_subplot(rows, cols, i + 1) for i in range(len(runs))]


def _frame(ax, empty: bool, empty_text: str, title: str, ylabel: str, ymargin: float) -> None:
    """A bar panel's title, label, grid and headroom; a note in the middle when it has no bars."""
    if empty:
        ax.text(0.5, 0.5, empty_text, ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=ymargin)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, format="png")
    return path


def _fig2(runs, labels, colors, path: Path) -> Path:
    from matplotlib.figure import Figure

    widest = max((len(m["per_rank"]) for r in runs for m in _ran(r).values()), default=1) * max(
        max(len(_ran(r)) for r in runs), 1
    )
    fig = Figure(layout="constrained")
    for ax, run, label in zip(_grid(fig, runs, (max(7.0, 0.35 * widest + 4.5), 3.4)), runs, labels):
        ran = _ran(run)
        width = 0.8 / max(len(ran), 1)
        for j, (name, m) in enumerate(ran.items()):
            ranks = [row["rank"] for row in m["per_rank"]]
            p95 = [_num(row["step_time_p95_s"]) for row in m["per_rank"]]
            spread = max(p95) / min(p95) if p95 and min(p95) > 0 else math.nan
            xs = [x + (j - (len(ran) - 1) / 2) * width for x in range(len(ranks))]
            ax.bar(xs, p95, width, color=colors[name], label=f"{name} (max/min {_fmt(spread, '.2f')}x)")
            ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
        if not ran:
            ax.text(0.5, 0.5, "no system ran", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"Per-rank step-time p95 — {label}")
        ax.set_xlabel("rank")
        ax.set_ylabel("step-time p95 (s)")
        ax.grid(axis="y", alpha=0.3)
        if ran:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


_PARTS = (
    ("input_wait_mean_s", "input wait", "tab:red"),
    ("compute_mean_s", "compute (GPU window)", "tab:blue"),
    ("sync_wait_mean_s", "sync wait", "tab:olive"),
)


def _fig8(runs, labels, path: Path) -> Path:
    from matplotlib.figure import Figure

    widest = max(len(_ran(r)) for r in runs)
    fig = Figure(layout="constrained")
    for i, (ax, run, label) in enumerate(zip(_grid(fig, runs, (max(7.0, 1.6 * widest + 3), 3.8)), runs, labels)):
        ticks, bottoms = [], []
        for name, m in _ran(run).items():
            rows = m["per_rank"]
            rank0 = next((row for row in rows if row["rank"] == 0), rows[0])
            mean = {k: sum(_num(row[k]) for row in rows) / len(rows) for k, _, _ in _PARTS}
            for who, vals in ((f"rank {rank0['rank']}", rank0), ("mean over ranks", mean)):
                ticks.append(f"{name}\n{who}")
                bottoms.append([_num(vals[k]) for k, _, _ in _PARTS])
        xs = range(len(ticks))
        base = [0.0] * len(ticks)
        for p, (_, name, color) in enumerate(_PARTS):
            heights = [b[p] for b in bottoms]
            ax.bar(xs, heights, 0.6, bottom=base, color=color, label=name if i == 0 else None)
            base = [b + h for b, h in zip(base, heights)]
        for x, total in zip(xs, base):
            ax.annotate(f"{total:.3f} s", (x, total), ha="center", va="bottom", fontsize="x-small")
        ax.set_xticks(list(xs), ticks, fontsize="small")
        _frame(ax, not ticks, "no system ran", f"Mean step breakdown — {label}", "seconds per step (mean)", 0.12)
    if any(_ran(r) for r in runs):
        fig.legend(fontsize="small", loc="outside upper center", ncols=len(_PARTS))
    return _save(fig, path)


def _fig10(runs, labels, colors, path: Path) -> Path:
    from matplotlib.figure import Figure

    names = list(colors)
    fig = Figure(figsize=(max(7.0, 0.5 * len(runs) * len(names) + 3), 4.5), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs, ys = [], []
        for x, run in enumerate(runs):
            m = run["systems"].get(name)
            x = x + (j - (len(names) - 1) / 2) * width
            if m is None:
                continue
            if "skipped" in m:
                ax.annotate(
                    "skipped",
                    (x, 0),
                    xytext=(0, 4),
                    textcoords="offset points",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize="x-small",
                    color="0.4",
                )
                continue
            xs.append(x)
            ys.append(_num(m["throughput_sps"]))
        bars = ax.bar(xs, ys, width, color=colors[name], label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize="x-small")
    for x, run in enumerate(runs):
        ax.hlines(
            _num(run["bound"]["throughput_sps"]),
            x - 0.45,
            x + 0.45,
            colors="k",
            linestyles="--",
            label="physical bound" if x == 0 else None,
        )
    ax.set_xticks(range(len(runs)), [textwrap.fill(label, 16) for label in labels])
    ax.set_title("End-to-end throughput per run and system")
    ax.set_xlabel("run")
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


_ROLE_COLORS = {
    "decode": "tab:green",
    "workers": "tab:olive",
    "loader-workers": "tab:olive",
    "ray-decoders": "tab:olive",
    "dataservers": "tab:purple",
    "coordinator": "tab:pink",
    "ranks": "tab:blue",
    "ray-system": "tab:orange",
    "other": "tab:gray",
}


def _fig_cpu(runs, labels, path: Path) -> Path:
    from matplotlib.figure import Figure

    roles = list(dict.fromkeys(k for r in runs for m in _ran(r).values() for k in (m.get("cpu_s_by_role") or {})))
    roles.sort(key=lambda k: (k != "decode", k))
    widest = max(len(_ran(r)) for r in runs)
    fig = Figure(layout="constrained")
    for i, (ax, run, label) in enumerate(zip(_grid(fig, runs, (max(7.0, 1.1 * widest + 3), 3.8)), runs, labels)):
        names = [n for n, m in _ran(run).items() if m.get("cpu_s_by_role")]
        base = [0.0] * len(names)
        for role in roles:
            heights = [_num(_ran(run)[n]["cpu_s_by_role"].get(role, 0.0)) for n in names]
            ax.bar(
                range(len(names)),
                heights,
                0.6,
                bottom=base,
                color=_ROLE_COLORS.get(role, None),
                label=role if i == 0 else None,
            )
            base = [b + h for b, h in zip(base, heights)]
        for x, (n, total) in enumerate(zip(names, base)):
            eff = _ran(run)[n].get("decode_efficiency")
            ax.annotate(
                f"{total:.0f} s\neff {_fmt(eff, '.2f')}", (x, total), ha="center", va="bottom", fontsize="x-small"
            )
        ax.set_xticks(range(len(names)), names, fontsize="small", rotation=20)
        if base:
            ax.set_ylim(0, max(base) * 1.25)  # room for the totals above the tallest bar
        _frame(ax, not names, "not measured", f"CPU-seconds by role — {label}", "CPU-seconds (measured steps)", 0.3)
    if roles:
        fig.legend(fontsize="small", loc="outside upper center", ncols=min(len(roles), 5))
    return _save(fig, path)


def draw_figures(runs: list, labels: list[str], out: Path) -> dict[str, Path]:
    """Draw every figure of ``FIGURES`` into ``out``; ``{file name: path}``."""
    colors = _colors(runs)
    return {
        FIGURES[0]: _fig2(runs, labels, colors, out / FIGURES[0]),
        FIGURES[1]: _fig8(runs, labels, out / FIGURES[1]),
        FIGURES[2]: _fig10(runs, labels, colors, out / FIGURES[2]),
        FIGURES[3]: _fig_cpu(runs, labels, out / FIGURES[3]),
        FIGURES[4]: draw_timeline(runs, labels, out / FIGURES[4]),
    }
