"""Tier 2 across hosts (paper Section 3.5): a round's rows that move to a rank on another host.

Within a host a round hands slabs over (``runtime/tier2.py``); a slab cannot cross hosts, so its
rows must. The round's leader has one member per host of the group — itself for its own host,
and the delivery server of that host's lowest rank elsewhere — move them (``Exchange``), then
answers every rank with takes of the rows' new slabs, on the rank's own host:

- ``collective`` (the default): the members form a gloo group of their own (the rendezvous is a
  TCPStore the leader hosts, made again under a new generation after a failure); each reads its
  rows to send out of its host's slabs, packs them per destination (``collective.pack_many``: a
  JSON tree plus tensor descriptors, never pickle) and all members do one ``all_to_all``; each
  writes what it received into slabs of its own.
- ``grpc`` (the fallback, when a collective fails or is not asked for): each member with rows to
  send streams them, one slab's rows at a time, into the receiving member (``Deliver``, or the
  bulk path) — what a remote server does with a batch.

A round whose exchange fails anywhere keeps every batch where it is: the slabs received so far are
dropped, none of the senders' slabs was released (their ranks release those only once answered).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from ..errors import ClusterError
from .auth import call_metadata
from .delivery import DeliveryFailed, metas_to_pb
from .proto import helix_pb2 as pb
from .proto import helix_pb2_grpc as pbg
from .rpc import connect

# torch and what is built on it (``tensors``, ``merge``, ``collective``) are imported where rows are
# read, packed or written: every DataServer holds an ``ExchangeMember``, and one that never moves
# rows across hosts never loads torch (a server's start is ~2 s of CPU shorter without it).

__all__ = ["ExchangeMember", "HostExchange", "load_row_code", "meta_dicts", "read_rows", "TRANSPORTS"]

log = logging.getLogger("helix.crosshost")
TRANSPORTS = ("collective", "grpc")


def load_row_code() -> None:
    """Import torch and the row code: a DataServer reachable from other hosts does it before it serves."""
    from . import collective, merge  # noqa: F401  (torch and tensors with them)


def meta_dicts(metas) -> list[dict]:
    return [{"dtype": m.dtype, "shape": list(m.shape), "offset": m.offset, "nbytes": m.nbytes,
             "is_inline": m.is_inline, "inline_data": m.inline_data} for m in metas]


def _handle(b: pb.BatchHandle) -> dict:
    return {"segment": b.slab.segment, "generation": b.slab.generation, "nbytes": b.slab.nbytes}


def read_rows(reader, b: pb.BatchHandle, rows, n: int, pickle_allowed: bool, view: bool = False):
    """Rows ``rows`` of the ``n``-row batch in ``b``'s slab, copied out (``take_rows``); ValueError
    if the slab was handed out again while they were read. The slab stays held. ``view``: rows
    that follow each other are a view of the slab instead (the caller copies them, and checks
    ``held`` after, before it releases the slab)."""
    from .merge import take_rows
    from .tensors import read_tensors, unflatten
    if b.tree_pickle and not pickle_allowed:
        raise ClusterError("a DataServer sent a pickled batch structure to a peer that accepts none")
    handle = _handle(b)
    buf = reader.view(handle) if b.slab.segment else memoryview(b"")
    batch = unflatten(b.tree_json, b.tree_pickle, read_tensors(buf, meta_dicts(b.tensors)))
    del buf
    out = take_rows(batch, list(rows), n, view)
    if b.slab.segment and not reader.held(handle):  # released and maybe reused while copied
        raise ValueError(f"slab {b.slab.segment} was handed out again while its rows were read")
    return out


def _header(batch, pickle_allowed: bool) -> tuple[pb.StreamHeader, list, list[dict], int]:
    from .tensors import flatten, layout
    tree_json, tree_pickle, flat = flatten(batch, allow_pickle=pickle_allowed)
    metas, total = layout(flat)
    return pb.StreamHeader(tree_json=tree_json, tree_pickle=tree_pickle, total_bytes=total), flat, metas, total


class ExchangeMember:
    """A DataServer's part in cross-host exchanges (its ``Exchange`` RPC): ``reader`` maps its
    host's slabs, ``inbound`` takes rows into its own, ``outbound`` streams to other members."""

    def __init__(self, reader, inbound, outbound, pickle_allowed: bool, bind: str):
        self.reader, self.inbound, self.outbound = reader, inbound, outbound
        self.pickle_allowed, self.bind = pickle_allowed, bind
        self._lock = threading.Lock()  # one exchange at a time: a gloo group runs one collective at a time
        self._group: tuple | None = None  # ((store, generation), ExchangeGroup)

    def serve(self, req: pb.ExchangeRequest, store=None) -> pb.ExchangeReply:
        """One member's round; ``store``: the leader's own (in process). ClusterError if it failed."""
        if req.drop:
            for h in req.drop:
                self.reader.release({"segment": h.segment, "generation": h.generation})
            return pb.ExchangeReply()
        if req.share:
            stale = [h.segment for h, n in zip(req.share, req.readers)  # counts of 1: a failed round's undo
                     if not self.reader.share({"segment": h.segment, "generation": h.generation}, n) and n > 1]
            if stale:
                raise ClusterError(f"Tier-2 round {req.round}: slab(s) {stale} were released before it closed")
            return pb.ExchangeReply()
        if req.transport not in TRANSPORTS:
            raise ValueError(f"Exchange transport {req.transport!r}; valid: {', '.join(TRANSPORTS)}")
        with self._lock:
            t0 = time.perf_counter()
            rows = [(s, read_rows(self.reader, s.batch, s.rows, s.batch_rows, self.pickle_allowed)) for s in req.sends]
            if req.transport == "grpc":
                reply = self._by_grpc(req, rows)
            else:
                reply = self._by_collective(req, rows, store)
            reply.seconds = time.perf_counter() - t0
            return reply

    def _by_grpc(self, req, rows) -> pb.ExchangeReply:
        import torch
        from .tensors import write_tensors
        reply = pb.ExchangeReply()
        for s, batch in rows:
            header, flat, metas, total = _header(batch, self.pickle_allowed)
            buf = torch.empty(total, dtype=torch.uint8)
            header.tensors.extend(metas_to_pb(write_tensors(memoryview(buf.numpy()), flat, metas)))
            try:
                got = self.outbound.push(header, memoryview(buf.numpy()), req.members[s.to])
            except DeliveryFailed as e:
                self._drop_sent(req, reply)
                raise ClusterError(f"Tier-2 round {req.round}: rows to {req.members[s.to]}: {e}") from None
            reply.got.add(key=s.key, batch=got.batch)
            reply.bytes += total
        return reply

    def _drop_sent(self, req, reply) -> None:
        """The rows this member already streamed, dropped at their receivers (the round failed)."""
        for g in reply.got:
            to = next(s.to for s in req.sends if s.key == g.key)
            try:
                pbg.DataServerStub(self.outbound.channel(req.members[to])).Exchange(
                    pb.ExchangeRequest(round=req.round, drop=[g.batch.slab]), timeout=10,
                    metadata=call_metadata(self.outbound.token))
            except (grpc.RpcError, DeliveryFailed):
                pass  # that member is gone: its slabs went with it

    def _join(self, req, store):
        from .collective import ExchangeGroup
        key = (req.store, req.generation)
        if self._group is not None and self._group[0] == key:
            return self._group[1]
        if self._group is not None:
            self._group[1].close()
            self._group = None
        host, port = req.store.rsplit(":", 1)
        group = ExchangeGroup(req.member, len(req.members), host.strip("[]"), int(port), timeout_s=req.timeout_s or 30.0,
                              store=store, bind=self.bind, prefix=f"tier2-{req.generation}")
        self._group = (key, group)
        return group

    def _by_collective(self, req, rows, store) -> pb.ExchangeReply:
        try:
            group = self._join(req, store)
            outgoing = [[] for _ in req.members]
            for s, batch in rows:
                outgoing[s.to].append({"key": int(s.key), "rows": batch})
            incoming = group.exchange(outgoing)
        except (ClusterError, TypeError) as e:  # a dead peer, a timeout, a structure JSON cannot carry
            self.leave()
            raise ClusterError(f"Tier-2 round {req.round}: all_to_all: {e}") from None
        reply = pb.ExchangeReply(bytes=sum(batch_bytes(b) for _, b in rows))
        try:
            for items in incoming:
                for item in items:
                    reply.got.add(key=int(item["key"]), batch=self._write(item["rows"]))
        except Exception as e:
            for g in reply.got:
                self.reader.release(_handle(g.batch))
            raise ClusterError(f"Tier-2 round {req.round}: rows received could not be written: {e}") from None
        return reply

    def _write(self, batch) -> pb.BatchHandle:
        """``batch`` into one of this server's slabs."""
        from .tensors import write_tensors
        header, flat, metas, total = _header(batch, self.pickle_allowed)
        slab = self.inbound.take(header)  # Refused: a full /dev/shm
        try:
            header.tensors.extend(metas_to_pb(write_tensors(slab.payload, flat, metas)))
        except Exception:
            self.reader.release(slab.handle(total))
            raise
        return self.inbound.reply(slab, header).batch

    def leave(self) -> None:
        if self._group is not None:
            self._group[1].close()
            self._group = None


def batch_bytes(batch) -> int:
    """The payload bytes of a batch's tensors."""
    from .tensors import flatten
    return sum(t.numel() * t.element_size() for t in flatten(batch, allow_pickle=True)[2])


class HostExchange:
    """The leader's side: runs a round's cross-host moves through each host's member (``member``
    is the leader's own), falling back from the collective to gRPC; ``counts`` by transport."""

    def __init__(self, member: ExchangeMember, token: str | None, config, tls):
        self.member, self.token, self.config, self.tls = member, token, config, tls
        self._channels: dict[str, grpc.Channel] = {}
        self._store, self._store_for, self._generation = None, None, 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="helix-exchange")
        self.counts = {"collective": 0, "grpc": 0, "failed": 0, "bytes": 0}

    def run(self, name: str, members: list[str], sends: dict[int, list[pb.ExchangeSend]], transport: str,
            timeout_s: float) -> tuple[dict[int, pb.BatchHandle], str]:
        """``({key: new slab}, transport used)``; ClusterError when both ways failed."""
        with self._lock:  # the leader's rounds cross hosts one at a time (one gloo group)
            if transport == "collective":
                try:
                    return self._run(name, members, sends, "collective", timeout_s), "collective"
                except ClusterError as e:
                    log.warning("%s: the collective failed (%s): by gRPC", name, e)
                    self._close_store()
            try:
                return self._run(name, members, sends, "grpc", timeout_s), "grpc"
            except ClusterError:
                self.counts["failed"] += 1
                raise

    def share(self, name: str, members: list[str], shares: dict[int, list[tuple]]) -> None:
        """Slabs read by several ranks of a member's host get their reader counts there
        (``shares``: member -> [(slab, readers)]); ClusterError if one was released meanwhile."""
        futures = [self._pool.submit(self._call, i, members, pb.ExchangeRequest(
            round=name, share=[s for s, _ in got], readers=[n for _, n in got]), None, 10.0)
            for i, got in shares.items() if got]
        errors = []
        for fut in futures:
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001
                errors.append(str(e))
        if errors:
            raise ClusterError("; ".join(errors))

    def drop(self, members: list[str], held: dict[int, list]) -> None:
        """Release slabs of a round that failed after its exchange (member -> [slab])."""
        for i, slabs in held.items():
            try:
                self._call(i, members, pb.ExchangeRequest(drop=slabs), None, 10.0)
            except ClusterError:
                pass  # that member is gone, and its slabs with it

    def _run(self, name, members, sends, transport, timeout_s) -> dict[int, pb.BatchHandle]:
        from .collective import open_store
        store = None
        if transport == "collective":
            if self._store is None or self._store_for != members:
                self._close_store()
                self._generation += 1
                self._store, self._store_for = open_store(self.member.bind, len(members), timeout_s), list(members)
            store = self._store
        where = f"{self.member.bind}:{self._store.port}" if store is not None else ""
        todo = range(len(members)) if transport == "collective" else [i for i in range(len(members)) if sends.get(i)]
        futures = {i: self._pool.submit(self._call, i, members, pb.ExchangeRequest(
            round=name, members=members, member=i, transport=transport, sends=sends.get(i, []), store=where,
            generation=self._generation, timeout_s=timeout_s), store, timeout_s) for i in todo}
        replies, errors = {}, []
        for i, fut in futures.items():
            try:
                replies[i] = fut.result()
            except Exception as e:  # noqa: BLE001 - any member's failure fails the round
                errors.append(f"{members[i]}: {e}")
        if errors:
            self._drop(members, replies, sends, transport)
            raise ClusterError("; ".join(errors))
        self.counts[transport] += 1
        self.counts["bytes"] += sum(r.bytes for r in replies.values())
        return {g.key: g.batch for r in replies.values() for g in r.got}

    def _call(self, i, members, req, store, timeout_s) -> pb.ExchangeReply:
        if i == 0:
            return self.member.serve(req, store=store)
        channel = self._channels.get(members[i])
        if channel is None:
            channel = self._channels[members[i]] = connect(members[i], self.config, self.tls)
        try:
            return pbg.DataServerStub(channel).Exchange(req, timeout=timeout_s + self.config.rpc_timeout_s,
                                                        metadata=call_metadata(self.token))
        except grpc.RpcError as e:
            raise ClusterError(f"{e.code().name} {e.details()}") from None

    def _drop(self, members, replies, sends, transport) -> None:
        """A failed round's rows already written at their receivers, released there."""
        to = {s.key: s.to for ss in sends.values() for s in ss}
        held: dict[int, list] = {}
        for i, r in replies.items():
            for g in r.got:  # the collective's replies name what a member received, gRPC's what it sent
                held.setdefault(i if transport == "collective" else to[g.key], []).append(g.batch.slab)
        self.drop(members, held)

    def _close_store(self) -> None:
        self.member.leave()
        self._store, self._store_for = None, None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._close_store()
        for ch in self._channels.values():
            ch.close()
