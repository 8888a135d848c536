"""Benchmark metrics (docs/guide/bench.md, "Metrics"): per-step records in, one plain dict per system out.

Pure: plain data in, plain data out; no processes, no clocks. Every time is in seconds unless a
name ends in ``_us`` (microseconds); bytes are bytes; rates are fractions in 0..1.

A measured step of one rank is ``input wait`` (blocked in ``next(loader)``) + ``compute`` (the
emulated GPU window) + ``sync wait`` (the all_reduce barrier); ``step_s`` is measured on its own.
The physical bound (:class:`Bound`) says how fast the run could finish at best: decode can't beat
its CPU-seconds spread over the CPU slots, and the GPU can't beat perfectly token-balanced steps.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from helix_core.telemetry import percentile as _percentile

__all__ = [
    "PER_RANK_KEYS",
    "SYSTEM_METRIC_KEYS",
    "Bound",
    "StepRecord",
    "balanced_gpu_s",
    "percentile",
    "system_metrics",
]

#: Keys of the dict :func:`system_metrics` returns (``per_rank`` holds dicts with PER_RANK_KEYS).
SYSTEM_METRIC_KEYS = (
    "throughput_sps",
    "input_wait_p50_s",
    "input_wait_p95_s",
    "batch_ready_p95_s",
    "ddl_miss_rate",
    "step_time_p95_s",
    "sync_wait_mean_s",
    "cross_ds_bytes",
    "scheduler_overhead_us_p99",
    "cpu_util",
    "bound_fraction",
    "steps",
    "per_rank",
)
PER_RANK_KEYS = (
    "rank",
    "step_time_p95_s",
    "input_wait_mean_s",
    "input_wait_p95_s",
    "compute_mean_s",
    "sync_wait_mean_s",
    "ddl_miss_rate",
    "samples",
)


def _is_count(value) -> bool:
    """An int >= 0 (numpy ints included, bools not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _check_time(owner: str, name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{owner}: {name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True)
class StepRecord:
    """One measured step of one rank. Times in seconds.

    ``input_wait_s``: blocked in ``next(loader)``; ``compute_s``: the emulated GPU window;
    ``sync_wait_s``: time in the all_reduce barrier; ``step_s``: the whole step, measured on its
    own (not the sum of the parts); ``batch_ready_s``: dispatch -> batch complete at the client,
    None when the input system can't tell; ``samples``: samples in the rank's batch; ``tokens``:
    their visual tokens.
    """

    rank: int
    step: int
    input_wait_s: float
    compute_s: float
    sync_wait_s: float
    step_s: float
    batch_ready_s: float | None
    samples: int
    tokens: int

    def __post_init__(self):
        owner = f"StepRecord(rank={self.rank}, step={self.step})"
        for name in ("rank", "step", "samples", "tokens"):
            value = getattr(self, name)
            if not _is_count(value):
                raise ValueError(f"{owner}: {name} must be an int >= 0, got {value!r}")
        for name in ("input_wait_s", "compute_s", "sync_wait_s", "step_s"):
            _check_time(owner, name, getattr(self, name))
        if self.batch_ready_s is not None:
            _check_time(owner, "batch_ready_s", self.batch_ready_s)


@dataclass(frozen=True)
class Bound:
    """The physical bound of a run (docs/guide/bench.md, "Metrics"): it can't finish faster than
    ``max(decode_s / capacity, gpu_s)``.

    ``decode_s``: total decode CPU-seconds of the measured samples at single-decoder speed
    (measured once per run); ``gpu_s``: sum over measured steps of the token-balanced GPU step
    time, seconds (:func:`balanced_gpu_s`); ``cpu_slots``: min(CPU budget, cores); ``capacity``:
    the decode capacity measured on the machine — single-decoder work per wall second of
    ``cpu_slots`` decoders running together (e.g. 1.85 on two vCPUs, not 2); None: ``cpu_slots``;
    ``samples``: samples consumed over the measured steps, all ranks.
    """

    decode_s: float
    gpu_s: float
    cpu_slots: int
    samples: int
    capacity: float | None = None

    def __post_init__(self):
        _check_time("Bound", "decode_s", self.decode_s)
        _check_time("Bound", "gpu_s", self.gpu_s)
        if not _is_count(self.cpu_slots) or self.cpu_slots < 1:
            raise ValueError(f"Bound: cpu_slots must be an int >= 1 (min(budget, cores)), got {self.cpu_slots!r}")
        if not _is_count(self.samples) or self.samples < 1:
            raise ValueError(f"Bound: samples must be an int >= 1, got {self.samples!r}")
        if self.capacity is not None and not (
            math.isfinite(self.capacity) and 0 < self.capacity <= self.cpu_slots * 1.1
        ):
            raise ValueError(f"Bound: capacity must be in (0, ~cpu_slots] decoders, got {self.capacity!r}")
        if self.time_s <= 0:
            raise ValueError("Bound: decode_s and gpu_s are both 0, so the bound time is 0 (nothing measured?)")

    @property
    def decoders(self) -> float:
        """Decode capacity in single-decoder units: the measured one, else ``cpu_slots``."""
        return self.capacity if self.capacity is not None else float(self.cpu_slots)

    @property
    def cpu_time_s(self) -> float:
        """Seconds the decode needs with every CPU slot busy."""
        return self.decode_s / self.decoders

    @property
    def time_s(self) -> float:
        """Shortest possible wall time of the measured steps, seconds."""
        return max(self.cpu_time_s, self.gpu_s)

    @property
    def throughput_sps(self) -> float:
        """Highest possible throughput, samples/s."""
        return self.samples / self.time_s

    @property
    def limited_by(self) -> str:
        """``"cpu"`` when decode sets the bound, else ``"gpu"`` (a tie counts as gpu)."""
        return "cpu" if self.cpu_time_s > self.gpu_s else "gpu"

    def as_dict(self) -> dict:
        """The fields and the derived values, for ``results.json``'s ``bound``."""
        return {
            "throughput_sps": self.throughput_sps,
            "time_s": self.time_s,
            "limited_by": self.limited_by,
            "decode_s": self.decode_s,
            "cpu_time_s": self.cpu_time_s,
            "gpu_s": self.gpu_s,
            "cpu_slots": self.cpu_slots,
            "decode_capacity": self.decoders,
            "samples": self.samples,
        }


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (``q`` in 0..100) of ``values`` with linear interpolation (numpy's
    default method); NaN when ``values`` is empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in 0..100, got {q!r}")
    return float(_percentile(values, q))


def balanced_gpu_s(step_sample_costs: Sequence[Sequence[float]], ranks: int, overhead_s: float) -> float:
    """GPU seconds of the measured steps if every step were perfectly balanced across ranks.

    ``step_sample_costs[i]``: the GPU seconds of each sample of global step ``i``, all ranks
    together; a balanced step takes ``sum / ranks + overhead_s`` (``overhead_s``: the fixed part
    of a step, seconds). Returns the sum over steps, seconds.
    """
    if not _is_count(ranks) or ranks < 1:
        raise ValueError(f"balanced_gpu_s: ranks must be an int >= 1, got {ranks!r}")
    _check_time("balanced_gpu_s", "overhead_s", overhead_s)
    total = 0.0
    for i, costs in enumerate(step_sample_costs):
        for cost in costs:
            _check_time("balanced_gpu_s", f"step {i} sample cost", cost)
        total += math.fsum(costs) / ranks + overhead_s
    return total


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def _miss_rate(waits: Sequence[float], tolerance_s: float) -> float:
    """Fraction of steps whose input wait exceeds the tolerance (equal to it is not a miss)."""
    return sum(w > tolerance_s for w in waits) / len(waits)


def _by_rank(records: Sequence[StepRecord]) -> dict[int, list[StepRecord]]:
    """Records grouped by rank, each sorted by step; checks the run is complete and rectangular."""
    if not records:
        raise ValueError("system_metrics: no records (a system that did not run should be reported as skipped)")
    by_rank: dict[int, list[StepRecord]] = {}
    for r in records:
        if not isinstance(r, StepRecord):
            raise ValueError(f"system_metrics: records must be StepRecord, got {type(r).__name__}")
        by_rank.setdefault(r.rank, []).append(r)
    for rank, rs in by_rank.items():
        rs.sort(key=lambda r: r.step)
        steps = [r.step for r in rs]
        if len(set(steps)) != len(steps):
            dup = sorted({s for s in steps if steps.count(s) > 1})
            raise ValueError(f"system_metrics: rank {rank} has duplicate records for steps {dup}")
    counts = {rank: len(rs) for rank, rs in sorted(by_rank.items())}
    if len(set(counts.values())) > 1:
        raise ValueError(f"system_metrics: ranks have different step counts {counts} (steps per rank)")
    return dict(sorted(by_rank.items()))


def _rank_row(rank: int, rs: Sequence[StepRecord], tolerance_s: float) -> dict:
    waits = [r.input_wait_s for r in rs]
    return {
        "rank": int(rank),
        "step_time_p95_s": percentile([r.step_s for r in rs], 95),
        "input_wait_mean_s": _mean(waits),
        "input_wait_p95_s": percentile(waits, 95),
        "compute_mean_s": _mean([r.compute_s for r in rs]),
        "sync_wait_mean_s": _mean([r.sync_wait_s for r in rs]),
        "ddl_miss_rate": _miss_rate(waits, tolerance_s),
        "samples": int(sum(r.samples for r in rs)),
    }


def system_metrics(
    records: Sequence[StepRecord],
    *,
    ddl_tolerance_s: float,
    bound: Bound,
    cross_ds_bytes: int = 0,
    scheduler_overhead_us: Iterable[float] = (),
    cpu_util: float | None = None,
) -> dict:
    """The metrics of one system's run (docs/guide/bench.md, "Metrics"), as a plain dict.

    ``records``: every measured step of every rank (warm-up excluded); ``ddl_tolerance_s``: a step
    whose input wait exceeds it (strictly) is a DDL miss; ``bound``: the run's physical bound (its
    ``samples`` must equal the records' samples); ``cross_ds_bytes``: payload bytes moved between
    DataServers; ``scheduler_overhead_us``: microseconds per placement decision; ``cpu_util``:
    busy fraction of the CPU budget (0..1), None when not measured.

    Keys (:data:`SYSTEM_METRIC_KEYS`): ``throughput_sps`` (samples of all ranks / measured wall
    time, which is the max over ranks of the sum of that rank's ``step_s``); ``input_wait_p50_s``,
    ``input_wait_p95_s``, ``batch_ready_p95_s`` (NaN when no record has one), ``step_time_p95_s``
    and ``ddl_miss_rate``, all pooled over every (rank, step); ``sync_wait_mean_s``;
    ``cross_ds_bytes``; ``scheduler_overhead_us_p99`` (NaN when empty); ``cpu_util``;
    ``bound_fraction`` (throughput / the bound's); ``steps`` (measured steps per rank); and
    ``per_rank``: one dict per rank, sorted by rank, with :data:`PER_RANK_KEYS`.
    """
    by_rank = _by_rank(records)
    _check_time("system_metrics", "ddl_tolerance_s", ddl_tolerance_s)
    if not isinstance(bound, Bound):
        raise ValueError(f"system_metrics: bound must be a Bound, got {type(bound).__name__}")
    if not _is_count(cross_ds_bytes):
        raise ValueError(f"system_metrics: cross_ds_bytes must be an int >= 0, got {cross_ds_bytes!r}")
    overhead_us = [float(x) for x in scheduler_overhead_us]
    if any(not (math.isfinite(x) and x >= 0) for x in overhead_us):
        raise ValueError("system_metrics: scheduler_overhead_us must hold finite microseconds >= 0")
    if cpu_util is not None and not (isinstance(cpu_util, numbers.Real) and 0 <= cpu_util <= 1):
        raise ValueError(f"system_metrics: cpu_util must be a fraction in 0..1 or None, got {cpu_util!r}")

    flat = [r for rs in by_rank.values() for r in rs]
    samples = int(sum(r.samples for r in flat))
    if samples != bound.samples:
        raise ValueError(
            f"system_metrics: the records hold {samples} samples but the bound was computed "
            f"for {bound.samples}; bound_fraction would compare different work"
        )
    wall_s = max(math.fsum(r.step_s for r in rs) for rs in by_rank.values())
    if wall_s <= 0:
        raise ValueError("system_metrics: measured wall time is 0 (every step_s is 0)")
    throughput = samples / wall_s
    waits = [r.input_wait_s for r in flat]
    return {
        "throughput_sps": throughput,
        "input_wait_p50_s": percentile(waits, 50),
        "input_wait_p95_s": percentile(waits, 95),
        "batch_ready_p95_s": percentile([r.batch_ready_s for r in flat if r.batch_ready_s is not None], 95),
        "ddl_miss_rate": _miss_rate(waits, ddl_tolerance_s),
        "step_time_p95_s": percentile([r.step_s for r in flat], 95),
        "sync_wait_mean_s": _mean([r.sync_wait_s for r in flat]),
        "cross_ds_bytes": int(cross_ds_bytes),
        "scheduler_overhead_us_p99": percentile(overhead_us, 99),
        "cpu_util": None if cpu_util is None else float(cpu_util),
        "bound_fraction": throughput / bound.throughput_sps,
        "steps": len(next(iter(by_rank.values()))),
        "per_rank": [_rank_row(rank, rs, ddl_tolerance_s) for rank, rs in by_rank.items()],
    }
