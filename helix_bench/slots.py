"""Decode slots over the measured steps: how busy the decoders were, and a timeline to see the gaps.

Each decode (a ``TimedClipDataset.fetch``) is a span ``[start, end]`` in the process that ran it
(``decode-<pid>.log``). ``slot_busy`` integrates ``min(decoding processes, slots)`` over the
window: 1.0 means every slot decoded all the time, so any gap — the hand-over between decodes, a
worker waiting for a request, an epoch or window edge — shows as a fraction lost. ``timeline`` keeps
the spans (relative to the window's start) for the figure.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["decode_spans", "slot_busy", "timeline"]


def decode_spans(folder: str | os.PathLike, t0: float, t1: float) -> dict[int, list[tuple[float, float]]]:
    """``{pid: [(start, end), ...]}``: decode spans that overlap ``[t0, t1]``, clipped to it
    (``time.time()`` seconds). Lines without a start (an older log) are left out."""
    out: dict[int, list[tuple[float, float]]] = {}
    for path in sorted(Path(folder).glob("decode-*.log")):
        pid = int(path.stem.split("-")[1])
        for line in path.read_text(encoding="ascii", errors="replace").splitlines():
            parts = line.split()
            if len(parts) != 4:
                continue
            try:
                end, start = float(parts[0]), float(parts[3])
            except ValueError:
                continue
            if end >= t0 and start <= t1:
                out.setdefault(pid, []).append((max(start, t0), min(end, t1)))
    return out


def slot_busy(spans: dict[int, list[tuple[float, float]]], slots: int, t0: float, t1: float) -> dict:
    """``busy_fraction``: the integral of ``min(decoding, slots)`` over ``[t0, t1]`` divided by
    ``slots * (t1 - t0)``; ``by_process``: each decoding process's busy fraction of the window."""
    events = sorted([(s, 1) for v in spans.values() for s, _ in v] + [(e, -1) for v in spans.values() for _, e in v])
    busy, active, last = 0.0, 0, t0
    for t, d in events:
        busy += min(active, slots) * (t - last)
        active, last = active + d, t
    window = max(t1 - t0, 1e-9)
    return {
        "slots": slots,
        "busy_fraction": busy / (slots * window),
        "by_process": {pid: sum(e - s for s, e in v) / window for pid, v in sorted(spans.items())},
    }


def timeline(spans: dict[int, list[tuple[float, float]]], t0: float) -> list[list[list[float]]]:
    """The spans per process (one lane each, by pid) as seconds from ``t0``, rounded to 0.1 ms."""
    return [[[round(s - t0, 4), round(e - t0, 4)] for s, e in sorted(v)] for _, v in sorted(spans.items())]


def draw_timeline(runs: list, labels: list[str], path: Path) -> Path:
    """One panel per run and system: each decoding process a lane of its decode spans over the
    measured window, titled with the slots' busy fraction (gaps are time the CPU could have decoded)."""
    from matplotlib.figure import Figure

    rows = [[(name, m) for name, m in (run.get("systems") or {}).items() if m.get("decode_timeline")] for run in runs]
    cols = max([len(r) for r in rows] + [1])
    fig = Figure(figsize=(4.2 * cols, 2.4 * max(len(rows), 1)), layout="constrained")
    axes = fig.subplots(max(len(rows), 1), cols, squeeze=False)
    for i, (row, label) in enumerate(zip(rows or [[]], labels or [""])):
        for j in range(cols):
            ax = axes[i][j]
            if j >= len(row):
                ax.set_axis_off()
                continue
            name, m = row[j]
            for lane, spans in enumerate(m["decode_timeline"]):
                ax.broken_barh([(s, e - s) for s, e in spans], (lane - 0.4, 0.8), color="tab:green")
            ax.set_yticks(
                range(len(m["decode_timeline"])),
                [f"p{k}" for k in range(len(m["decode_timeline"]))],
                fontsize="x-small",
            )
            ax.set_xlabel("seconds into the measured steps", fontsize="x-small")
            busy = m.get("decode_slots_busy")
            ax.set_title(
                f"{name} — {label}\nslots busy {busy:.0%} of {m.get('decode_slots')}"
                if busy is not None
                else f"{name} — {label}",
                fontsize="small",
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
