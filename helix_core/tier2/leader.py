"""Tier-2 rounds at a group's leader DataServer (paper Section 3.4 "Balance correction",
Algorithm 1 lines 10-14): the runtime around the pure ``planning.rounds`` / ``planning.rebalance``.

Each rank of a ``client_ranks`` group, once a batch of a global step has landed, sends its slab
handles and its samples' features here (``Rebalance``) and is held until that step's round closes
(samples move only within a step, so each step has a round of its own): complete (all the group's
ranks sent it), full, or when its earliest batch's limit (``timeout_s``, from the rank's deadline)
has passed. The
round runs the group's policy (``sort_fn``, which travels like a dataset: an import path, or
cloudpickle where the server takes pickles) over the features, checks the assignment, and answers
each rank with the rows it takes, slab by slab. Between ranks of one host the slabs are handed
over (no bytes move between servers), and a slab read by several ranks carries their count
(``SlabReader.share``), so the last one frees it. Rows bound for another host go through that
host's member (``crosshost``: one packed ``all_to_all``, or gRPC forwarding as the fallback).

Who owns a batch is decided here, under one lock: a rank that will not take its call's reply (its
loader stopped, or the call failed on the way) asks ``LeaveRound``. A batch still in its open
round leaves it (the rank's slabs are its own again); one whose round has closed gets that round's
answer, so the rank gives back exactly what the round gave it and no rank reads a slab its owner
released. A rank that waits in ``next()`` for a batch still held asks ``AskRound``: the round
closes now and runs with what it holds.

Nothing here waits on a clock it could block on instead: a held call waits on the round's
condition until its own round closes, or until the open round's timeout is due.

The round itself runs in ``tier2_policy.py`` (the assignment) and ``tier2_outcome.py`` (the
takes, the cross-host exchange, the replies); this module holds the calls until it does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections import Counter, OrderedDict

from helix_core.memory.reader import SlabReader
from helix_core.tier2.outcome import EXCHANGE_TIMEOUT_S, RoundOutcome
from helix_core.tier2.policy import RoundPolicy
from helix_core.tier2.rounds import Round, RoundBuffer, RoundItem
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["RoundTable", "bad_timeout"]

log = logging.getLogger("helix.tier2")

KEPT_CALLS = 1024  # answered calls a LeaveRound may still ask about (and calls left before they came)
MAX_TIMEOUT_S = 86400.0  # the longest wait a call may ask for (a day): a wait past it is a client's error


def bad_timeout(value: float, name: str) -> str | None:
    """Why ``value`` (seconds, 0: the default) is not a wait a call may ask for, or None: it must be
    finite and in [0, ``MAX_TIMEOUT_S``] (a NaN would hold its call for ever)."""
    if not (math.isfinite(value) and 0.0 <= value <= MAX_TIMEOUT_S):
        return f"{name} must be a finite number of seconds in [0, {MAX_TIMEOUT_S:g}], got {value!r}"
    return None


@dataclasses.dataclass(eq=False)
class _Call:
    """One held ``Rebalance`` call: its request and, once its round ran, its reply."""

    request: pb.RebalanceRequest
    closed: bool = False
    added: bool = False  # its batch is in its open round
    ended: bool = False  # its RPC is over (cancelled, or its client gone): it is left out of its round
    reply: pb.RebalanceReply | None = None
    arrived: float = 0.0  # on the table's clock

    def source(self, k: int) -> tuple[int, int]:
        """(batch number, row in it) of the call's ``k``-th sample."""
        for b, n in enumerate(self.request.batch_rows):
            if k < n:
                return b, k
            k -= n
        raise IndexError(k)

    def index(self, b: int, row: int) -> int:
        """The sample index of ``row`` of batch ``b`` (-1 if the rank did not say)."""
        k = sum(self.request.batch_rows[:b]) + row
        return int(self.request.indices[k]) if k < len(self.request.indices) else -1


class RoundTable(RoundOutcome, RoundPolicy):
    """The rounds this DataServer leads, one open round per group and step. Thread-safe: each held
    call runs on its own gRPC thread; the one whose batch closes a round (or finds it due) runs it."""

    def __init__(
        self,
        allow_pickle: bool,
        clock=time.monotonic,
        exchange=None,
        address: str = "",
        host: str = "",
        commit=None,
        max_held: int = 32,
    ):
        self.allow_pickle, self.clock = allow_pickle, clock
        # calls held at once (each takes a gRPC handler thread): one past it keeps its batch at once
        # ("busy"), so held rounds never take the threads the server's other RPCs need
        self.max_held, self._held = max_held, 0
        # commit(group, run, step, {rank: indices}, {rank: [(segment, generation)]}, age_s) -> bool: a
        # moved round recorded at the Coordinator before a rank sees it (None: no Coordinator)
        self.commit = commit
        self.exchange, self.address, self.host = exchange, address, host  # HostExchange: rows across hosts
        self.reader = SlabReader()
        self._cond = threading.Condition()
        self._buffers: dict[str, RoundBuffer] = {}
        self._policies: OrderedDict[str, tuple] = OrderedDict()  # by the hash of the policy's bytes
        self._calls: OrderedDict[tuple, _Call] = OrderedDict()  # (group, run, step, rank, client): its call
        self._left: OrderedDict[tuple, None] = OrderedDict()  # calls that left before they came
        self.counts: Counter = Counter()  # rounds by outcome

    def rebalance(self, request: pb.RebalanceRequest, context=None) -> pb.RebalanceReply:
        """``request``'s batch into its step's round; blocks until the round ran. ``context`` (the
        call's gRPC context): a call that ends first (its loader stopped, its process died) leaves
        its open round at once, and a round that closes after it leaves it out."""
        try:
            why = bad_timeout(request.timeout_s, "RebalanceRequest.timeout_s")
            if why:
                raise ValueError(why)
            features = json.loads(request.features_json or "[]")
            if (
                not isinstance(features, list)
                or len(features) != sum(request.batch_rows)
                or len(request.batches) != len(request.batch_rows)
            ):
                raise ValueError(
                    f"{len(features) if isinstance(features, list) else 'no'} feature dicts for "
                    f"{sum(request.batch_rows)} rows in {len(request.batches)} slabs"
                )
            ranks = [int(r) for r in request.group.rsplit(":", 1)[-1].split(",")]
        except (ValueError, TypeError) as e:
            return self._keep(_Call(request), f"error: bad Rebalance request from rank {request.rank}: {e}")
        call = _Call(request, arrived=self.clock())
        items = [
            RoundItem((call, k), request.rank, request.step, f if isinstance(f, dict) else {})
            for k, f in enumerate(features)
        ]
        # samples move only within a step: one round per step, and per run (a rank that resumed
        # never trades with one still on the run before)
        key = (request.group, request.run, request.step)
        if context is not None and not context.add_callback(lambda: self._ended(call, key)):
            return self._keep(call, "cancelled")  # it ended already
        with self._cond:
            name = (*key, request.rank, request.client_id)
            if name in self._left:  # its rank left the round before the call came
                del self._left[name]
                return self._keep(call, "cancelled")
            if call.ended:
                return self._keep(call, "cancelled")
            if self._held >= self.max_held:  # every call it may hold waits already: this one keeps
                return self._keep(call, "busy")
            self._remember(self._calls, name, call)
            buf = self._buffers.get(key)
            if buf is None:
                buf = self._buffers[key] = RoundBuffer(
                    ranks, max(2, request.buffer_size), request.timeout_s or 0.05, self.clock
                )
            for old in {it.key[0] for it in buf.drop(request.rank, request.step)}:  # a resumed run's step again
                self._keep(old, "superseded")
                self._cond.notify_all()
            try:
                closed = buf.add_batch(items, request.timeout_s or None)
            except ValueError as e:
                return self._keep(call, f"error: {e}")
            call.added = True
            self._held += 1
            try:
                return self._hold(call, buf, key, closed)
            finally:
                self._held -= 1

    def _hold(self, call: _Call, buf, key: tuple, closed) -> pb.RebalanceReply:
        """(Under the lock.) Wait for ``call``'s round, running it if this call closes it or finds it due."""
        request = call.request
        while call.reply is None:
            if closed is None and not call.closed and buf.due_in() is not None and buf.due_in() <= 0:
                closed = buf.expire()
            if closed is not None:
                self._mark(closed)
                self._cond.release()
                try:
                    self._run(closed)  # outside the lock: other groups' calls go on meanwhile
                except Exception as e:  # no call of the round may wait for a reply that never comes
                    log.exception("Tier-2 round of %s failed", request.group)
                    for c in {it.key[0] for it in closed.items if it.key[0].reply is None}:
                        self._keep(c, f"error: the round failed: {type(e).__name__}: {e}")
                finally:
                    self._cond.acquire()
                self._cond.notify_all()
                closed = None
                if not len(buf) and self._buffers.get(key) is buf:
                    del self._buffers[key]  # the step's round is over (a late batch opens a new one)
                continue
            self._cond.wait(None if call.closed else buf.due_in())
        return call.reply

    def ask(self, request: pb.AskRoundRequest) -> pb.AskRoundReply:
        """A rank waits in ``next()`` for its batch of ``request.step``: if that batch is in its open
        round, the round closes now ("asked") and runs with what it holds, so no rank waits for a
        batch while its round waits for ranks that have not come."""
        key = (request.group, request.run, request.step)
        with self._cond:
            call = self._calls.get((*key, request.rank, request.client_id))
            buf = self._buffers.get(key)
            if (
                call is None
                or not call.added
                or call.closed
                or call.reply is not None
                or buf is None
                or not buf.ask(request.rank, request.step)
            ):
                return pb.AskRoundReply(asked=False)
            self._cond.notify_all()  # a held call wakes, finds the round due and runs it
        return pb.AskRoundReply(asked=True)

    def leave(self, request: pb.LeaveRoundRequest) -> pb.LeaveRoundReply:
        """A rank will not take its call's reply: its batch leaves its open round (``left``: its
        slabs are its own), or, if the round has closed, the round's answer for it once there is
        one (within ``request.timeout_s``). A call that has not come yet will not join a round."""
        key = (request.group, request.run, request.step)
        with self._cond:
            call = self._calls.get((*key, request.rank, request.client_id))
            if call is None:
                self._remember(self._left, (*key, request.rank, request.client_id), None)
                return pb.LeaveRoundReply(left=True)
            self._leave_open(call, key)  # a round that closed but has not begun leaves it out too
            wait = request.timeout_s if not bad_timeout(request.timeout_s, "") else 0.0
            self._cond.wait_for(lambda: call.reply is not None, wait or 2 * EXCHANGE_TIMEOUT_S)
            reply = call.reply
        if reply is None:  # its round has run past any exchange's limit: nobody can say yet
            return pb.LeaveRoundReply()
        return pb.LeaveRoundReply(left=not (reply.moved_in or reply.moved_out), reply=reply)

    def _ended(self, call: _Call, key: tuple) -> None:
        """``call``'s RPC is over: if it still waits in its open round, it leaves it."""
        with self._cond:
            self._leave_open(call, key)

    def _leave_open(self, call: _Call, key: tuple) -> None:
        """(Under the lock.) ``call`` ends: its batch leaves its open round, or the round that has
        closed with it and not begun."""
        call.ended = True
        buf = self._buffers.get(key)
        if call.added and call.reply is None and not call.closed and buf is not None:
            buf.drop(call.request.rank, call.request.step)
            self._keep(call, "cancelled")
            if not len(buf):
                del self._buffers[key]
            self._cond.notify_all()

    @staticmethod
    def _remember(table: OrderedDict, name: tuple, value) -> None:
        """(Under the lock.) ``table[name] = value``, forgetting the oldest answered entries past ``KEPT_CALLS``."""
        table[name] = value
        table.move_to_end(name)
        while len(table) > KEPT_CALLS:
            oldest = next(iter(table.values()))
            if oldest is not None and oldest.reply is None:
                break  # a call still in a round is never forgotten
            table.popitem(last=False)

    @staticmethod
    def _mark(rnd: Round) -> None:
        for it in rnd.items:
            it.key[0].closed = True

    def _keep(self, call: _Call, outcome: str, **fields) -> pb.RebalanceReply:
        """``call`` keeps its batch; its reply (with ``fields``) is whole before a waiter can see it."""
        req = call.request
        call.reply = pb.RebalanceReply(
            takes=[
                pb.RowTake(batch=b, rows=range(n), batch_rows=n, indices=[call.index(k, r) for r in range(n)])
                for k, (b, n) in enumerate(zip(req.batches, req.batch_rows))
            ],
            outcome=outcome,
            **fields,
        )
        return call.reply

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
        self.reader.close()
