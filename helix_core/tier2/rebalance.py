"""Tier-2 balance correction (paper Section 3.4 "Balance correction", Algorithm 1 lines 10–14,
Listing 1): pure, no gRPC, processes or clocks.

Tier 1 composes steps from estimates before anything is decoded. Once a round of samples is
materialized, their real features (the tokens of the decoded shape, the bytes) are known. The
user's ``sort_fn`` sees one feature dict per buffered sample — the user's ``feature_fn`` output
plus ``"rank"`` (the rank it is going to) and ``"step"`` (its global step) — and returns, in the
same order, the rank each sample should go to. A sample moves only between the ranks of its own
global step, and every rank keeps its batch size: so each step's samples, and each window's
multiset, stay what Tier 1 planned.

:func:`check_assignment` names what is wrong with an assignment (the round then keeps the current
one), :func:`plan_moves` turns a valid one into keeps and sends, and :func:`balance_cost` is
the default policy: equal-count LPT of the measured GPU cost within each step, kept only if the
projected time saved on each step's slowest rank exceeds the predicted transfer time by a margin
(the cost gate — the peers that rebalance after loading gate on a fixed imbalance threshold).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GateArgs",
    "MovePlan",
    "Rebalance",
    "balance_cost",
    "check_assignment",
    "default_features",
    "gate",
    "lpt_within_steps",
    "plan_moves",
    "projected_gain_s",
    "step_loads",
    "transfer_s",
]

Features = Sequence[dict]
EXCHANGES = (None, "grpc", "collective")  # Rebalance.exchange: None is "grpc" (``transport``)


@dataclass(frozen=True)
class Rebalance:
    """What Tier 2 does: the paper's ``load_balance_config`` (also accepted as a dict of these keys).

    ``feature_fn(sample) -> dict`` (small, JSON-able) runs where the sample was decoded (default:
    ``{"tokens", "bytes"}`` of the decoded sample); ``sort_fn(features, args) -> list[int]``
    (default :func:`balance_cost`); ``client_ranks``: groups of ranks that trade samples among
    themselves (default: all ranks, one group; a rank in no group keeps its samples);
    ``buffer_size``: samples per round and group; ``args``: passed to ``sort_fn`` as it is (for the
    default, a :class:`GateArgs` or a dict of its fields); ``round_timeout_s``: a round closes when
    full, when complete (every step in it has all the group's ranks), or when its earliest batch
    has waited its limit: ``round_timeout_s``, or — for a batch its rank will not need for a while
    (its deadline) — until ``round_timeout_s`` before it is needed, at most ``max_wait_s``. So no
    rank waits on another's requests beyond that, and a batch waits only while it is not needed.
    ``exchange``: how rows move between hosts — ``"grpc"`` (one stream per slab's rows, on
    Helix's own channels: the token and, on a TLS cluster, TLS) or ``"collective"`` (one gloo
    ``all_to_all`` among the hosts' DataServers, gRPC if it fails: faster, but gloo and its
    rendezvous store carry neither a token nor TLS, so any local user could reach them). ``None``
    (the default) is ``"grpc"``: the collective runs only where the user asks for it, and never on a
    TLS cluster (``ValueError``, :meth:`transport`): no Tier-2 row leaves TLS.
    """

    feature_fn: Callable[[dict], dict] | None = None
    sort_fn: Callable[[list[dict], Any], list[int]] | None = None
    client_ranks: tuple[tuple[int, ...], ...] | None = None
    buffer_size: int = 64
    args: Any = None
    round_timeout_s: float = 0.05
    max_wait_s: float = 30.0
    exchange: str | None = None

    def __post_init__(self):
        for name in ("feature_fn", "sort_fn"):
            v = getattr(self, name)
            if v is not None and not callable(v):
                raise TypeError(f"Rebalance.{name} must be a function, got {type(v).__name__} {v!r}")
        if isinstance(self.buffer_size, bool) or not isinstance(self.buffer_size, int) or self.buffer_size < 2:
            raise ValueError(f"Rebalance.buffer_size must be an int >= 2 (samples per round), got {self.buffer_size!r}")
        for name in ("round_timeout_s", "max_wait_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
                raise ValueError(f"Rebalance.{name} must be a finite positive number of seconds, got {t!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"Rebalance.exchange must be None, 'grpc' or 'collective', got {self.exchange!r}")
        if self.client_ranks is not None:
            object.__setattr__(self, "client_ranks", _groups(self.client_ranks))

    def transport(self, tls: bool) -> str:
        """How this group's rows cross hosts on a cluster with (``tls``) or without TLS: ``exchange``,
        by default ``"grpc"``; the collective only when asked for. ``ValueError`` naming
        ``Rebalance.exchange`` for ``"collective"`` with TLS: gloo would carry decoded rows, and its
        store the group's rendezvous, in clear text beside the TLS channels."""
        if self.exchange is None:
            return "grpc"
        if self.exchange == "collective" and tls:
            raise ValueError(
                "Rebalance.exchange='collective' on a TLS cluster: gloo and its rendezvous store have "
                "no TLS and no token, so rows would cross hosts in clear text; use exchange='grpc' "
                "(or None, the default: gRPC over TLS)"
            )
        return self.exchange

    def wait_s(self, deadline_s: float | None) -> float:
        """How long a batch may wait for its round, its rank needing it in ``deadline_s`` (None: unknown)."""
        if deadline_s is None:
            return self.round_timeout_s
        return min(
            max(self.round_timeout_s, deadline_s - self.round_timeout_s), max(self.max_wait_s, self.round_timeout_s)
        )

    @classmethod
    def of(cls, value) -> Rebalance | None:
        """``value`` as a ``Rebalance``: one already, a dict of its keys (``load_balance_config``), or None."""
        if value is None or isinstance(value, Rebalance):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"rebalance: unknown key(s) {unknown}; valid: {', '.join(cls.__dataclass_fields__)}")
            return cls(**value)
        raise TypeError(f"rebalance must be an hx.Rebalance, a dict of its keys or None, got {type(value).__name__}")

    def groups(self, world_size: int) -> tuple[tuple[int, ...], ...]:
        """The groups for ``world_size`` ranks; ``ValueError`` naming a rank outside it."""
        groups = self.client_ranks if self.client_ranks is not None else (tuple(range(world_size)),)
        for g in groups:
            bad = [r for r in g if r >= world_size]
            if bad:
                raise ValueError(
                    f"Rebalance.client_ranks: rank(s) {bad} of group {list(g)} not below world_size={world_size}"
                )
        return groups


def _groups(value) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise TypeError(f"Rebalance.client_ranks must be a list of lists of ranks, e.g. [[0, 1, 2, 3]], got {value!r}")
    seen: set[int] = set()
    out = []
    for g in value:
        if isinstance(g, (str, bytes)) or not isinstance(g, Sequence) or len(g) < 2:
            raise ValueError(f"Rebalance.client_ranks: each group is a list of two or more ranks, got {g!r}")
        for r in g:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"Rebalance.client_ranks: a rank is an int >= 0, got {r!r} in {list(g)}")
            if r in seen:
                raise ValueError(f"Rebalance.client_ranks: rank {r} is in more than one group (or twice in one)")
            seen.add(r)
        out.append(tuple(g))
    return tuple(out)


# ---- assignments ------------------------------------------------------------------------------------
def check_assignment(features: Features, assignment) -> str | None:
    """None if ``assignment`` is valid for ``features``, else what is wrong: not a list of ints of
    the same length, a rank outside the round's ranks, or a step whose ranks' sample counts change."""
    if isinstance(assignment, (str, bytes)) or not isinstance(assignment, Sequence):
        return f"returned {type(assignment).__name__}, not a list of ranks"
    if len(assignment) != len(features):
        return f"returned {len(assignment)} ranks for {len(features)} samples"
    ranks = {f["rank"] for f in features}
    for i, r in enumerate(assignment):
        if isinstance(r, bool) or not isinstance(r, int):
            return f"sample {i}: rank {r!r} is not an int"
        if r not in ranks:
            return f"sample {i}: rank {r} is not one of the round's ranks {sorted(ranks)}"
    before = Counter((f["step"], f["rank"]) for f in features)
    after = Counter((f["step"], r) for f, r in zip(features, assignment))
    if before != after:
        (step, rank), n = next(((k, v) for k, v in sorted(after.items()) if before.get(k) != v))
        return f"step {step}: rank {rank} would get {n} samples, not its batch's {before.get((step, rank), 0)}"
    return None


@dataclass(frozen=True)
class MovePlan:
    """What a valid assignment means for each sample: ``keeps`` (positions that stay) and
    ``sends`` (``(position, from_rank, to_rank)``), in position order."""

    keeps: tuple[int, ...]
    sends: tuple[tuple[int, int, int], ...]

    def sent_by(self, rank: int) -> list[tuple[int, int]]:
        """``(position, to_rank)`` of what ``rank`` sends."""
        return [(p, dst) for p, src, dst in self.sends if src == rank]

    def received_by(self, rank: int) -> list[tuple[int, int]]:
        """``(position, from_rank)`` of what ``rank`` receives."""
        return [(p, src) for p, src, dst in self.sends if dst == rank]

    @property
    def moved(self) -> int:
        return len(self.sends)


def plan_moves(features: Features, assignment: Sequence[int]) -> MovePlan:
    """Keeps and sends of a valid ``assignment`` (``ValueError`` with :func:`check_assignment`'s reason)."""
    why = check_assignment(features, assignment)
    if why is not None:
        raise ValueError(f"invalid assignment: {why}")
    keeps, sends = [], []
    for p, (f, r) in enumerate(zip(features, assignment)):
        (keeps.append(p) if f["rank"] == r else sends.append((p, f["rank"], r)))
    return MovePlan(tuple(keeps), tuple(sends))


def step_loads(features: Features, assignment: Sequence[int], key: str = "cost") -> dict[int, dict[int, float]]:
    """``{step: {rank: summed features[key]}}`` under ``assignment`` (every rank of the step listed)."""
    loads: dict[int, dict[int, float]] = {}
    for f in features:
        loads.setdefault(f["step"], {}).setdefault(f["rank"], 0.0)
    for f, r in zip(features, assignment):
        loads[f["step"]][r] += float(f[key])
    return loads


def lpt_within_steps(features: Features, key: str = "cost") -> list[int]:
    """Equal-count LPT of ``features[key]`` inside each step: largest sample first to the least
    loaded rank of its step that still has room. Deterministic; a tie goes to the sample's own
    rank (nothing moves that need not), then to the lower rank. A step where LPT's slowest rank
    would not be faster than now keeps its rows where they are (greedy LPT can lose to a lucky
    current split: 28+71+0 | 6+25+68 is 99 | 99, LPT's 71+25+6 | 68+28+0 is 102 | 96)."""
    out = [f["rank"] for f in features]
    by_step: dict[int, list[int]] = {}
    for p, f in enumerate(features):
        by_step.setdefault(f["step"], []).append(p)
    for positions in by_step.values():
        room = Counter(features[p]["rank"] for p in positions)
        load = {r: 0.0 for r in room}
        for p in sorted(positions, key=lambda p: (-float(features[p][key]), p)):
            own = features[p]["rank"]
            open_ = [r for r in room if room[r]]
            best = min(open_, key=lambda r: (load[r], r != own, r))
            out[p] = best
            room[best] -= 1
            load[best] += float(features[p][key])
        now: dict[int, float] = {}
        for p in positions:
            now[features[p]["rank"]] = now.get(features[p]["rank"], 0.0) + float(features[p][key])
        if max(load.values()) >= max(now.values()):
            for p in positions:
                out[p] = features[p]["rank"]
    return out


# ---- the cost gate -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateArgs:
    """The default policy's arguments. ``seconds_per_unit``: seconds of GPU step per cost unit (the
    loader learns it from measured windows); ``bandwidth_bps``: bytes/s of moving rows between
    servers of different hosts; ``latency_s``: a round's fixed cost; ``margin``: the gain must
    exceed the transfer by this fraction; ``key``: the feature that is the sample's GPU cost;
    ``input_wait_s``: seconds per step that every rank of the round waits for its input (the least
    of the ranks' recent means; the runtime fills it in): where input binds the steps, a GPU
    saving only turns into more waiting, so each step's saving counts only beyond that wait; and
    where that wait passes ``input_bound_s`` the copies a move makes cost too: ``copy_bps``,
    bytes/s a rank copies its new batch at (a rank whose batch changes copies all of it once, from
    the slabs its rows are in), CPU time the decoders then lack."""

    seconds_per_unit: float = 1e-6
    bandwidth_bps: float = 1e9
    latency_s: float = 1e-3
    margin: float = 0.1
    key: str = "cost"
    input_wait_s: float = 0.0
    copy_bps: float = 1e9
    input_bound_s: float = 0.01  # input binds where every rank waits longer than this per step
    same_host: dict = field(default_factory=dict)  # {rank: host}: moves within a host copy no bytes

    @classmethod
    def of(cls, value) -> GateArgs:
        if value is None:
            return cls()
        if isinstance(value, GateArgs):
            return value
        if isinstance(value, dict):
            return cls(**{k: v for k, v in value.items() if k in cls.__dataclass_fields__})
        raise TypeError(f"the default Tier-2 policy takes GateArgs or a dict as args, got {type(value).__name__}")


def projected_gain_s(features: Features, assignment: Sequence[int], args: GateArgs) -> float:
    """Seconds saved over the round's steps: in each step, the slowest rank's GPU time now minus
    under ``assignment``, less the step's input wait (``args.input_wait_s``), never below zero."""
    current = [f["rank"] for f in features]
    now, new = step_loads(features, current, args.key), step_loads(features, assignment, args.key)
    return sum(
        max(0.0, (max(now[s].values()) - max(new[s].values())) * args.seconds_per_unit - args.input_wait_s) for s in now
    )


def transfer_s(features: Features, assignment: Sequence[int], args: GateArgs) -> float:
    """Predicted cost of the moves: the busiest rank's bytes in or out at ``bandwidth_bps``
    (moves between ranks of one host hand over slabs: no bytes), plus ``latency_s`` if anything
    moves; where input binds (``input_wait_s`` > ``input_bound_s``), plus the changed ranks' copies
    of their new batches at ``copy_bps``, which take the decoders' CPU."""
    host = args.same_host
    out: defaultdict[int, float] = defaultdict(float)  # bytes out of / into each rank
    inn: defaultdict[int, float] = defaultdict(float)
    changed: set = set()  # (step, rank) whose batch changes
    for f, r in zip(features, assignment):
        if r == f["rank"]:
            continue
        changed.update({(f.get("step", 0), r), (f.get("step", 0), f["rank"])})
        if host and host.get(r) is not None and host.get(r) == host.get(f["rank"]):
            continue
        out[f["rank"]] += float(f.get("bytes", 0))
        inn[r] += float(f.get("bytes", 0))
    if not changed:
        return 0.0
    busiest = max([*out.values(), *inn.values(), 0.0])
    copied = sum(float(f.get("bytes", 0)) for f, r in zip(features, assignment) if (f.get("step", 0), r) in changed)
    return (
        busiest / args.bandwidth_bps
        + args.latency_s
        + (copied / args.copy_bps if args.input_wait_s > args.input_bound_s else 0.0)
    )


def gate(features: Features, proposal: Sequence[int], args: GateArgs) -> tuple[bool, float, float]:
    """``(move, gain_s, transfer_s)``: move only if the gain exceeds the transfer by the margin."""
    gain, cost = projected_gain_s(features, proposal, args), transfer_s(features, proposal, args)
    return gain > 0 and gain > cost * (1.0 + args.margin), gain, cost


def balance_cost(features: list[dict], args=None) -> list[int]:
    """The default ``sort_fn``: :func:`lpt_within_steps` of the GPU cost, behind the cost gate."""
    a = GateArgs.of(args)
    proposal = lpt_within_steps(features, a.key)
    move, _, _ = gate(features, proposal, a)
    return proposal if move else [f["rank"] for f in features]


def default_features(sample) -> dict:
    """The default ``feature_fn``: the decoded sample's ``"tokens"`` (its own field, else 0) and
    ``"bytes"`` (its tensors' sizes). The runtime adds ``"cost"``, the model family's GPU cost of
    the tokens, when the features carry none."""
    import torch

    def nbytes(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(nbytes(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(nbytes(v) for v in x)
        return 0

    tokens = sample.get("tokens", 0) if isinstance(sample, dict) else 0
    return {
        "tokens": int(tokens) if not isinstance(tokens, torch.Tensor) else int(tokens.sum()),
        "bytes": nbytes(sample),
    }
