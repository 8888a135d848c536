"""Type checks of ``DistributedDataLoader``'s options at construction, each error naming the
option: ``shuffle="false"`` would shuffle and ``batch_size=2.0`` would fail only inside the sender
thread, so neither gets that far."""

from __future__ import annotations

import math
import numbers

__all__ = ["check_loader_options"]


def _int(name: str, v, least: int | None = None, optional: bool = False) -> None:
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {type(v).__name__} {v!r}")
    if least is not None and v < least:
        raise ValueError(f"{name} must be >= {least}, got {v!r}")


def _flag(name: str, v) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, got {type(v).__name__} {v!r}")


def _text(name: str, v) -> None:
    if v is not None and not isinstance(v, str):
        raise TypeError(f"{name} must be a str or None, got {type(v).__name__} {v!r}")


def check_loader_options(
    *,
    batch_size,
    rank,
    world_size,
    coordinator,
    token,
    shuffle,
    seed,
    drop_last,
    collate_fn,
    prefetch_depth,
    microbatch_size,
    pin_memory,
    num_workers,
    config,
    ddl_tolerance_s,
) -> None:
    """Raise ``TypeError`` (wrong type) or ``ValueError`` (out of range) naming the option."""
    from helix_core.config import ClusterConfig

    _int("batch_size", batch_size, 1)
    _int("prefetch_depth", prefetch_depth, 1)
    _int("microbatch_size", microbatch_size, 1, optional=True)
    _int("num_workers", num_workers, 1, optional=True)
    _int("rank", rank, 0, optional=True)
    _int("world_size", world_size, 1, optional=True)
    _int("seed", seed)
    for name, v in (("shuffle", shuffle), ("drop_last", drop_last), ("pin_memory", pin_memory)):
        _flag(name, v)
    _text("coordinator", coordinator)
    _text("token", token)
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn must be callable or None, got {type(collate_fn).__name__}")
    if config is not None and not isinstance(config, ClusterConfig):
        raise TypeError(f"config must be a hx.ClusterConfig or None, got {type(config).__name__}")
    if (
        isinstance(ddl_tolerance_s, bool)
        or not isinstance(ddl_tolerance_s, numbers.Real)
        or not (math.isfinite(ddl_tolerance_s) and ddl_tolerance_s >= 0)
    ):
        raise ValueError(f"ddl_tolerance_s must be a finite number of seconds >= 0, got {ddl_tolerance_s!r}")
