"""A rank's side of Tier-2 rounds (``rebalance=``): once a batch has landed, its slabs and its
samples' measured features go to the group's leader DataServer (``tier2/leader.py``), and the
batch this rank trains on is made from the rows the round gives it — its batch size, its global
step, maybe other ranks' samples of that step. No gRPC here (``ClusterClient`` makes the calls).

A rank never waits on another beyond the round's timeout: a round closes when every step in it
has all the group's ranks, when it is full, or at ``round_timeout_s``; a leader that cannot be
reached, or a round that fails, leaves the rank its own batch. A call that is not answered (the
loader stopped, the call failed) is settled by the leader (``LeaveRound``): the batch left its
round, or here is the round's answer — to take, or to give back if the loader stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import numpy as np

from helix_core.data.specs import function_path, why_not_json
from helix_core.data.usercode import dumps
from helix_core.errors import ClusterError
from helix_core.memory.merge import merge_batches
from helix_core.tier2.crosshost import read_rows
from helix_core.tier2.errors import RoundLost, RoundStopped, RoundUnknown
from helix_core.tier2.leader import EXCHANGE_TIMEOUT_S
from helix_core.tier2.rebalance import Rebalance
from helix_core.wire.messages import slab_handle
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["STEP_STRIDE", "RoundLost", "Tier2", "consecutive_runs", "policy_spec", "rebalance_group", "run_name"]

log = logging.getLogger("helix.tier2")

STEP_STRIDE = 1 << 32  # a global step is epoch * STEP_STRIDE + the batch's position in the epoch
WAIT_STEPS = 6  # a rank's wait for input is the mean of its last this many batches (short, so the
# start-up's waits, before the prefetch window first fills, leave it within a few steps)


def run_name(resume: str = "", env=os.environ) -> str:
    """What every rank of one run shares, and no other run: ``resume`` (the resume point, "" for a
    fresh run) and, under torchrun, the job's run id and restart count — so two attempts of an
    elastic job that resumed from the same checkpoint never meet in a round."""
    job, attempt = env.get("TORCHELASTIC_RUN_ID"), env.get("TORCHELASTIC_RESTART_COUNT")
    return resume if job is None or attempt is None else f"{resume}@{job}/{attempt}"


def rebalance_group(rebalance: Rebalance | None, rank: int, world_size: int) -> tuple[int, ...] | None:
    """The ranks ``rank`` trades samples with (itself included), or None (no Tier 2 for it)."""
    if rebalance is None:
        return None
    group = next((g for g in rebalance.groups(world_size) if rank in g), None)
    return tuple(group) if group is not None and len(group) > 1 else None


def policy_spec(rebalance: Rebalance, pickle_allowed: bool) -> tuple[str, bytes, str]:
    """``(policy_id, payload, format)`` of ``sort_fn`` and its ``args``: JSON when ``sort_fn`` is the
    default or a function the servers can import and ``args`` is JSON, else cloudpickle (the
    script's own modules by value) where the cluster takes it, else ``ValueError`` naming what
    cannot travel and the fix."""
    from dataclasses import asdict, is_dataclass

    args = asdict(rebalance.args) if is_dataclass(rebalance.args) else rebalance.args
    path = None if rebalance.sort_fn is None else function_path(rebalance.sort_fn)
    try:
        if rebalance.sort_fn is not None and path is None:
            raise TypeError(f"sort_fn {rebalance.sort_fn!r}: {why_not_json(rebalance.sort_fn)}")
        payload, fmt = json.dumps({"sort_fn": path, "args": args}, sort_keys=True).encode(), "json"
    except TypeError as e:
        if not pickle_allowed:
            raise ValueError(
                f"Rebalance: {e} (or its args are not JSON), and this cluster takes no cloudpickle: "
                "use a module-level sort_fn of an installed module and JSON args, or a cluster that "
                "takes cloudpickle (a token, and TLS beyond loopback)"
            ) from None
        payload, fmt = dumps({"sort_fn": rebalance.sort_fn, "args": rebalance.args}), "cloudpickle"
    return hashlib.sha256(fmt.encode() + payload).hexdigest()[:16], payload, fmt


class Tier2:
    """The rounds of one loader: ``group`` (its ranks), ``units`` (GPU cost units of token counts),
    ``deadlines`` (the learned seconds per unit), ``stats`` (``LoaderStats``: its ``rebalance``)."""

    def __init__(
        self,
        client,
        rebalance: Rebalance,
        group: tuple[int, ...],
        spec_id: str,
        units,
        deadlines,
        stats,
        pad: bool,
        step_units: float = 0.0,
    ):
        self.client, self.rebalance, self.group, self.units = client, rebalance, group, units
        self.step_units = step_units  # a batch's fixed GPU cost units, beside its samples'
        self.deadlines, self.stats, self.pad = deadlines, stats, pad
        self.name = f"{spec_id}:{','.join(map(str, group))}"
        # on a TLS cluster rows cross hosts by gRPC over TLS only (ValueError for an asked collective)
        self.transport = rebalance.transport(tls=getattr(client, "tls", None) is not None)
        self.policy = policy_spec(rebalance, client.pickle_allowed)
        self._leader: str | None = None
        self.run = run_name()  # what every rank of a run shares (``resume``): rounds never mix runs

    def resume(self, epoch: int, position: int) -> None:
        """The run continues from ``epoch`` / ``position`` (every rank loads the same point)."""
        self.run = run_name(f"{epoch}:{position}")

    def _input_wait_s(self) -> float:
        """This rank's mean wait for input per batch over its last ``WAIT_STEPS`` (0 before any): a
        mean, not a median, since a rank that waits now and then (a slow batch in four) loses that
        time as surely as one that waits a little every step."""
        waits = list(self.stats.input_wait)[-WAIT_STEPS:]
        return float(sum(waits) / len(waits)) if waits else 0.0

    def join_round(self, task, replies, stop):
        """The batch of ``task`` after its round, from its parts' ``replies`` (all succeeded); None:
        read the replies as they are (the round kept this rank's samples, or none could run)."""
        batches, rows, features, indices = [], [], [], []
        for reply in replies:
            indices += list(reply.decoded)
            got = json.loads(reply.features_json or "[]")
            if reply.pieces:
                batches += list(reply.pieces)
                rows += list(reply.piece_rows)
            else:
                batches.append(reply.batch)
                rows.append(len(got))
            features += got
        if len(features) != sum(rows):
            return None  # a server that computes no features (an older one): keep
        for f in features:
            if "cost" not in f:
                f["cost"] = float(np.sum(self.units(np.array([f.get("tokens", 0)], dtype=np.float64))))
        counts = self.stats.rebalance
        if self._leader is None:
            try:
                self._leader = self.client.round_leader(min(self.group), stop)
            except ClusterError as e:  # the group's lowest rank is not (or no longer) registered
                if stop.is_set():
                    raise
                log.warning(
                    "Tier-2 group %s: no round leader (%s): rank %d keeps its batch", self.name, e, self.client.rank
                )
                counts["unreachable"] += 1
                return None
        r = self.rebalance
        request = pb.RebalanceRequest(
            group=self.name,
            run=self.run,
            group_size=len(self.group),
            rank=self.client.rank,
            step=task.epoch * STEP_STRIDE + task.position,
            batches=batches,
            batch_rows=rows,
            features_json=json.dumps(features),
            host=self.client.host,
            buffer_size=r.buffer_size,
            timeout_s=r.wait_s(self.deadlines.deadline(task.seq)),
            policy_id=self.policy[0],
            policy=self.policy[1],
            policy_format=self.policy[2],
            client_id=self.client.client_id,
            seconds_per_unit=self.deadlines.seconds_per_unit or 0.0,
            input_wait_s=self._input_wait_s(),
            indices=indices if len(indices) == sum(rows) else (),
            exchange=self.transport,
            delivery=self.client.servers.delivery[1] if self.client.servers.delivery else "",
        )
        # the round's wait, then its Exchange across hosts (the collective, then maybe gRPC), then the reply
        self.stats.rebalance["asked"] += 1  # batches sent to a round
        t0 = time.perf_counter()
        try:
            reply = self.client.rebalance(
                self._leader,
                request,
                request.timeout_s + 2 * EXCHANGE_TIMEOUT_S + self.client.config.rpc_timeout_s,
                stop,
                leave_s=2 * EXCHANGE_TIMEOUT_S,
                wanted=task.wanted,
                grace_s=r.round_timeout_s,
            )
        except RoundUnknown as e:  # other ranks may read its slabs: not this rank's to read or release
            task.taken.update(range(len(task.parts)))
            counts["unknown" if e.indices is None else "lost"] += 1
            for h in e.release:  # the slabs the committed round gave it (and its own no other rank reads)
                try:
                    self.client.reader.release(h)
                except (OSError, ValueError) as err:  # gone with its server: nothing to give back
                    log.debug("Tier-2 release of %s: %s", h.segment, err)
            if stop.is_set():
                raise RoundStopped(None) from None
            if e.indices is None:  # its batch before the round may be another rank's now: never guess
                raise ClusterError(f"batch {task.position}: {e}") from None
            raise RoundLost([int(i) for i in e.indices], f"batch {task.position}: {e}") from None
        except RoundStopped as e:  # the round answered as the loader stopped: give back what it gave
            if e.reply is not None and (e.reply.moved_in or e.reply.moved_out):
                for h in [*(t.batch.slab for t in e.reply.takes), *e.reply.release]:
                    self.client.reader.release(slab_handle(h))
                task.taken.update(range(len(task.parts)))  # its own slabs went with the round
            raise
        if reply is None:
            self._leader = None  # ask again next time: the leader may have moved
            counts["unreachable"] += 1
            return None
        counts[reply.outcome.split(":")[0]] += 1
        self.stats.rebalance_rounds.append(
            {  # this rank's view of the round (the bench joins the ranks')
                "group": self.name,
                "run": self.run,
                "rank": self.client.rank,
                "group_size": len(self.group),
                "epoch": task.epoch,
                "position": task.position,
                "outcome": reply.outcome,
                "closed_by": reply.closed_by,
                "round_samples": reply.round_samples,
                "gain_s": reply.gain_s,
                "transfer_s": reply.transfer_s,
                "input_wait_s": reply.input_wait_s,
                "moved_in": reply.moved_in,
                "moved_out": reply.moved_out,
                "moved_bytes": reply.moved_bytes,
                "crossed_bytes": reply.crossed_bytes,
                "wait_s": time.perf_counter() - t0,
                "before": [int(i) for i in request.indices],
                "after": [int(i) for t in reply.takes for i in t.indices],
            }
        )
        counts["gain_s" if reply.outcome == "moved" else "gain_kept_s"] += reply.gain_s  # projected by the gate
        counts["transfer_s"] += reply.transfer_s if reply.outcome == "moved" else 0.0
        if reply.outcome.startswith("error"):
            self.stats.rebalance_errors.append(reply.outcome)
        taken = [c for t in reply.takes for c in t.costs]
        got = taken if len(taken) == sum(len(t.rows) for t in reply.takes) else [f["cost"] for f in features]
        self.deadlines.measured(task.seq, sum(got) + self.step_units)  # its window is learned against this
        if not reply.moved_in and not reply.moved_out:
            return None  # kept: the usual materialization
        counts["moved_in"] += reply.moved_in
        counts["moved_out"] += reply.moved_out
        counts["moved_bytes"] += reply.moved_bytes
        if reply.transport:
            counts[f"crossed_{reply.transport}"] += 1  # takes whose rows crossed hosts, by how
            counts["crossed_bytes"] += reply.crossed_bytes
        for h in reply.release:  # this rank's slabs whose rows all went to other hosts
            self.client.reader.release(slab_handle(h))
        try:
            return self._read(reply.takes)
        except (OSError, ValueError) as e:  # a slab of the round vanished with its server
            wanted = [int(i) for t in reply.takes for i in t.indices]
            if len(wanted) != sum(len(t.rows) for t in reply.takes) or min(wanted, default=0) < 0:
                raise ClusterError(f"batch {task.position}: its Tier-2 round's slabs could not be read: {e}") from None
            counts["lost"] += 1
            raise RoundLost(wanted, f"batch {task.position}: a slab of its Tier-2 round vanished ({e})") from None

    def _read(self, takes):
        """Tier 2: the batch a round gave this rank, from its ``takes`` (``RowTake``): each run of
        rows that follow each other in a slab is read in place and the runs are merged
        (``merge_batches``), so each row is copied once. Every slab's hold is released after (a
        shared slab counts down). ``OSError`` / ``ValueError`` if a slab vanished, or was handed
        out again before its rows were copied."""
        parts, rows = [], []
        try:
            for t in takes:
                for run in consecutive_runs(list(t.rows)):
                    parts.append(
                        read_rows(
                            self.client.reader,
                            t.batch,
                            run,
                            t.batch_rows,
                            self.client.pickle_allowed,
                            view=len(takes) > 1 or len(run) < len(t.rows),
                        )
                    )
                    rows.append(len(run))
            try:
                merged = merge_batches(parts, rows=rows, pad=self.pad)  # the one copy (a single part is one already)
            except ValueError as e:  # rows that do not collate together: not a lost slab
                raise ClusterError(f"the rows of a Tier-2 round do not merge: {e}") from None
            for t in takes:
                if t.batch.slab.segment and not self.client.reader.held(slab_handle(t.batch.slab)):
                    raise ValueError(f"slab {t.batch.slab.segment} was handed out again while its rows were read")
            return merged
        finally:
            parts.clear()  # no view of a slab outlives its hold
            for t in takes:
                if t.batch.slab.segment:
                    self.client.reader.release(slab_handle(t.batch.slab))


def consecutive_runs(rows: list[int]) -> list[list[int]]:
    """``rows`` cut where one does not follow the one before (``[4, 5, 1, 2]`` -> ``[[4, 5], [1, 2]]``)."""
    out: list[list[int]] = []
    for r in rows:
        if out and r == out[-1][-1] + 1:
            out[-1].append(r)
        else:
            out.append([r])
    return out
