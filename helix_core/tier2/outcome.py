"""A closed Tier-2 round carried out at its leader DataServer: the policy's assignment turned into
each rank's takes, slab by slab — slabs handed over within a host (a slab read by several ranks
carries their count, ``SlabReader.share``), rows that change host moved by one DataServer per host
(``HostExchange``) — and the replies; a round that cannot keeps every batch where it is.

A base class of ``RoundTable`` (``tier2/leader.py``), whose ``_keep`` makes a kept batch's reply.
"""

from __future__ import annotations

import time

from helix_core.errors import ClusterError
from helix_core.tier2.rounds import Round
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["EXCHANGE_TIMEOUT_S", "RoundOutcome"]

EXCHANGE_TIMEOUT_S = 10.0  # a cross-host exchange's collective (and each gRPC stream) gives up after this


def _slab(call, b: int) -> dict:
    s = call.request.batches[b].slab
    return {"segment": s.segment, "generation": s.generation}


def _slab_pb(call, b: int) -> pb.SlabHandle:
    return call.request.batches[b].slab


class RoundOutcome:
    """A closed round's takes and replies (``_run``), on ``RoundTable``'s reader, exchange and counts."""

    def _run(self, rnd: Round) -> None:
        with self._cond:  # a call that ended while its round closed is left out of it
            gone = [it for it in rnd.items if it.key[0].ended]
            if gone:
                for c in {it.key[0] for it in gone}:
                    self._keep(c, "cancelled")
                rnd = Round(tuple(it for it in rnd.items if not it.key[0].ended), rnd.closed_by)
        calls = list(dict.fromkeys(it.key[0] for it in rnd.items))
        if not calls:
            return
        outcome, assignment, gain, cost, waited = self._decide(rnd, calls)
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
                self.exchange.drop(members, held)
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
                if not self.reader.share({"segment": s.segment, "generation": s.generation}, n) and not undo:
                    raise ValueError(f"slab {s.segment} was released before the round closed")
            remote = {i: got for i, got in shares.items() if i > 0}
            if remote:
                self.exchange.share(name, members, remote)
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
                dict.fromkeys((h.segment, h.generation) for h in [*(t.batch.slab for t in r.takes), *r.release])
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
        if self.exchange is None:
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
        new, transport = self.exchange.run(name, members, sends, calls[0].request.exchange, EXCHANGE_TIMEOUT_S)
        crossed: dict = {}
        for n, ((src, b, to), _) in enumerate(crossing):
            crossed.setdefault(to, {})[(src, b)] = new[n]
        return crossed, transport
