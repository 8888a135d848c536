"""Bench report: ``results.json``, ``report.md`` and PNG figures (paper Table 2, Fig. 2, 8, 10).

A *run* is one ``helix bench`` configuration: a dict with :data:`RUN_KEYS` whose ``systems`` maps a
system name to :func:`helix_core.bench.metrics.system_metrics`'s dict, or to
``{"skipped": "reason"}`` for a system that could not run. Optional keys: ``note`` (printed under
the run's heading), ``label`` (the run's name in figures; by default the workload plus whatever
differs between the runs of a sweep, e.g. ``remote_servers``). Times are seconds, bytes are bytes,
``*_us`` are microseconds; the report shows MB (1e6 bytes) and percentages.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from .metrics import SYSTEM_METRIC_KEYS

__all__ = [
    "BOUND_KEYS", "FIGURES", "RUN_KEYS", "print_table", "run_label", "table_rows", "validate_run",
    "write_report", "write_results",
]

RUN_KEYS = ("workload", "regime", "window_scale", "ranks", "budget", "batch_size", "steps", "warmup",
            "ddl_tolerance_s", "bound", "systems")
BOUND_KEYS = ("throughput_sps", "decode_s", "gpu_s")
FIGURES = ("fig2_step_time_p95.png", "fig8_wait_breakdown.png", "fig10_throughput.png")
HEADERS = ("System", "Throughput (samples/s)", "vs native", "Bound (%)", "Input wait p50 (s)",
           "Input wait p95 (s)", "Batch ready p95 (s)", "DDL miss (%)", "Step time p95 (s)",
           "Sync wait mean (s)", "Cross-DS (MB)", "Sched. p99 (µs)", "CPU util (%)")
_BASELINE = "native"
_SYSTEM_COLORS = {"native": "tab:gray", "ray": "tab:orange", "helix": "tab:blue"}
_OTHER_COLORS = ("tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:red")
_LABEL_KEYS = {"regime": "{}", "batch_size": "bs{}", "ranks": "{} ranks", "budget": "budget {}",
               "remote_servers": "rd{}"}  # how a key that varies across a sweep shows in a label


# ---------------------------------------------------------------- schema and results.json
def _jsonable(obj):
    """Plain JSON data: NaN and infinities become None, numpy scalars Python numbers, tuples
    lists, paths strings, objects with ``as_dict()`` (a ``Bound``) their dict."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "as_dict"):
        return _jsonable(obj.as_dict())
    raise ValueError(f"results: {type(obj).__name__} is not JSON data ({obj!r})")


def validate_run(run: Mapping, where: str = "run") -> None:
    """Raise ``ValueError`` naming every missing key of a run, its ``bound`` or a system."""
    if not isinstance(run, Mapping):
        raise ValueError(f"{where}: must be a dict, got {type(run).__name__}")
    missing = [k for k in RUN_KEYS if k not in run]
    if missing:
        raise ValueError(f"{where}: missing keys {missing} (a run needs {list(RUN_KEYS)})")
    bound, systems = run["bound"], run["systems"]
    if not isinstance(bound, Mapping) or [k for k in BOUND_KEYS if k not in bound]:
        have = list(bound) if isinstance(bound, Mapping) else type(bound).__name__
        raise ValueError(f"{where}: bound needs keys {list(BOUND_KEYS)}, got {have}")
    if not isinstance(systems, Mapping) or not systems:
        raise ValueError(f"{where}: systems must be a non-empty dict of name -> metrics or {{'skipped': reason}}")
    for name, m in systems.items():
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}: systems[{name!r}] must be a dict, got {type(m).__name__}")
        if "skipped" in m:
            if not isinstance(m["skipped"], str) or not m["skipped"]:
                raise ValueError(f"{where}: systems[{name!r}]['skipped'] must be the reason, a non-empty string")
            continue
        missing = [k for k in SYSTEM_METRIC_KEYS if k not in m]
        if missing:
            raise ValueError(f"{where}: systems[{name!r}] is missing keys {missing}")


def _prepare(runs) -> list[dict]:
    runs = [runs] if isinstance(runs, Mapping) else list(runs)
    if not runs:
        raise ValueError("results: no runs")
    data = [_jsonable(r) if isinstance(r, Mapping) else r for r in runs]
    for i, run in enumerate(data):
        validate_run(run, f"run {i}" if len(data) > 1 else "results")
    return data


def write_results(out_dir, results: Mapping | Sequence[Mapping]) -> Path:
    """Validate and write ``out_dir/results.json`` (indented; NaN written as null): the run's
    object for one run, ``{"runs": [...]}`` for a list of several. Returns the path."""
    data = _prepare(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    tmp = path.with_suffix(".json.tmp")
    body = data[0] if len(data) == 1 else {"runs": data}
    tmp.write_text(json.dumps(body, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


# ---------------------------------------------------------------- the table
def _num(v) -> float:
    return math.nan if v is None else float(v)


def _fmt(v, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    v = _num(v)
    return "n/a" if math.isnan(v) else f"{v * scale:{spec}}{suffix}"


def _fmt_s(v) -> str:
    """Seconds: four decimals below 1 s (0.1 ms resolution), three up to 100 s, one above."""
    v = _num(v)
    return "n/a" if math.isnan(v) else f"{v:.4f}" if v < 1 else f"{v:.3f}" if v < 100 else f"{v:.1f}"


def _ran(run: Mapping) -> dict:
    """The systems that ran (not skipped), in the run's order."""
    return {n: m for n, m in run["systems"].items() if "skipped" not in m}


def table_rows(run: Mapping) -> list[list[str]]:
    """One row of strings per system, columns as :data:`HEADERS`; a skipped system's row holds
    ``skipped: reason`` and blanks. The ratio is throughput over native's (n/a without native)."""
    base = _ran(run).get(_BASELINE, {}).get("throughput_sps")
    rows = []
    for name, m in run["systems"].items():
        if "skipped" in m:
            rows.append([name, f"skipped: {m['skipped']}"] + [""] * (len(HEADERS) - 2))
            continue
        ratio = _num(m["throughput_sps"]) / _num(base) if base else math.nan
        rows.append([
            name, _fmt(m["throughput_sps"], ".2f"), _fmt(ratio, ".2f", suffix="x"),
            _fmt(m["bound_fraction"], ".1f", 100), _fmt_s(m["input_wait_p50_s"]), _fmt_s(m["input_wait_p95_s"]),
            _fmt_s(m["batch_ready_p95_s"]), _fmt(m["ddl_miss_rate"], ".1f", 100), _fmt_s(m["step_time_p95_s"]),
            _fmt_s(m["sync_wait_mean_s"]), _fmt(m["cross_ds_bytes"], ".1f", 1e-6),
            _fmt(m["scheduler_overhead_us_p99"], ".1f"), _fmt(m["cpu_util"], ".1f", 100),
        ])
    return rows


def run_label(run: Mapping, runs: Sequence[Mapping] = ()) -> str:
    """A short name: ``run["label"]`` if given, else the workload plus every other scalar key
    whose value differs between ``runs`` (a sweep's axis: batch size, remote servers, ...)."""
    if run.get("label"):
        return str(run["label"])
    parts = [str(run["workload"])]
    skip = {"workload", "bound", "systems", "note", "label", "window_scale"}  # derived, not an axis
    for key in dict.fromkeys(k for r in runs for k in r):
        if key in skip or isinstance(run.get(key), (Mapping, list)):
            continue
        if len({json.dumps(r.get(key), sort_keys=True, default=str) for r in runs}) > 1:
            parts.append(_LABEL_KEYS.get(key, key + "={}").format(run.get(key)))
    return " ".join(parts)


def _bound_line(bound: Mapping) -> str:
    decode, gpu, slots = _num(bound.get("decode_s")), _num(bound.get("gpu_s")), bound.get("cpu_slots")
    limited = bound.get("limited_by")
    if limited is None and slots:
        limited = "cpu" if decode / slots > gpu else "gpu"
    cpu = f"decode {decode:.2f} CPU-s / {slots} slots = {decode / slots:.2f} s" if slots else f"decode {decode:.2f} CPU-s"
    return (f"Physical bound: {_fmt(bound['throughput_sps'], '.2f')} samples/s, limited by "
            f"{(limited or 'n/a').upper()} ({cpu}; token-balanced GPU {gpu:.2f} s)")


def _heading(run: Mapping) -> tuple[str, list[str]]:
    title = (f"{run['workload']} · {run['regime']} · {run['ranks']} ranks · CPU budget {run['budget']} · "
             f"batch size {run['batch_size']}")
    facts = [
        f"{run['steps']} measured steps per rank after {run['warmup']} warm-up; DDL tolerance "
        f"{_fmt(run['ddl_tolerance_s'], '.1f', 1e3)} ms; GPU window scale {_fmt(run['window_scale'], '.3g')}",
        _bound_line(run["bound"]),
    ]
    extras = {k: v for k, v in run.items()
              if k not in RUN_KEYS and k not in ("note", "label") and not isinstance(v, (Mapping, list))}
    if extras:  # the harness's own settings (remote_servers, ...): say them, they may explain the numbers
        facts.append("Also: " + ", ".join(f"{k} = {v}" for k, v in extras.items()))
    return title, facts


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _markdown(runs: list[dict], figures: Mapping[str, Path], figure_error: str | None) -> str:
    lines = ["# Helix bench report", ""]
    for run in runs:
        title, facts = _heading(run)
        label = run_label(run, runs)
        lines += [f"## {label}" if len(runs) > 1 else f"## {title}", ""]
        if len(runs) > 1:
            facts.insert(0, title)
        lines += [f"- {f}" for f in facts] + [""]
        if run.get("note"):
            lines += [f"> {_md_cell(run['note'])}", ""]
        lines += ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table_rows(run)]
        lines.append("")
    lines += ["## Figures", ""]
    if figure_error:
        lines.append(f"Figures not drawn: {figure_error}.")
    captions = {"fig2_step_time_p95.png": "Per-rank step-time p95 (paper Fig. 2)",
                "fig8_wait_breakdown.png": "Mean step breakdown: input wait, compute, sync wait (paper Fig. 8)",
                "fig10_throughput.png": "Throughput per run and system against the physical bound (paper Fig. 10)"}
    for name, path in figures.items():
        lines += [f"- [{captions[name]}]({path.name})", f"  ![{captions[name]}]({path.name})"]
    return "\n".join(lines) + "\n"


def print_table(console, run: Mapping) -> None:
    """Print the run's table (as in ``report.md``) to a ``rich.console.Console``."""
    from rich.table import Table

    run = _prepare(run)[0]
    title, facts = _heading(run)
    caption = facts[1] + (f"\n{run['note']}" if run.get("note") else "")
    rows = table_rows(run)
    wide = sum(max(len(h), *(len(r[i]) for r in rows)) + 3 for i, h in enumerate(HEADERS)) <= console.width
    table = Table(title=title, caption=caption)
    if wide:  # one row per system, as in report.md
        for i, header in enumerate(HEADERS):
            table.add_column(header, justify="left" if i == 0 else "right", overflow="fold")
        for row in rows:
            table.add_row(row[0], f"[dim]{row[1]}[/dim]", *row[2:]) if row[1].startswith("skipped: ") \
                else table.add_row(*row)
    else:  # a narrow terminal: one row per metric, one column per system
        table.add_column("", justify="left")
        for row in rows:
            table.add_column(row[0], justify="right", overflow="fold")
        for i, header in enumerate(HEADERS[1:], start=1):
            table.add_row(header, *(row[i] if i < len(row) else "" for row in rows))
    console.print(table)


# ---------------------------------------------------------------- figures
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


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, format="png")
    return path


def _fig2(runs, labels, colors, path: Path) -> Path:
    from matplotlib.figure import Figure

    widest = (max((len(m["per_rank"]) for r in runs for m in _ran(r).values()), default=1)
              * max(max(len(_ran(r)) for r in runs), 1))
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


_PARTS = (("input_wait_mean_s", "input wait", "tab:red"), ("compute_mean_s", "compute (GPU window)", "tab:blue"),
          ("sync_wait_mean_s", "sync wait", "tab:olive"))


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
        if not ticks:
            ax.text(0.5, 0.5, "no system ran", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"Mean step breakdown — {label}")
        ax.set_ylabel("seconds per step (mean)")
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.12)
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
                ax.annotate("skipped", (x, 0), xytext=(0, 4), textcoords="offset points", rotation=90,
                            ha="center", va="bottom", fontsize="x-small", color="0.4")
                continue
            xs.append(x)
            ys.append(_num(m["throughput_sps"]))
        bars = ax.bar(xs, ys, width, color=colors[name], label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize="x-small")
    for x, run in enumerate(runs):
        ax.hlines(_num(run["bound"]["throughput_sps"]), x - 0.45, x + 0.45, colors="k", linestyles="--",
                  label="physical bound" if x == 0 else None)
    ax.set_xticks(range(len(runs)), [textwrap.fill(label, 16) for label in labels])
    ax.set_title("End-to-end throughput per run and system")
    ax.set_xlabel("run")
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def write_report(out_dir, runs: Sequence[Mapping] | Mapping) -> dict[str, Path]:
    """Write ``results.json``, ``report.md`` and the :data:`FIGURES` into ``out_dir``.

    ``runs``: one run dict or a sweep (a list). Validates every run before writing anything.
    Returns ``{file name: path}`` for the files written; without matplotlib the figures are left
    out and ``report.md`` says so.
    """
    data = _prepare(runs)
    out = Path(out_dir)
    paths = {"results.json": write_results(out, data)}
    labels = [run_label(r, data) for r in data]
    figures: dict[str, Path] = {}
    try:
        import matplotlib  # noqa: F401  (the bench extra)
    except ImportError as e:
        figure_error = f"matplotlib is not installed ({e}); pip install 'helix[bench]'"
    else:
        figure_error = None
        colors = _colors(data)
        figures["fig2_step_time_p95.png"] = _fig2(data, labels, colors, out / FIGURES[0])
        figures["fig8_wait_breakdown.png"] = _fig8(data, labels, out / FIGURES[1])
        figures["fig10_throughput.png"] = _fig10(data, labels, colors, out / FIGURES[2])
    report = out / "report.md"
    report.write_text(_markdown(data, figures, figure_error), encoding="utf-8")
    paths["report.md"] = report
    paths.update(figures)
    return paths
