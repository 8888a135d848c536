"""Tier-2 rounds at a group's leader DataServer (paper Section 3.4 "Balance correction",
Algorithm 1 lines 10-14): the runtime around the pure ``tier2.rounds`` (which batches meet) and
``tier2.policy`` (which rank takes each row).

Each rank of a ``client_ranks`` group, once a batch of a global step has landed, sends its slab
handles and its samples' features here (``Rebalance``) and is held until that step's round closes
(samples move only within a step, so each step has a round of its own): complete (all the group's
ranks sent it), full, or when its earliest batch's limit (``timeout_s``, from the rank's deadline)
has passed. The round runs the group's policy (``sort_fn``, which travels like a dataset: an
import path, or cloudpickle where the server takes pickles) over the features, checks the
assignment, and answers each rank with the rows it takes, slab by slab. Between ranks of one host
the slabs are handed over (no bytes move between servers), and a slab read by several ranks
carries their count (``SlabReader.share``), so the last one frees it. Rows bound for another host
go through that host's member (``tier2.crosshost``: one packed ``all_to_all``, or gRPC streams as
the fallback). A moved round is recorded at the Coordinator (``commit``) before any rank sees it;
a round that cannot go ahead keeps every batch where it is.

Who owns a batch is decided here, under one lock: a rank that will not take its call's reply (its
loader stopped, or the call failed on the way) asks ``LeaveRound``. A batch still in its open
round leaves it (the rank's slabs are its own again); one whose round has closed gets that round's
answer, so the rank gives back exactly what the round gave it and no rank reads a slab its owner
released. A rank that waits in ``next()`` for a batch still held asks ``AskRound``: the round
closes now and runs with what it holds.

Nothing here waits on a clock it could block on instead: a held call waits on the round's
condition until its own round closes, or until the open round's timeout is due.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections import Counter, OrderedDict

from helix_core.errors import ClusterError
from helix_core.memory.reader import SlabReader
from helix_core.memory.shm import SlabHandle
from helix_core.tier2.policy import Policies, decide
from helix_core.tier2.rounds import Round, RoundBuffer, RoundItem
from helix_core.wire.messages import slab_handle
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["EXCHANGE_TIMEOUT_S", "MAX_TIMEOUT_S", "RoundTable", "bad_timeout"]

log = logging.getLogger("helix.tier2")

KEPT_CALLS = 1024  # answered calls a LeaveRound may still ask about (and calls left before they came)
MAX_TIMEOUT_S = 86400.0  # the longest wait a call may ask for (a day): a wait past it is a client's error
# a round's cross-host Exchange (its collective, each gRPC stream) gives up after this (seconds); a
# rank's call waits for it twice beyond its round's own limit
EXCHANGE_TIMEOUT_S = 10.0


def bad_timeout(value: float, name: str) -> str | None:
    """Why ``value`` (seconds, 0: the default) is not a wait a call may ask for, or None: it must be
    finite and in [0, ``MAX_TIMEOUT_S``] (a NaN would hold its call for ever)."""
    if not (math.isfinite(value) and 0.0 <= value <= MAX_TIMEOUT_S):
        return f"{name} must be a finite number of seconds in [0, {MAX_TIMEOUT_S:g}], got {value!r}"
    return None


def _slab_pb(call, b: int) -> pb.SlabHandle:
    return call.request.batches[b].slab


def _slab(call, b: int) -> SlabHandle:
    return slab_handle(_slab_pb(call, b))


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


class RoundTable:
    """The rounds this DataServer leads, one open round per group and step. Thread-safe: each held
    call runs on its own gRPC thread; the one whose batch closes a round (or finds it due) runs it.

    ``allow_pickle``: whether a group's policy may come as cloudpickle; ``mover``: the
    ``CrossHostMover`` that moves rows between hosts (None: this server moves none); ``address``
    and ``host``: this server's (the leader is its host's member); ``commit``: records a moved
    round at the Coordinator before any rank sees it (None: no Coordinator); ``max_held``: calls
    it holds at once."""

    def __init__(
        self,
        allow_pickle: bool,
        clock=time.monotonic,
        mover=None,
        address: str = "",
        host: str = "",
        commit=None,
        max_held: int = 32,
    ):
        self.clock = clock
        self.policies = Policies(allow_pickle)  # the groups' policies, loaded once per content
        # calls held at once (each takes a gRPC handler thread): one past it keeps its batch at once
        # ("busy"), so held rounds never take the threads the server's other RPCs need
        self.max_held, self._held = max_held, 0
        # commit(group, run, step, {rank: indices}, {rank: [(segment, generation)]}, age_s) -> bool: a
        # moved round recorded at the Coordinator before a rank sees it (None: no Coordinator)
        self.commit = commit
        self.mover = mover
        self.address, self.host = address, host
        self.reader = SlabReader()
        self._cond = threading.Condition()
        self._buffers: dict[str, RoundBuffer] = {}
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

    # ---- a closed round, carried out (outside the lock) ----------------------------------------
    def _run(self, rnd: Round) -> None:
        """The policy's assignment of ``rnd`` turned into each rank's takes, slab by slab: slabs
        handed over within a host, rows that change host moved by each host's member, the round
        committed at the Coordinator, then every call's reply; a round that cannot go ahead keeps
        every batch where it is."""
        with self._cond:  # a call that ended while its round closed is left out of it
            gone = [it for it in rnd.items if it.key[0].ended]
            if gone:
                for c in {it.key[0] for it in gone}:
                    self._keep(c, "cancelled")
                rnd = Round(tuple(it for it in rnd.items if not it.key[0].ended), rnd.closed_by)
        calls = list(dict.fromkeys(it.key[0] for it in rnd.items))
        if not calls:
            return
        outcome, assignment, gain, cost, waited = decide(rnd, [c.request for c in calls], self.policies)
        if assignment is None:
            self.counts[outcome.split(":")[0]] += 1
            for c in calls:
                self._keep(
                    c,
                    outcome,
                    round_samples=len(rnd.items),
                    closed_by=rnd.closed_by,
                    gain_s=gain,
                    transfer_s=cost,
                    input_wait_s=waited,
                )  # what the gate saw
            return
        by_call = {(c.request.step, c.request.rank): c for c in calls}
        rows: dict[tuple, list] = {}  # (source call, its slab, taker): rows, in order
        for it, dst in zip(rnd.items, assignment):
            src, k = it.key
            b, row = src.source(k)
            rows.setdefault((src, b, by_call[(it.step, dst)]), []).append((row, it))
        readers: dict[tuple, set] = {}  # (source call, slab): its takers on the source's host
        for src, b, to in rows:
            readers.setdefault((src, b), set())
            if to.request.host == src.request.host:
                readers[(src, b)].add(to)
        if any(not self.reader.held(_slab(src, b)) for src, b in readers if src.request.host == self.host):
            return self._keep_all(calls, rnd, "error: a slab of the round was released before it closed")
        try:
            members, at = self._members(calls)
            crossed, transport = self._cross(calls, rows, members, at)
        except (ClusterError, ValueError) as e:  # a member gone or failed: the round keeps every batch
            return self._keep_all(calls, rnd, f"error: the cross-host exchange failed (kept): {e}")
        replies = {
            c: self._reply(c, rows, readers, crossed, transport, outcome, rnd, gain, cost, waited) for c in calls
        }
        shares: dict[int, list] = {}  # before any reply: a reader's release counts down from here
        for (src, b), who in readers.items():
            if len(who) > 1:
                shares.setdefault(at.get(src.request.host, -1), []).append((_slab_pb(src, b), len(who)))
        name = f"{calls[0].request.group}@{calls[0].request.step}"
        try:
            if -1 in shares:
                raise ValueError("a shared slab's host has no member")
            self._share(name, members, shares)
            # the last step that can fail: before any rank can see it, the Coordinator records what
            # each rank now trains on; a rank whose leader dies before it answers learns it there
            committed = self._commit(calls[0].request, replies, min(c.arrived for c in calls))
            if committed is not True:
                raise ClusterError(f"the Coordinator did not commit it ({committed})")
        except (ClusterError, ValueError) as e:
            self._share(name, members, {i: [(s, 1) for s, _ in got] for i, got in shares.items() if i >= 0}, undo=True)
            if crossed:
                held: dict[int, list] = {}
                for to, new in crossed.items():
                    held.setdefault(at[to.request.host], []).extend(h.slab for h in new.values())
                self.mover.drop(members, held)
            return self._keep_all(calls, rnd, f"error: the round could not go ahead (kept): {e}")
        self.counts[outcome] += 1
        for c, reply in replies.items():
            c.reply = reply

    def _share(self, name: str, members: list[str], shares: dict[int, list], undo: bool = False) -> None:
        """Each shared slab's reader count, on its host's member (``shares``: member -> [(slab,
        readers)]); ``undo`` (counts of 1) never raises: a round that failed gives each slab back
        to its owner alone."""
        try:
            for s, n in shares.get(0, []):
                if not self.reader.share(slab_handle(s), n) and not undo:
                    raise ValueError(f"slab {s.segment} was released before the round closed")
            remote = {i: got for i, got in shares.items() if i > 0}
            if remote:
                self.mover.share(name, members, remote)
        except (ClusterError, OSError) as e:
            if not undo:
                raise ClusterError(str(e)) from None

    def _commit(self, req: pb.RebalanceRequest, replies: dict, opened: float):
        """True once the Coordinator holds the round's answer (the round opened at ``opened``), else
        why not. A commit whose outcome is unknown (no reply) is withdrawn — unless a rank already
        learned it: then it stands."""
        if self.commit is None:  # no Coordinator (a table on its own)
            return True
        moved = {c.request.rank: [i for t in r.takes for i in t.indices] for c, r in replies.items()}
        if any(i < 0 for v in moved.values() for i in v):
            return "a rank did not name its samples"  # no record could tell a rank what to decode again
        # what a rank releases had it read its answer: each take's slab (a shared one counts it), and
        # its own slabs whose rows all left its host
        release = {
            c.request.rank: list(
                dict.fromkeys(slab_handle(h).unsized() for h in [*(t.batch.slab for t in r.takes), *r.release])
            )
            for c, r in replies.items()
        }
        try:
            return (
                self.commit(req.group, req.run, req.step, moved, release, self.clock() - opened)
                or "a rank was told to keep its batch"
            )
        except Exception as e:  # noqa: BLE001 - unknown whether it landed: withdraw it
            why = f"{type(e).__name__}: {e}"
        paused, pause = 0.0, 0.05
        while True:  # a commit that stood while every rank was told it kept would be the one disagreement
            try:
                return (
                    "withdrawn: " + why
                    if self.commit(req.group, req.run, req.step, {}, {}, self.clock() - opened)
                    else True
                )
            except Exception as e:  # noqa: BLE001 - the Coordinator is out of reach: try again, a while
                if paused + pause > EXCHANGE_TIMEOUT_S:
                    return f"{why}; not withdrawn: {type(e).__name__}: {e}"
            time.sleep(pause)  # a back-off between tries (counted, so a table's own clock may stand still)
            paused, pause = paused + pause, min(2 * pause, 1.0)

    def _reply(
        self,
        c,
        rows: dict,
        readers: dict,
        crossed: dict,
        transport: str,
        outcome: str,
        rnd: Round,
        gain: float,
        cost: float,
        waited: float,
    ) -> pb.RebalanceReply:
        """Call ``c``'s answer: the rows it takes, its own first, then by source rank, slab and row."""
        reply = pb.RebalanceReply(
            outcome=outcome,
            gain_s=gain,
            transfer_s=cost,
            round_samples=len(rnd.items),
            closed_by=rnd.closed_by,
            transport=transport if crossed.get(c) else "",
            input_wait_s=waited,
        )
        units = []  # (order, the take)
        for (src, b, to), got in rows.items():
            if to is not c:
                if (
                    src is c
                    and to.request.host != c.request.host
                    and not readers[(src, b)]
                    and _slab_pb(src, b) not in reply.release
                ):
                    reply.release.append(_slab_pb(src, b))  # every row of it left this host
                continue
            take_rows = [r for r, _ in got]
            order = (src is not c, src.request.rank, b, take_rows[0])
            if src is not c:
                reply.moved_in += len(got)
                reply.moved_bytes += sum(int(it.features.get("bytes", 0) or 0) for _, it in got)
            indices = [src.index(b, r) for r in take_rows]
            costs = [float(it.features.get("cost", 0.0) or 0.0) for _, it in got]
            if to.request.host != src.request.host:  # its rows' new slab on this host
                reply.crossed_bytes += sum(int(it.features.get("bytes", 0) or 0) for _, it in got)
                take = pb.RowTake(
                    batch=crossed[c][(src, b)], rows=range(len(got)), batch_rows=len(got), indices=indices, costs=costs
                )
            else:
                take = pb.RowTake(
                    batch=src.request.batches[b],
                    rows=take_rows,
                    shared=len(readers[(src, b)]) > 1,
                    batch_rows=src.request.batch_rows[b],
                    indices=indices,
                    costs=costs,
                )
            units.append((order, take))
        reply.moved_out = sum(len(got) for (src, _, to), got in rows.items() if src is c and to is not c)
        reply.takes.extend(t for _, t in sorted(units, key=lambda u: u[0]))
        return reply

    def _keep_all(self, calls: list, rnd: Round, outcome: str) -> None:
        self.counts["error"] += 1
        for c in calls:
            self._keep(c, outcome, round_samples=len(rnd.items), closed_by=rnd.closed_by)

    def _members(self, calls: list) -> tuple[list[str], dict[str, int]]:
        """One DataServer per host of the round, the leader first (``at``: host -> its index)."""
        members, at = [self.address], {self.host: 0}  # the leader is its host's member
        for c in sorted(calls, key=lambda c: c.request.rank):
            if c.request.host not in at and c.request.delivery:
                at[c.request.host] = len(members)
                members.append(c.request.delivery)
        return members, at

    def _cross(self, calls: list, rows: dict, members: list[str], at: dict) -> tuple[dict, str]:
        """The rows that change host, moved by each host's member: ``({taker: {(source, slab): new
        slab}}, transport)``; ``({}, "")`` when none does."""
        crossing = [(key, got) for key, got in rows.items() if key[2].request.host != key[0].request.host]
        if not crossing:
            return {}, ""
        if self.mover is None:
            raise ValueError("this DataServer cannot move rows between hosts")
        missing = sorted({c.request.rank for c in calls if c.request.host not in at})
        if missing:
            raise ValueError(f"rank(s) {missing} named no delivery server")
        sends: dict[int, list] = {}
        for n, ((src, b, to), got) in enumerate(crossing):
            sends.setdefault(at[src.request.host], []).append(
                pb.ExchangeSend(
                    batch=src.request.batches[b],
                    rows=[r for r, _ in got],
                    batch_rows=src.request.batch_rows[b],
                    to=at[to.request.host],
                    key=n,
                )
            )
        name = f"{calls[0].request.group}@{calls[0].request.step}"
        new, transport = self.mover.run(name, members, sends, calls[0].request.exchange, EXCHANGE_TIMEOUT_S)
        crossed: dict = {}
        for n, ((src, b, to), _) in enumerate(crossing):
            crossed.setdefault(to, {})[(src, b)] = new[n]
        return crossed, transport

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close()
        self.reader.close()
