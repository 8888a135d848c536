"""Bench report: ``results.json``, ``report.md`` and PNG figures (paper Table 2, Fig. 2, 8, 10).

What a *run* is and ``results.json``: ``runs.py``; the tables' rows: ``reportrows.py``. Here: the
runs' labels and headings, ``report.md``, the console table and :func:`write_report`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from helix_bench.report.figures import CAPTIONS, FIGURES, draw_figures
from helix_bench.report.rows import HEADERS, cpu_rows, fmt, num, table_rows, tier2_rows
from helix_bench.runs import RUN_KEYS, prepare, write_results

__all__ = ["FIGURES", "print_table", "run_label", "write_report"]

_LABEL_KEYS = {
    "regime": "{}",
    "batch_size": "bs{}",
    "ranks": "{} ranks",
    "budget": "budget {}",
    "remote_servers": "rd{}",
}  # how a key that varies across a sweep shows in a label


def run_label(run: Mapping, runs: Sequence[Mapping] = ()) -> str:
    """A short name: ``run["label"]`` if given, else the workload plus every other scalar key
    whose value differs between ``runs`` (a sweep's axis: batch size, sidecars, ...)."""
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
    decode, gpu, slots = num(bound.get("decode_s")), num(bound.get("gpu_s")), bound.get("cpu_slots")
    capacity = bound.get("decode_capacity") or slots
    limited = bound.get("limited_by")
    if limited is None and capacity:
        limited = "cpu" if decode / capacity > gpu else "gpu"
    probes = bound.get("capacity_probes") or []
    if capacity:
        spread = f" (median of {len(probes)} probes, {min(probes):.2f}–{max(probes):.2f})" if len(probes) > 1 else ""
        cpu = (
            f"decode {decode:.2f} CPU-s / {capacity:.2f} decoders' capacity{spread} measured on {slots} slots = "
            f"{decode / capacity:.2f} s"
        )
    else:
        cpu = f"decode {decode:.2f} CPU-s"
    return (
        f"Physical bound: {fmt(bound['throughput_sps'], '.2f')} samples/s, limited by "
        f"{(limited or 'n/a').upper()} ({cpu}; token-balanced GPU {gpu:.2f} s)"
    )


def _heading(run: Mapping) -> tuple[str, list[str]]:
    title = (
        f"{run['workload']} · {run['regime']} · {run['ranks']} ranks · CPU budget {run['budget']} · "
        f"batch size {run['batch_size']}"
    )
    facts = [
        f"{run['steps']} measured steps per rank after {run['warmup']} warm-up; DDL tolerance "
        f"{fmt(run['ddl_tolerance_s'], '.1f', 1e3)} ms; GPU window scale {fmt(run['window_scale'], '.3g')}",
        _bound_line(run["bound"]),
    ]
    extras = {
        k: v
        for k, v in run.items()
        if k not in RUN_KEYS and k not in ("note", "label") and not isinstance(v, (Mapping, list))
    }
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
            lines += [
                "Where the CPU went over the measured steps (decode = thread CPU of the decode calls; "
                "the decoding processes' role keeps the rest):",
                "",
            ]
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

    run = prepare(run)[0]
    title, facts = _heading(run)
    caption = facts[1] + (f"\n{run['note']}" if run.get("note") else "")
    rows = table_rows(run)
    wide = sum(max(len(h), *(len(r[i]) for r in rows)) + 3 for i, h in enumerate(HEADERS)) <= console.width
    table = Table(title=title, caption=caption)
    if wide:  # one row per system, as in report.md
        for i, header in enumerate(HEADERS):
            table.add_column(header, justify="left" if i == 0 else "right", overflow="fold")
        for row in rows:
            table.add_row(row[0], f"[dim]{row[1]}[/dim]", *row[2:]) if row[1].startswith(
                "skipped: "
            ) else table.add_row(*row)
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
    data = prepare(runs)
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
