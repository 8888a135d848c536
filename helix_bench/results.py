"""One system's figures from a bench run: the samples it consumed checked against the sampler's,
step metrics, where its CPU went (by role, decode split out), how busy the decode slots were,
and the planner's imbalance ratio."""

from __future__ import annotations

import math
import os

import numpy as np

from helix_bench.ranks import BALANCED
from helix_core.tier2.rebalance import lpt_within_steps

__all__ = ["RAY_MODES", "system_result", "tier2_rounds"]

RAY_MODES = {"ray": "idle", "ray-rr": "rr"}  # Ray pool: idle-actor dispatch (as its users tune it), round robin
WORKER_ROLE = {"native": "loader-workers", "ray": "ray-decoders", "helix": "workers"}


def system_result(system, cfg, got, m, expected, spans, bound, decode, units, log_dir) -> dict:
    """One system's metrics: checked samples, step metrics, where the CPU went, planner ratio."""
    from helix_bench.cpuroles import cpu_by_role, decode_efficiency, split_decode
    from helix_bench.metrics import StepRecord, system_metrics
    from helix_bench.samples import check_consumed
    from helix_bench.slots import decode_spans, slot_busy, timeline
    from helix_bench.timed import read_decode_log
    from helix_core.planning.balance import imbalance_ratio

    records, overhead, cross, stats_by_rank, consumed = [], [], 0, [], []
    for _, rank, recs, extra in sorted(got, key=lambda g: g[1]):
        ready = extra.get("batch_ready_s") or []
        consumed.append([rec["indices"] for rec in sorted(recs, key=lambda r: r["step"])])
        for k, rec in enumerate(recs):
            records.append(
                StepRecord(
                    rank=rank,
                    step=rec["step"],
                    input_wait_s=rec["input_wait_s"],
                    compute_s=rec["compute_s"],
                    sync_wait_s=rec["sync_wait_s"],
                    step_s=rec["step_s"],
                    batch_ready_s=ready[k] if k < len(ready) else None,
                    samples=rec["samples"],
                    tokens=rec["tokens"],
                )
            )
        stats = extra.get("stats") or {}
        stats_by_rank.append(stats)
        cross += int(stats.get("cross_ds_bytes", 0) or 0)
        p99 = stats.get("scheduler_overhead_us_p99")
        if p99 is not None and not math.isnan(p99):  # native and ray make no placement decisions
            overhead.append(float(p99))
    check_consumed(system, consumed, expected, spans, balanced=system in BALANCED)
    out = system_metrics(
        records,
        ddl_tolerance_s=cfg.ddl_tolerance_s,
        bound=bound,
        cross_ds_bytes=cross,
        scheduler_overhead_us=overhead,
        cpu_util=_cpu_util(m),
    )
    steps = [[consumed[r][s] for r in range(len(consumed))] for s in range(len(consumed[0]))]
    out["imbalance_ratio"] = imbalance_ratio(steps, units.__getitem__)
    waits: dict[int, float] = {}
    for rec in records:  # the slowest rank's input wait per measured step: where the stalls are
        waits[rec.step] = max(waits.get(rec.step, 0.0), rec.input_wait_s)
    out["input_wait_max_by_step_s"] = [round(waits[k], 4) for k in sorted(waits)]
    out["gpu_units_by_step"] = [round(max(sum(units[i] for i in b) for b in step)) for step in steps]
    if "start" in m and "end" in m:
        (t0, before, _), (t1, after, _) = m["start"], m["end"]
        decode_cpu, _ = read_decode_log(log_dir, t0, t1)
        kind = "helix" if system.startswith("helix") else "ray" if system in RAY_MODES else "native"
        roles = split_decode(cpu_by_role(before, after), decode_cpu, WORKER_ROLE[kind])
        out["cpu_s_by_role"] = dict(sorted(roles.items()))
        out["decode_efficiency"] = decode_efficiency(sum(decode[i] for r in consumed for b in r for i in b), roles)
        spans_by_pid = decode_spans(log_dir, t0, t1)
        busy = slot_busy(spans_by_pid, min(cfg.budget, os.cpu_count() or 1), t0, t1)
        out["decode_slots_busy"] = busy["busy_fraction"]  # min(decoding, slots) over the window / slots
        out["decode_slots"] = busy["slots"]
        out["decode_timeline"] = timeline(spans_by_pid, t0)
    for key in ("cost_error_start", "cost_error_end", "route_us_p50", "route_us_p99"):
        vals = [st[key] for st in stats_by_rank if st.get(key) is not None and not math.isnan(st[key])]
        out[key] = float(np.median(vals)) if vals else None
    reasons: dict = {}
    for st in stats_by_rank:
        for k, v in (st.get("placement_reasons") or {}).items():
            reasons[k] = reasons.get(k, 0) + v
    out["placement_reasons"] = reasons
    if stats_by_rank and system.startswith("helix"):  # pieces beyond a batch's first, over the run
        out["stolen"] = sum(int(st.get("stolen") or 0) for st in stats_by_rank)
    rounds: dict = {}
    for st in stats_by_rank:  # Tier 2: rounds by outcome and samples moved, over the ranks
        for k, v in (st.get("rebalance") or {}).items():
            rounds[k] = rounds.get(k, 0) + v
    if rounds:
        out["rebalance"] = rounds
        out["rebalance_errors"] = sorted({e for st in stats_by_rank for e in st.get("rebalance_errors") or ()})[:5]
        work = sum(units[i] for rank in consumed for b in rank for i in b)  # the emulated window's seconds per unit
        spu = sum(r.compute_s for r in records) / work if work > 0 else 0.0
        out["tier2_rounds"] = tier2_rounds(stats_by_rank, units.__getitem__, spu)
    if system in BALANCED:  # the best any within-step move keeps-batch-size policy could do with these steps
        best = [_best_deal(step, units.__getitem__) for step in steps]
        out["imbalance_within_step_floor"] = imbalance_ratio(best, units.__getitem__)
    return out


def _best_deal(step: list[list[int]], cost) -> list[list[int]]:
    """One step's samples (a list of indices per rank) dealt again by equal-count LPT of ``cost(index)``:
    the best a within-step move that keeps every rank's batch size could do."""
    feats = [{"cost": float(cost(i)), "rank": r, "step": 0, "i": i} for r, b in enumerate(step) for i in b]
    to = lpt_within_steps(feats)
    return [[f["i"] for f, t in zip(feats, to) if t == r] for r in range(len(step))]


def tier2_rounds(stats_by_rank: list[dict], cost, seconds_per_unit: float) -> dict:
    """The ranks' views of each Tier-2 round (``stats()["rebalance_rounds"]``, one round a global
    step) joined: rounds seen by every rank, by outcome; the gain the leader projected for the rounds
    it moved against the gain realised — the slowest rank's GPU cost (``cost(index)``) before the
    round minus after it, in seconds at ``seconds_per_unit`` — the rounds' wait at the ranks, and the
    ranks' wait for input per step that the default gate discounted from its projection; for the
    rounds it kept, the gain it projected against the best within-step deal's (what it passed up)."""
    by_step: dict = {}
    for st in stats_by_rank:
        for rec in st.get("rebalance_rounds") or ():
            key = (rec.get("group"), rec.get("run"), rec["epoch"], rec["position"])
            by_step.setdefault(key, {})[rec.get("rank", len(by_step.get(key, {})))] = rec  # a rank's latest view
    out = {
        "rounds": 0,
        "moved": 0,
        "kept": 0,
        "alone": 0,
        "error": 0,
        "partial": 0,
        "projected_gain_s": 0.0,
        "realised_gain_s": 0.0,
        "transfer_s": 0.0,
        "moved_samples": 0,
        "moved_bytes": 0,
        "wait_s_p50": None,
        "input_wait_s_p50": None,
        "closed_by": {},
        "kept_floor_gain_s": 0.0,
        "kept_projected_gain_s": 0.0,
    }
    waits, input_waits = [], []
    for views in by_step.values():
        recs = list(views.values())
        waits += [r["wait_s"] for r in recs]
        for r in recs:  # why each rank's round closed (a round per step; "asked": a rank waited for it)
            out["closed_by"][r.get("closed_by") or "?"] = out["closed_by"].get(r.get("closed_by") or "?", 0) + 1
        if len(recs) < recs[0].get("group_size", len(stats_by_rank)):
            out["partial"] += 1  # a round whose other ranks' views fell outside the records kept
            continue
        out["rounds"] += 1
        kind = recs[0]["outcome"].split(":")[0]
        out[kind if kind in out else "error"] += 1
        if kind in ("kept", "moved"):  # rounds a policy decided: the wait per step the default gate discounted
            input_waits.append(recs[0].get("input_wait_s", 0.0))
        if kind == "kept" and all(r["before"] and min(r["before"]) >= 0 for r in recs):
            # what the gate passed up: the slowest rank now against the best within-step deal of the round
            before = [r["before"] for r in recs]
            slowest = [max(sum(cost(i) for i in b) for b in deal) for deal in (before, _best_deal(before, cost))]
            out["kept_floor_gain_s"] += max(0.0, slowest[0] - slowest[1]) * seconds_per_unit
            out["kept_projected_gain_s"] += recs[0]["gain_s"]
        if kind != "moved" or any(not r["before"] or min(r["before"] + r["after"]) < 0 for r in recs):
            continue  # (a round whose samples a rank did not name cannot be costed)
        slowest = [max(sum(cost(i) for i in r[side]) for r in recs) for side in ("before", "after")]
        out["projected_gain_s"] += recs[0]["gain_s"]
        out["realised_gain_s"] += (slowest[0] - slowest[1]) * seconds_per_unit
        out["transfer_s"] += recs[0]["transfer_s"]
        out["moved_samples"] += sum(r["moved_in"] for r in recs)
        out["moved_bytes"] += sum(r["moved_bytes"] for r in recs)
    if waits:
        out["wait_s_p50"] = float(np.median(waits))
    if input_waits:
        out["input_wait_s_p50"] = float(np.median(input_waits))
    return out


def _cpu_util(m: dict) -> float | None:
    if "start" not in m or "end" not in m:
        return None
    a, b = m["start"][2], m["end"][2]
    total = sum(b) - sum(a)
    idle = (b.idle + getattr(b, "iowait", 0)) - (a.idle + getattr(a, "iowait", 0))
    return max(0.0, min(1.0, 1 - idle / total)) if total > 0 else None
