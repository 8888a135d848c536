"""How a dataset and collate function travel to DataServer workers.

Without a token: as import path plus JSON arguments (a dataset defines ``helix_spec()``; a
collate function is a module-level function) — never pickle. With a token-authenticated cluster
(an embedded one always has a token), cloudpickle is allowed, so a dataset class defined in a
training script just works.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import sys
import types

__all__ = ["import_path", "json_collate", "load_spec", "make_spec", "resolve", "sample_path"]

_DEFAULT_COLLATE = "torch.utils.data:default_collate"


def resolve(target: str):
    """Import ``"package.module:Qualname"`` (or ``"package.module.Qualname"``)."""
    if ":" in target:
        mod, qual = target.split(":", 1)
    else:
        mod, _, qual = target.rpartition(".")
    if not mod or not qual:
        raise ValueError(f"import path {target!r} must look like 'package.module:Name'")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def import_path(fn) -> str | None:
    """``"module:qualname"`` when ``fn`` can be imported back by that name, else None."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not mod or not qual or "<" in qual or mod == "__main__":
        return None
    try:
        return f"{mod}:{qual}" if resolve(f"{mod}:{qual}") is fn else None
    except (ImportError, AttributeError, ValueError):
        return None


def json_collate(fn) -> bool:
    """Whether a JSON spec (no token) may name ``fn`` as collate: a module-level Python function
    outside the standard library (a spec may come from any local peer)."""
    module = getattr(fn, "__module__", None) or ""
    return isinstance(fn, types.FunctionType) and bool(module) and module.split(".")[0] not in sys.stdlib_module_names


def make_spec(dataset, collate_fn, pickle_allowed: bool) -> tuple[str, bytes, str]:
    """``(spec_id, payload, format)`` for ``Configure``; raises ``ValueError`` saying how to make it
    travel when it needs pickle and the cluster has no token."""
    from torch.utils.data import default_collate

    collate_path = (_DEFAULT_COLLATE if collate_fn in (None, default_collate)
                    else import_path(collate_fn) if json_collate(collate_fn) else None)
    ds_spec = dataset.helix_spec() if hasattr(dataset, "helix_spec") else None
    if ds_spec is not None and collate_path is not None:
        payload = json.dumps({"dataset": ds_spec, "collate_fn": collate_path}, sort_keys=True).encode()
        fmt = "json"
    elif pickle_allowed:
        import cloudpickle

        payload, fmt = cloudpickle.dumps({"dataset": dataset, "collate_fn": collate_fn or default_collate}), "cloudpickle"
    else:
        what = (f"dataset {type(dataset).__name__} (it has no helix_spec())" if ds_spec is None
                else f"collate_fn {collate_fn!r} (not an importable module-level Python function outside the "
                     "standard library)")
        raise ValueError(f"{what} cannot travel to the DataServers without pickle, and this cluster has no "
                         "token. Start the cluster with a token (LocalCluster(token=...), `helix coordinator "
                         "--token-file`, or HELIX_TOKEN) so cloudpickle is allowed, or make it importable.")
    return hashlib.sha256(fmt.encode() + payload).hexdigest()[:16], payload, fmt


def load_spec(payload: bytes, fmt: str, allow_pickle: bool):
    """The worker side of ``make_spec``: ``(dataset, collate_fn)``."""
    import torch

    if fmt == "cloudpickle":
        if not allow_pickle:
            raise PermissionError("refusing a pickled dataset spec: this DataServer has no token")
        import cloudpickle

        spec = cloudpickle.loads(payload)
        return spec["dataset"], spec["collate_fn"]
    if fmt != "json":
        raise ValueError(f"dataset spec format {fmt!r}; valid: json, cloudpickle")
    spec = json.loads(payload)
    cls = resolve(spec["dataset"]["target"])
    if not (isinstance(cls, type) and issubclass(cls, torch.utils.data.Dataset)):
        raise TypeError(f"{spec['dataset']['target']} is not a torch Dataset class")
    collate = resolve(spec.get("collate_fn") or _DEFAULT_COLLATE)
    if not json_collate(collate):
        raise TypeError(f"collate_fn {spec.get('collate_fn')} is not a module-level Python function outside "
                        "the standard library")
    return cls(**spec["dataset"].get("kwargs", {})), collate


def sample_path(dataset, index: int) -> str:
    fn = getattr(dataset, "sample_path", None)
    try:
        return str(fn(index)) if fn is not None else ""
    except Exception:
        return ""
