"""How a dataset and collate function travel to DataServer workers.

As import path plus JSON arguments when they carry everything (a dataset defines ``helix_spec()``;
a collate function or transform is a module-level function of a module the servers can import,
``usercode.installed``); else by cloudpickle with the script's own modules by value
(``usercode.dumps``), which every cluster (all have a token) accepts over loopback or TLS, so a
dataset class or transform defined in or beside a training script just works — unless the cluster
runs ``--insecure`` beyond loopback or with ``ClusterConfig(allow_pickle=False)``: then the loader
refuses at construction, naming the argument, its module and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
import types

__all__ = [
    "function_path",
    "import_path",
    "json_function",
    "load_spec",
    "make_spec",
    "resolve",
    "resolve_function",
    "sample_path",
    "why_not_json",
]

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


def json_function(fn) -> bool:
    """Whether a JSON spec (no pickle) may name ``fn`` (a collate function, a transform): a
    module-level Python function outside the standard library (a spec may come from any local peer)."""
    module = getattr(fn, "__module__", None) or ""
    return isinstance(fn, types.FunctionType) and bool(module) and module.split(".")[0] not in sys.stdlib_module_names


def function_path(fn) -> str | None:
    """``"module:qualname"`` of a function a JSON spec may carry (``json_function``) and a server can
    import (``usercode.why_local``), else None."""
    from helix_core.data.usercode import why_local

    return import_path(fn) if json_function(fn) and why_local(fn) is None else None


def why_not_json(fn) -> str:
    """Why ``function_path(fn)`` is None, for an error message: what ``fn`` is and the fix."""
    from helix_core.data.usercode import why_local

    reason = why_local(fn) if isinstance(fn, types.FunctionType) else None
    if reason is None:
        return "not an importable module-level Python function outside the standard library"
    if "module" not in reason or "__main__" in reason:
        return f"{reason}: make it a module-level function of an installed module"
    if "register_pickle_by_value" in reason:
        return f"{reason}: it travels by value only"
    return f"{reason}: install it there (pip install), or put its folder on PYTHONPATH there and here"


def resolve_function(path: str, what: str):
    """The function a JSON spec names by ``path``; ``TypeError`` naming ``what`` if it may not be one."""
    fn = resolve(path)
    if not json_function(fn):
        raise TypeError(f"{what} {path} is not a module-level Python function outside the standard library")
    return fn


def make_spec(dataset, collate_fn, pickle_allowed: bool, feature_fn=None) -> tuple[str, bytes, str]:
    """``(spec_id, payload, format)`` for ``Configure``. JSON when the dataset's ``helix_spec()``
    and the collate function carry everything; else cloudpickle when the cluster allows it; else
    ``ValueError`` naming what cannot travel and the fix — never a spec that silently loses state.
    ``feature_fn`` (Tier 2) travels with the dataset: it runs where each sample is decoded."""
    from torch.utils.data import default_collate

    from helix_core.data.contract import Specced
    from helix_core.errors import PICKLING, SpecError

    collate_path = _DEFAULT_COLLATE if collate_fn in (None, default_collate) else function_path(collate_fn)
    lost = None if collate_path is not None else f"collate_fn {collate_fn!r} ({why_not_json(collate_fn)})"
    feature_path = None
    if feature_fn is not None:
        feature_path = function_path(feature_fn)
        if feature_path is None:
            lost = lost or f"Rebalance.feature_fn {feature_fn!r} ({why_not_json(feature_fn)})"
    ds_spec = None
    try:
        if isinstance(dataset, Specced):
            ds_spec = dataset.helix_spec()
        else:
            lost = lost or f"dataset {type(dataset).__name__} (it has no helix_spec())"
    except SpecError as e:
        lost = lost or f"{e.dataset}'s {e.argument} ({e.fix})"
    if lost is None:
        spec = {"dataset": ds_spec, "collate_fn": collate_path}
        if feature_path is not None:
            spec["feature_fn"] = feature_path
        payload, fmt = json.dumps(spec, sort_keys=True).encode(), "json"
    elif pickle_allowed:
        from helix_core.data.usercode import dumps

        parts = {"dataset": dataset, "collate_fn": collate_fn or default_collate, "feature_fn": feature_fn}
        payload, fmt = dumps({k: None if v is None else dumps(v) for k, v in parts.items()}), "cloudpickle"
    else:
        raise ValueError(
            f"{lost} cannot travel to the DataServers without cloudpickle, and this cluster takes none "
            f"(reached beyond loopback without TLS, or ClusterConfig(allow_pickle=False)): use {PICKLING}"
        )
    return hashlib.sha256(fmt.encode() + payload).hexdigest()[:16], payload, fmt


def load_spec(payload: bytes, fmt: str, allow_pickle: bool):
    """The worker side of ``make_spec``: ``(dataset, collate_fn, feature_fn or None)``; a part that
    cannot be rebuilt here raises ``ValueError`` naming it (``transform``, ``collate_fn``, ...)."""
    import torch

    if fmt == "cloudpickle":
        if not allow_pickle:
            raise PermissionError("refusing a pickled dataset spec: this DataServer takes no pickle")
        import cloudpickle

        parts = cloudpickle.loads(payload)  # the parts apart, so that a failure names its argument
        spec = {k: None if v is None else _rebuilt(k, lambda v=v: cloudpickle.loads(v)) for k, v in parts.items()}
        return spec["dataset"], spec["collate_fn"], spec.get("feature_fn")
    if fmt != "json":
        raise ValueError(f"dataset spec format {fmt!r}; valid: json, cloudpickle")
    spec = json.loads(payload)
    target, kwargs = spec["dataset"]["target"], dict(spec["dataset"].get("kwargs", {}))
    cls = _rebuilt(f"dataset class ({target})", lambda: resolve(target))
    if not (isinstance(cls, type) and issubclass(cls, torch.utils.data.Dataset)):
        raise TypeError(f"{target} is not a torch Dataset class")
    collate_path = spec.get("collate_fn") or _DEFAULT_COLLATE
    collate = _rebuilt(f"collate_fn ({collate_path})", lambda: resolve_function(collate_path, "collate_fn"))
    feature_fn = (
        _rebuilt(
            f"Rebalance.feature_fn ({spec['feature_fn']})", lambda: resolve_function(spec["feature_fn"], "feature_fn")
        )
        if spec.get("feature_fn")
        else None
    )
    if isinstance(kwargs.get("transform"), str):  # a dataset's transform travels by import path too
        path = kwargs["transform"]
        _rebuilt(f"transform ({path})", lambda: resolve_function(path, "transform"))
    return _rebuilt(f"dataset {target}", lambda: cls(**kwargs)), collate, feature_fn


def _rebuilt(what: str, build):
    """``build()``, or ``ValueError`` naming ``what`` could not be rebuilt on this DataServer."""
    try:
        return build()
    except TypeError as e:  # a name a JSON spec may not carry (not a function, the standard library's)
        raise TypeError(f"the DataServer cannot rebuild the {what}: {e}") from None
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"the DataServer cannot rebuild the {what}: {type(e).__name__}: {e} (install that module "
            "where the DataServers run, or use a cluster that takes cloudpickle: its code then travels "
            "by value)"
        ) from None
    except Exception as e:
        raise ValueError(f"the DataServer cannot rebuild the {what}: {type(e).__name__}: {e}") from None


def sample_path(dataset, index: int) -> str:
    from helix_core.data.contract import SamplePaths

    try:
        return str(dataset.sample_path(index)) if isinstance(dataset, SamplePaths) else ""
    except Exception:
        return ""
