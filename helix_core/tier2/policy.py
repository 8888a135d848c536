"""A closed Tier-2 round's policy at its leader DataServer: the policy spec a group's ranks send
(``load_policy``, kept loaded by ``Policies``), and the assignment a closed round's features get
from it (``decide``) — the default (equal-count LPT behind the cost gate) or the group's
``sort_fn`` — checked before any row moves.

Pure: plain data in, a ``Decision`` out (no gRPC, protobuf, shared memory or clock), so the
decision is tested alone; the leader (``tier2/leader.py``) holds the calls and carries it out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from helix_core.data.specs import resolve_function
from helix_core.tier2.rebalance import GateArgs, check_assignment, gate, lpt_within_steps
from helix_core.tier2.rounds import Round

__all__ = ["KEPT_POLICIES", "Decision", "Policies", "decide", "load_policy"]

KEPT_POLICIES = 64  # policies a leader keeps loaded (the least recently used goes)


class Decision(NamedTuple):
    """A closed round's policy answer: ``outcome`` (kept, moved, alone, error: ...), the new rank
    of each row (None: keep), and what the default gate saw (0 where it did not run): the
    projected ``gain_s`` and ``transfer_s`` (seconds) and the wait for input per step it
    discounted, ``input_wait_s`` (seconds)."""

    outcome: str
    assignment: list | None = None
    gain_s: float = 0.0
    transfer_s: float = 0.0
    input_wait_s: float = 0.0


def load_policy(payload: bytes, fmt: str, allow_pickle: bool):
    """``(sort_fn or None for the default, args)`` of a policy spec (``tier2.rank.policy_spec``)."""
    if fmt == "cloudpickle":
        if not allow_pickle:
            raise PermissionError("refusing a pickled Tier-2 policy: this DataServer takes no pickle")
        import cloudpickle

        spec = cloudpickle.loads(payload)
        return spec["sort_fn"], spec["args"]
    if fmt != "json":
        raise ValueError(f"Tier-2 policy format {fmt!r}; valid: json, cloudpickle")
    spec = json.loads(payload)
    fn = resolve_function(spec["sort_fn"], "Rebalance.sort_fn") if spec.get("sort_fn") else None
    return fn, spec.get("args")


class Policies:
    """The policies a leader has loaded, each once per content: kept by the hash of its format and
    bytes (never by the id a client chose, which another client could reuse for other code); past
    ``capacity`` the least recently used goes. Thread-safe."""

    def __init__(self, allow_pickle: bool, capacity: int = KEPT_POLICIES):
        self.allow_pickle, self.capacity = allow_pickle, capacity
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, tuple] = OrderedDict()

    def get(self, payload: bytes, fmt: str = "") -> tuple:
        """``(sort_fn or None, args)`` of the spec ``payload`` in ``fmt`` ("": json), loaded if new."""
        fmt = fmt or "json"
        key = hashlib.sha256(fmt.encode() + b"\0" + payload).hexdigest()
        with self._lock:
            got = self._loaded.get(key)
            if got is not None:
                self._loaded.move_to_end(key)
        if got is None:
            got = load_policy(payload, fmt, self.allow_pickle)  # outside the lock: it may import a module
            with self._lock:
                self._loaded[key] = got
                while len(self._loaded) > self.capacity:
                    self._loaded.popitem(last=False)
        return got


def _round_wait_s(requests: Sequence) -> float:
    """The wait for input per step that every rank of the round has (the least of their recent
    means): the default gate counts a step's GPU saving only beyond it."""
    return min((max(0.0, r.input_wait_s) for r in requests), default=0.0)


def decide(rnd: Round, requests: Sequence, policies: Policies) -> Decision:
    """Which rank takes each row of the closed round ``rnd``: ``requests`` are its ranks' requests
    (one per rank, in the round's order; each with ``rank``, ``host``, ``seconds_per_unit``,
    ``input_wait_s``, and the group's ``policy``, ``policy_format`` and ``policy_id``)."""
    if not rnd.movable:
        return Decision("alone")
    req = requests[0]
    try:
        sort_fn, args = policies.get(req.policy, req.policy_format)
    except Exception as e:
        return Decision(f"error: Tier-2 policy {req.policy_id}: {type(e).__name__}: {e}")
    features = rnd.features()
    hosts = {r.rank: r.host for r in requests}
    gate_args: GateArgs | None = None
    if sort_fn is None:  # the default policy: cost gate with this round's hosts and learned window
        gate_args = GateArgs.of(args)
        spu = max(r.seconds_per_unit for r in requests)
        given = args if isinstance(args, dict) else {}
        learned = {"seconds_per_unit": spu} if spu > 0 and "seconds_per_unit" not in given else {}
        if "input_wait_s" not in given:  # a step waits for the input of its slowest-to-arrive rank
            learned["input_wait_s"] = _round_wait_s(requests)
        gate_args = dataclasses.replace(gate_args, same_host=hosts, **learned)
        for f in features:
            f.setdefault(gate_args.key, f.get("tokens", 0))
    gain = cost = 0.0
    assignment: Any
    try:
        if gate_args is not None:  # the default: equal-count LPT behind the cost gate, whose figures are reported
            proposal = lpt_within_steps(features, gate_args.key)
            move, gain, cost = gate(features, proposal, gate_args)
            assignment = proposal if move else [f["rank"] for f in features]
        else:
            assignment = sort_fn(features, args)
            assignment = list(assignment) if not isinstance(assignment, (str, bytes)) else assignment
    except Exception as e:
        return Decision(f"error: Rebalance.sort_fn raised {type(e).__name__}: {e}")
    why = check_assignment(features, assignment)
    if why is not None:
        return Decision(f"error: Rebalance.sort_fn {why}")
    waited = gate_args.input_wait_s if gate_args is not None else 0.0
    if all(f["rank"] == r for f, r in zip(features, assignment)):
        return Decision("kept", None, gain, cost, waited)
    return Decision("moved", assignment, gain, cost, waited)
