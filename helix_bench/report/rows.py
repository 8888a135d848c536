"""The bench report's tables as rows of strings: the main table (:data:`HEADERS`, one row per
system), where the CPU went, and Tier 2's rounds; ``report.py`` writes them out."""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["HEADERS", "cpu_rows", "table_rows", "tier2_rows"]

HEADERS = (
    "System",
    "Throughput (samples/s)",
    "vs native",
    "vs ray",
    "Bound (%)",
    "Input wait p50 (s)",
    "Input wait p95 (s)",
    "Batch ready p95 (s)",
    "DDL miss (%)",
    "Step time p95 (s)",
    "Sync wait mean (s)",
    "Imbalance",
    "Decode eff. (%)",
    "Cross-DS (MB)",
    "Sched. p99 (µs)",
    "CPU util (%)",
)
_BASELINE = "native"


# ---------------------------------------------------------------- the table
def num(v) -> float:
    return math.nan if v is None else float(v)


def fmt(v, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    v = num(v)
    return "n/a" if math.isnan(v) else f"{v * scale:{spec}}{suffix}"


def _fmt_s(v) -> str:
    """Seconds: four decimals below 1 s (0.1 ms resolution), three up to 100 s, one above."""
    v = num(v)
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
        ratio = num(m["throughput_sps"]) / num(base) if base else math.nan
        vs_ray = num(m["throughput_sps"]) / num(ray) if ray else math.nan
        rows.append(
            [
                name,
                fmt(m["throughput_sps"], ".2f"),
                fmt(ratio, ".2f", suffix="x"),
                fmt(vs_ray, ".2f", suffix="x"),
                fmt(m["bound_fraction"], ".1f", 100),
                _fmt_s(m["input_wait_p50_s"]),
                _fmt_s(m["input_wait_p95_s"]),
                _fmt_s(m["batch_ready_p95_s"]),
                fmt(m["ddl_miss_rate"], ".1f", 100),
                _fmt_s(m["step_time_p95_s"]),
                _fmt_s(m["sync_wait_mean_s"]),
                fmt(m.get("imbalance_ratio"), ".3f"),
                fmt(m.get("decode_efficiency"), ".1f", 100),
                fmt(m["cross_ds_bytes"], ".1f", 1e-6),
                fmt(m["scheduler_overhead_us_p99"], ".1f"),
                fmt(m["cpu_util"], ".1f", 100),
            ]
        )
    return rows


def cpu_rows(run: Mapping) -> tuple[list[str], list[list[str]]]:
    """Where the CPU went: headers and one row per system that measured it (CPU-seconds per role
    over the measured steps, their total, decode efficiency, cost-prediction error start -> end, and
    the pieces work stealing split batches into over the run, warm-up included)."""
    ran = {n: m for n, m in _ran(run).items() if m.get("cpu_s_by_role")}
    roles = sorted({k for m in ran.values() for k in m["cpu_s_by_role"]}, key=lambda k: (k != "decode", k))
    headers = [
        "System",
        *[f"{r} (CPU-s)" for r in roles],
        "total (CPU-s)",
        "Decode eff. (%)",
        "Slots busy (%)",
        "Cost error start → end (%)",
        "Stolen pieces",
    ]
    rows = []
    for name, m in ran.items():
        by = m["cpu_s_by_role"]
        err = (
            f"{fmt(m.get('cost_error_start'), '.0f', 100)} → {fmt(m.get('cost_error_end'), '.0f', 100)}"
            if m.get("cost_error_start") is not None
            else "n/a"
        )
        rows.append(
            [
                name,
                *[fmt(by.get(r, 0.0), ".1f") for r in roles],
                fmt(sum(by.values()), ".1f"),
                fmt(m.get("decode_efficiency"), ".1f", 100),
                fmt(m.get("decode_slots_busy"), ".1f", 100),
                err,
                str(m["stolen"]) if m.get("stolen") is not None else "n/a",
            ]
        )
    return headers, rows


def tier2_rows(run: Mapping) -> tuple[list[str], list[list[str]]]:
    """Tier 2's rounds per system that ran them (``tier2_rounds``): by outcome, the gain the gate
    projected against the gain realised (slowest rank's GPU seconds before minus after each moved
    round), the predicted transfer, what moved, the rounds' median wait and why the ranks' rounds
    closed (complete, timeout, asked: a rank waited for its batch; full, flush), the median over the rounds
    a policy decided of the wait for input per step that the default gate discounted, and the
    imbalance floor that moves within a step could reach on the steps consumed."""
    headers = [
        "System",
        "Rounds",
        "Moved / kept / alone / error",
        "Projected gain (s)",
        "Realised gain (s)",
        "Transfer est. (s)",
        "Samples moved",
        "MB moved",
        "Round wait p50 (s)",
        "Closed by",
        "Input wait p50 (s)",
        "Kept: projected / floor gain (s)",
        "Imbalance → floor",
    ]
    rows = []
    for name, m in _ran(run).items():
        t = m.get("tier2_rounds")
        if not t:
            continue
        rows.append(
            [
                name,
                str(t["rounds"]),
                f"{t['moved']} / {t['kept']} / {t['alone']} / {t['error']}",
                fmt(t["projected_gain_s"], ".2f"),
                fmt(t["realised_gain_s"], ".2f"),
                fmt(t["transfer_s"], ".3f"),
                str(t["moved_samples"]),
                fmt(t["moved_bytes"], ".0f", 1e-6),
                _fmt_s(t["wait_s_p50"]),
                ", ".join(f"{k} {v}" for k, v in sorted((t.get("closed_by") or {}).items())) or "n/a",
                _fmt_s(t.get("input_wait_s_p50")),
                f"{fmt(t.get('kept_projected_gain_s'), '.2f')} / {fmt(t.get('kept_floor_gain_s'), '.2f')}",
                f"{fmt(m.get('imbalance_ratio'), '.3f')} → {fmt(m.get('imbalance_within_step_floor'), '.3f')}",
            ]
        )
    return headers, rows
