"""A bench run's schema, its validation and ``results.json``.

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

from helix_bench.metrics import SYSTEM_METRIC_KEYS

__all__ = ["BOUND_KEYS", "RUN_KEYS", "validate_run", "write_results"]

RUN_KEYS = (
    "workload",
    "regime",
    "window_scale",
    "ranks",
    "budget",
    "batch_size",
    "steps",
    "warmup",
    "ddl_tolerance_s",
    "bound",
    "systems",
)
BOUND_KEYS = ("throughput_sps", "decode_s", "gpu_s")


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


def prepare(runs) -> list[dict]:
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
    data = prepare(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    tmp = path.with_suffix(".json.tmp")
    body = data[0] if len(data) == 1 else {"runs": data}
    tmp.write_text(json.dumps(body, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
