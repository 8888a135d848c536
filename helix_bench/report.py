"""Bench report: ``results.json``, ``report.md`` and PNG figures (paper Table 2, Fig. 2, 8, 10).

A *run* is one ``helix bench`` configuration: a dict with :data:`RUN_KEYS` whose ``systems`` maps a
system name to :func:`helix_bench.metrics.system_metrics`'s dict, or to
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
from collections.abc import Mapping, Sequence
from pathlib import Path

from .figures import CAPTIONS, FIGURES, draw_figures
from .metrics import SYSTEM_METRIC_KEYS

__all__ = [
    "BOUND_KEYS", "FIGURES", "RUN_KEYS", "cpu_rows", "print_table", "tier2_rows", "run_label", "table_rows", "validate_run",
    "write_report", "write_results",
]

RUN_KEYS = ("workload", "regime", "window_scale", "ranks", "budget", "batch_size", "steps", "warmup",
            "ddl_tolerance_s", "bound", "systems")
BOUND_KEYS = ("throughput_sps", "decode_s", "gpu_s")
HEADERS = ("System", "Throughput (samples/s)", "vs native", "vs ray", "Bound (%)", "Input wait p50 (s)",
           "Input wait p95 (s)", "Batch ready p95 (s)", "DDL miss (%)", "Step time p95 (s)",
           "Sync wait mean (s)", "Imbalance", "Decode eff. (%)", "Cross-DS (MB)", "Sched. p99 (µs)", "CPU util (%)")
_BASELINE = "native"
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
    ray = _ran(run).get("ray", {}).get("throughput_sps")
    rows = []
    for name, m in run["systems"].items():
        if "skipped" in m:
            rows.append([name, f"skipped: {m['skipped']}"] + [""] * (len(HEADERS) - 2))
            continue
        ratio = _num(m["throughput_sps"]) / _num(base) if base else math.nan
        vs_ray = _num(m["throughput_sps"]) / _num(ray) if ray else math.nan
        rows.append([
            name, _fmt(m["throughput_sps"], ".2f"), _fmt(ratio, ".2f", suffix="x"), _fmt(vs_ray, ".2f", suffix="x"),
            _fmt(m["bound_fraction"], ".1f", 100), _fmt_s(m["input_wait_p50_s"]), _fmt_s(m["input_wait_p95_s"]),
            _fmt_s(m["batch_ready_p95_s"]), _fmt(m["ddl_miss_rate"], ".1f", 100), _fmt_s(m["step_time_p95_s"]),
            _fmt_s(m["sync_wait_mean_s"]), _fmt(m.get("imbalance_ratio"), ".3f"),
            _fmt(m.get("decode_efficiency"), ".1f", 100), _fmt(m["cross_ds_bytes"], ".1f", 1e-6),
            _fmt(m["scheduler_overhead_us_p99"], ".1f"), _fmt(m["cpu_util"], ".1f", 100),
        ])
    return rows


def cpu_rows(run: Mapping) -> tuple[list[str], list[list[str]]]:
    """Where the CPU went: headers and one row per system that measured it (CPU-seconds per role
    over the measured steps, their total, decode efficiency, cost-prediction error start -> end)."""
    ran = {n: m for n, m in _ran(run).items() if m.get("cpu_s_by_role")}
    roles = sorted({k for m in ran.values() for k in m["cpu_s_by_role"]}, key=lambda k: (k != "decode", k))
    headers = ["System", *[f"{r} (CPU-s)" for r in roles], "total (CPU-s)", "Decode eff. (%)", "Slots busy (%)",
               "Cost error start → end (%)"]
    rows = []
    for name, m in ran.items():
        by = m["cpu_s_by_role"]
        err = (f"{_fmt(m.get('cost_error_start'), '.0f', 100)} → {_fmt(m.get('cost_error_end'), '.0f', 100)}"
               if m.get("cost_error_start") is not None else "n/a")
        rows.append([name, *[_fmt(by.get(r, 0.0), ".1f") for r in roles], _fmt(sum(by.values()), ".1f"),
                     _fmt(m.get("decode_efficiency"), ".1f", 100), _fmt(m.get("decode_slots_busy"), ".1f", 100), err])
    return headers, rows


def tier2_rows(run: Mapping) -> tuple[list[str], list[list[str]]]:
    """Tier 2's rounds per system that ran them (``tier2_rounds``): by outcome, the gain the gate
    projected against the gain realised (slowest rank's GPU seconds before minus after each moved
    round), the predicted transfer, what moved, the rounds' median wait, and the imbalance floor
    that moves within a step could reach on the steps consumed."""
    headers = ["System", "Rounds", "Moved / kept / alone / error", "Projected gain (s)", "Realised gain (s)",
               "Transfer est. (s)", "Samples moved", "MB moved", "Round wait p50 (s)", "Imbalance → floor"]
    rows = []
    for name, m in _ran(run).items():
        t = m.get("tier2_rounds")
        if not t:
            continue
        rows.append([name, str(t["rounds"]), f"{t['moved']} / {t['kept']} / {t['alone']} / {t['error']}",
                     _fmt(t["projected_gain_s"], ".2f"), _fmt(t["realised_gain_s"], ".2f"), _fmt(t["transfer_s"], ".3f"),
                     str(t["moved_samples"]), _fmt(t["moved_bytes"], ".0f", 1e-6), _fmt_s(t["wait_s_p50"]),
                     f"{_fmt(m.get('imbalance_ratio'), '.3f')} → {_fmt(m.get('imbalance_within_step_floor'), '.3f')}"])
    return headers, rows


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
    capacity = bound.get("decode_capacity") or slots
    limited = bound.get("limited_by")
    if limited is None and capacity:
        limited = "cpu" if decode / capacity > gpu else "gpu"
    if capacity:
        cpu = (f"decode {decode:.2f} CPU-s / {capacity:.2f} decoders' capacity measured on {slots} slots = "
               f"{decode / capacity:.2f} s")
    else:
        cpu = f"decode {decode:.2f} CPU-s"
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
        headers, rows = cpu_rows(run)
        if rows:
            lines += ["Where the CPU went over the measured steps (decode = thread CPU of the decode calls; "
                      "the decoding processes' role keeps the rest):", ""]
            lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            lines.append("")
        headers, rows = tier2_rows(run)
        if rows:
            lines += ["Tier-2 rounds (one per global step, joined over the ranks; warm-up steps included):", ""]
            lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            lines.append("")
    lines += ["## Figures", ""]
    if figure_error:
        lines.append(f"Figures not drawn: {figure_error}.")
    for name, path in figures.items():
        lines += [f"- [{CAPTIONS[name]}]({path.name})", f"  ![{CAPTIONS[name]}]({path.name})"]
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
        figures = draw_figures(data, labels, out)
    report = out / "report.md"
    report.write_text(_markdown(data, figures, figure_error), encoding="utf-8")
    paths["report.md"] = report
    paths.update(figures)
    return paths
