"""``LoaderOptions``: a ``DistributedDataLoader``'s plain options, checked once at construction.

Each error names the option, as the user spelled it: ``shuffle="false"`` would shuffle and
``batch_size=2.0`` would fail only inside the sender thread, so neither gets that far. The objects
a loader is given (the dataset, ``collate_fn``, ``gpu_cost``, ``config``, ``tls``, ``rebalance``,
``device``) are not options and stay the loader's own arguments.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from helix_core.planning.placement import SCHEDULERS

__all__ = ["BALANCES", "ON_ERROR", "LoaderOptions"]

BALANCES = (None, "tokens")
ON_ERROR = ("raise", "skip")


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


@dataclass(frozen=True)
class LoaderOptions:
    """What ``DistributedDataLoader(dataset, batch_size, **options)`` was asked for, as given
    (its docstring says what each does). ``rank`` / ``world_size``: None takes the process group's
    (else ``RANK`` / ``WORLD_SIZE``); ``coordinator`` / ``token``: None takes ``HELIX_COORDINATOR``
    / ``HELIX_TOKEN``, else an embedded cluster; ``num_workers``: worker processes of an embedded
    cluster (None: its default); ``ddl_tolerance_s``: seconds a batch may land after its deadline
    and still count as on time. ``TypeError`` (wrong type) or ``ValueError`` (out of range, or not
    one of the valid choices, which it lists) names the option."""

    batch_size: int = 1
    rank: int | None = None
    world_size: int | None = None
    coordinator: str | None = None
    token: str | None = field(default=None, repr=False)  # a credential: never in a log line
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    prefetch_depth: int = 4
    scheduler: str = "deadline"
    balance: str | None = None
    window: int = 8
    microbatch_size: int | None = None
    on_error: str = "raise"
    pin_memory: bool = False
    num_workers: int | None = None
    ddl_tolerance_s: float = 0.010

    def __post_init__(self) -> None:
        _int("batch_size", self.batch_size, 1)
        _int("prefetch_depth", self.prefetch_depth, 1)
        _int("microbatch_size", self.microbatch_size, 1, optional=True)
        _int("num_workers", self.num_workers, 1, optional=True)
        _int("rank", self.rank, 0, optional=True)
        _int("world_size", self.world_size, 1, optional=True)
        _int("seed", self.seed)
        for name in ("shuffle", "drop_last", "pin_memory"):
            _flag(name, getattr(self, name))
        _text("coordinator", self.coordinator)
        _text("token", self.token)
        t = self.ddl_tolerance_s
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"ddl_tolerance_s must be a finite number of seconds >= 0, got {t!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r}; valid: {', '.join(SCHEDULERS)}")
        if self.balance not in BALANCES:
            raise ValueError(f"balance={self.balance!r}; valid: None, 'tokens'")
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(
                f"window={w!r}: the number of global steps the token planner recomposes "
                "together must be an int >= 1 (1: within each step)"
            )
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r}; valid: {', '.join(ON_ERROR)}")
