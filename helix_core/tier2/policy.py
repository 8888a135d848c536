"""A Tier-2 round's policy at its leader DataServer: the policy spec (``load_policy``), and the
assignment a closed round's features get from it — the default (equal-count LPT behind the cost
gate) or the group's ``sort_fn`` — checked before any row moves.

A base class of ``RoundTable`` (``tier2/leader.py``), which holds the policies it loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import NamedTuple

from helix_core.data.specs import resolve_function
from helix_core.tier2.rebalance import GateArgs, check_assignment, gate, lpt_within_steps
from helix_core.tier2.rounds import Round
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["Decision", "RoundPolicy", "load_policy"]

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


def _round_wait_s(calls) -> float:
    """The wait for input per step that every rank of the round has (the least of their recent
    means): the default gate counts a step's GPU saving only beyond it."""
    return min((max(0.0, c.request.input_wait_s) for c in calls), default=0.0)


def load_policy(payload: bytes, fmt: str, allow_pickle: bool):
    """``(sort_fn or None for the default, args)`` of a policy spec (``client.tier2.policy_spec``)."""
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


class RoundPolicy:
    """Which rank takes each row of a closed round (``RoundTable``'s ``_policies``: an ``OrderedDict``
    under its ``_cond``)."""

    def _decide(self, rnd: Round, calls: list) -> Decision:
        if not rnd.movable:
            return Decision("alone")
        req = calls[0].request
        try:
            sort_fn, args = self._policy(req)
        except Exception as e:
            return Decision(f"error: Tier-2 policy {req.policy_id}: {type(e).__name__}: {e}")
        features = rnd.features()
        hosts = {c.request.rank: c.request.host for c in calls}
        gate_args = None
        if sort_fn is None:  # the default policy: cost gate with this round's hosts and learned window
            gate_args = GateArgs.of(args)
            spu = max(c.request.seconds_per_unit for c in calls)
            given = args if isinstance(args, dict) else {}
            learned = {"seconds_per_unit": spu} if spu > 0 and "seconds_per_unit" not in given else {}
            if "input_wait_s" not in given:  # a step waits for the input of its slowest-to-arrive rank
                learned["input_wait_s"] = _round_wait_s(calls)
            gate_args = dataclasses.replace(gate_args, same_host=hosts, **learned)
            for f in features:
                f.setdefault(gate_args.key, f.get("tokens", 0))
        gain = cost = 0.0
        try:
            if sort_fn is None:  # the default: equal-count LPT behind the cost gate, whose figures are reported
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

    def _policy(self, req: pb.RebalanceRequest):
        """The request's policy, loaded once per content: cached by the hash of its format and bytes
        (never by the id a client chose, which another client could reuse for other code)."""
        fmt = req.policy_format or "json"
        key = hashlib.sha256(fmt.encode() + b"\0" + req.policy).hexdigest()
        with self._cond:
            got = self._policies.get(key)
            if got is not None:
                self._policies.move_to_end(key)
        if got is None:
            got = load_policy(req.policy, fmt, self.allow_pickle)
            with self._cond:
                self._policies[key] = got
                while len(self._policies) > KEPT_POLICIES:
                    self._policies.popitem(last=False)
        return got
