"""Tier 2 across hosts (paper Section 3.5): a round's rows that move to a rank on another host.

Within a host a round hands slabs over (``tier2/leader.py``); a slab cannot cross hosts, so its
rows must. The round's leader has one member per host of the group (``HostMember``) — itself for
its own host, and the delivery server of that host's lowest rank elsewhere — move them (the
``Exchange`` RPC, driven by the leader's ``CrossHostMover``), then answers every rank with takes
of the rows' new slabs, on the rank's own host:

- ``grpc`` (the default on a TLS cluster, and the fallback): each member with rows to send
  streams them, one slab's rows at a time, into the receiving member (``Deliver``, or the bulk
  path) — what a sidecar does with a batch, on Helix's channels (token, TLS).
- ``collective`` (the default without TLS): the members form a gloo group of their own (the
  rendezvous is a TCPStore the leader hosts on its own address only, made again under a new
  generation after a failure); each reads its rows to send out of its host's slabs, packs them per
  destination (``collective.pack_many``: a JSON tree plus tensor descriptors, never pickle) and
  all members do one ``all_to_all``; each writes what it received into slabs of its own. gloo and
  its store have neither TLS nor a token: a server with TLS never joins or hosts one (whatever a
  rank asks), so on a TLS cluster no row and no rendezvous leaves TLS.

A member only reads a rank's slab (no lease: the rank, or the slab's own timeout, stays its
holder), so a rank that dies after its round leaves nothing its producer cannot take back.

A round whose exchange fails anywhere keeps every batch where it is: the slabs received so far are
dropped, none of the senders' slabs was released (their ranks release those only once answered).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import grpc

from helix_core.errors import ClusterError
from helix_core.security.auth import call_metadata
from helix_core.wire.delivery import DeliveryFailed
from helix_core.wire.messages import meta_dicts, metas_to_pb, slab_handle
from helix_core.wire.proto import helix_pb2 as pb
from helix_core.wire.proto import helix_pb2_grpc as pbg
from helix_core.wire.rpc import connect

# torch and what is built on it (``tensors``, ``merge``, ``collective``) are imported where rows are
# read, packed or written: every DataServer holds a ``HostMember``, and one that never moves
# rows across hosts never loads torch (a server's start is ~2 s of CPU shorter without it).

__all__ = ["CrossHostMover", "HostMember", "TRANSPORTS", "load_row_code", "read_rows"]

log = logging.getLogger("helix.crosshost")
TRANSPORTS = ("collective", "grpc")


def load_row_code() -> None:
    """Import torch and the row code: a DataServer reachable from other hosts does it before it serves."""
    from helix_core.memory import merge  # noqa: F401  (torch and tensors with them)


def read_rows(reader, b: pb.BatchHandle, rows, n: int, pickle_allowed: bool, view: bool = False, lease: bool = True):
    """Rows ``rows`` of the ``n``-row batch in ``b``'s slab, copied out (``take_rows``); ValueError
    if the slab was handed out again while they were read. The slab stays held. ``view``: rows
    that follow each other are a view of the slab instead (the caller copies them, and checks
    ``held`` after, before it releases the slab). ``lease``: this process becomes the slab's
    holder (a rank's read; a server reading a rank's slab takes none)."""
    from helix_core.memory.merge import take_rows
    from helix_core.memory.tensors import read_tensors, unflatten

    if b.tree_pickle and not pickle_allowed:
        raise ClusterError("a DataServer sent a pickled batch structure to a peer that accepts none")
    handle = slab_handle(b.slab)
    buf = reader.view(handle, lease=lease) if b.slab.segment else memoryview(b"")
    batch = unflatten(b.tree_json, b.tree_pickle, read_tensors(buf, meta_dicts(b.tensors)))
    del buf
    out = take_rows(batch, list(rows), n, view)
    if b.slab.segment and not reader.held(handle):  # released and maybe reused while copied
        raise ValueError(f"slab {b.slab.segment} was handed out again while its rows were read")
    return out


def _header(batch, pickle_allowed: bool) -> tuple[pb.StreamHeader, list, list[dict], int]:
    from helix_core.memory.tensors import flatten, layout

    tree_json, tree_pickle, flat = flatten(batch, allow_pickle=pickle_allowed)
    metas, total = layout(flat)
    return pb.StreamHeader(tree_json=tree_json, tree_pickle=tree_pickle, total_bytes=total), flat, metas, total


MAX_GROUPS = 8  # gloo groups a member keeps (one per leader it serves); the least recently used goes


class _GroupSlot:
    """A member's gloo group for one leader's store: one collective at a time (``lock``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.generation: int | None = None
        self.group = None  # GlooGroup

    def close(self) -> None:
        group, self.group, self.generation = self.group, None, None
        if group is not None:
            group.close()


class HostMember:
    """A DataServer's part in moving rows between hosts (its ``Exchange`` RPC): ``reader`` maps its
    host's slabs, ``inbound`` takes rows into its own, ``outbound`` streams to other members.
    ``secure``: the server has TLS, so it takes part in no collective (gloo has no TLS)."""

    def __init__(self, reader, inbound, outbound, pickle_allowed: bool, bind: str, secure: bool = False):
        self.reader, self.inbound, self.outbound = reader, inbound, outbound
        self.pickle_allowed, self.bind, self.secure = pickle_allowed, bind, secure
        self._lock = threading.Lock()  # guards _groups
        # a group per leader (its store's address): two leaders that are each other's members never
        # share a group, nor wait on each other's lock
        self._groups: OrderedDict[str, _GroupSlot] = OrderedDict()

    def serve(self, req: pb.ExchangeRequest, store=None) -> pb.ExchangeReply:
        """One member's round; ``store``: the leader's own (in process). ClusterError if it failed."""
        if req.drop:
            for h in req.drop:
                self.reader.release(slab_handle(h))
            return pb.ExchangeReply()
        if req.share:
            stale = [
                h.segment
                for h, n in zip(req.share, req.readers)  # counts of 1: a failed round's undo
                if not self.reader.share(slab_handle(h), n) and n > 1
            ]
            if stale:
                raise ClusterError(f"Tier-2 round {req.round}: slab(s) {stale} were released before it closed")
            return pb.ExchangeReply()
        if req.transport not in TRANSPORTS:
            raise ValueError(f"Exchange transport {req.transport!r}; valid: {', '.join(TRANSPORTS)}")
        if req.transport == "collective" and self.secure:
            raise ClusterError(
                f"Tier-2 round {req.round}: this DataServer has TLS and joins no gloo collective "
                "(no TLS there): rows cross hosts by gRPC"
            )
        t0 = time.perf_counter()
        if req.transport == "grpc":
            reply = self._by_grpc(req, self._rows(req))
        else:
            slot = self._slot(req.store)
            with slot.lock:  # a gloo group runs one collective at a time
                reply = self._by_collective(req, self._rows(req), store, slot)
        reply.seconds = time.perf_counter() - t0
        return reply

    def _rows(self, req) -> list:
        """The rows this member sends, read out of its host's slabs (no lease: the ranks hold them)."""
        return [
            (s, read_rows(self.reader, s.batch, s.rows, s.batch_rows, self.pickle_allowed, lease=False))
            for s in req.sends
        ]

    def _slot(self, where: str) -> _GroupSlot:
        """The group of the leader whose store is at ``where``, made if new (past ``MAX_GROUPS``, the
        least recently used idle one is closed)."""
        with self._lock:
            slot = self._groups.get(where)
            if slot is None:
                slot = self._groups[where] = _GroupSlot()
                for old in list(self._groups)[:-1]:
                    if len(self._groups) <= MAX_GROUPS:
                        break
                    idle = self._groups[old]
                    if idle.lock.acquire(blocking=False):  # one in a collective stays
                        del self._groups[old]
                        try:
                            idle.close()
                        finally:
                            idle.lock.release()
            self._groups.move_to_end(where)
            return slot

    def _by_grpc(self, req, rows) -> pb.ExchangeReply:
        import torch

        from helix_core.memory.tensors import write_tensors

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
                    pb.ExchangeRequest(round=req.round, drop=[g.batch.slab]),
                    timeout=10,
                    metadata=call_metadata(self.outbound.token),
                )
            except (grpc.RpcError, DeliveryFailed):
                pass  # that member is gone: its slabs went with it

    def _join(self, req, store, slot: _GroupSlot):
        """(Under ``slot.lock``.) The leader's group at ``req.generation``, joined if new."""
        from helix_core.tier2.collective import GlooGroup

        if slot.group is not None and slot.generation == req.generation:
            return slot.group
        slot.close()
        host, port = req.store.rsplit(":", 1)
        slot.group = GlooGroup(
            req.member,
            len(req.members),
            host.strip("[]"),
            int(port),
            timeout_s=req.timeout_s or 30.0,
            store=store,
            bind=self.bind,
            prefix=f"tier2-{req.generation}",
        )
        slot.generation = req.generation
        return slot.group

    def _by_collective(self, req, rows, store, slot: _GroupSlot) -> pb.ExchangeReply:
        try:
            group = self._join(req, store, slot)
            outgoing = [[] for _ in req.members]
            for s, batch in rows:
                outgoing[s.to].append({"key": int(s.key), "rows": batch})
            incoming = group.all_to_all(outgoing)
        except (ClusterError, TypeError) as e:  # a dead peer, a timeout, a structure JSON cannot carry
            slot.close()
            raise ClusterError(f"Tier-2 round {req.round}: all_to_all: {e}") from None
        reply = pb.ExchangeReply(bytes=sum(batch_bytes(b) for _, b in rows))
        try:
            for items in incoming:
                for item in items:
                    reply.got.add(key=int(item["key"]), batch=self._write(item["rows"]))
        except Exception as e:
            for g in reply.got:
                self.reader.release(slab_handle(g.batch.slab))
            raise ClusterError(f"Tier-2 round {req.round}: rows received could not be written: {e}") from None
        return reply

    def _write(self, batch) -> pb.BatchHandle:
        """``batch`` into one of this server's slabs."""
        from helix_core.memory.tensors import write_tensors

        header, flat, metas, total = _header(batch, self.pickle_allowed)
        slab = self.inbound.take(header)  # Refused: a full /dev/shm
        try:
            header.tensors.extend(metas_to_pb(write_tensors(slab.payload, flat, metas)))
        except Exception:
            self.reader.release(slab.handle(total))
            raise
        return self.inbound.reply(slab, header).batch

    def leave(self, where: str | None = None) -> None:
        """Close the group of the leader whose store is at ``where`` (None: every group)."""
        with self._lock:
            slots = list(self._groups.values()) if where is None else [self._groups.get(where)]
            for k in list(self._groups) if where is None else [where]:
                self._groups.pop(k, None)
        for slot in slots:
            if slot is not None:
                with slot.lock:
                    slot.close()


def batch_bytes(batch) -> int:
    """The payload bytes of a batch's tensors."""
    from helix_core.memory.tensors import flatten

    return sum(t.numel() * t.element_size() for t in flatten(batch, allow_pickle=True)[2])


class CrossHostMover:
    """The leader's side: runs a round's cross-host moves through each host's member (``member``
    is the leader's own), falling back from the collective to gRPC; ``counts`` by transport. With
    ``tls`` it never opens a store nor asks for a collective: rows go by gRPC over TLS."""

    def __init__(self, member: HostMember, token: str | None, config, tls):
        self.member, self.token, self.config, self.tls = member, token, config, tls
        self._channels: dict[str, grpc.Channel] = {}
        self._store, self._store_for, self._generation = None, None, 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="helix-exchange")
        self.counts = {"collective": 0, "grpc": 0, "failed": 0, "bytes": 0}

    def run(
        self, name: str, members: list[str], sends: dict[int, list[pb.ExchangeSend]], transport: str, timeout_s: float
    ) -> tuple[dict[int, pb.BatchHandle], str]:
        """``({key: new slab}, transport used)``; ClusterError when both ways failed. ``transport``:
        what the group asked ("" for the cluster's default, :meth:`transport`)."""
        transport = self.transport(transport)
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

    def transport(self, asked: str) -> str:
        """The transport of a round whose group asked ``asked``: gRPC where this server has TLS
        (gloo would carry rows and rendezvous in clear text), else ``asked`` (gRPC unless it names
        the collective: that runs only where a group asked for it)."""
        if self.tls is not None:
            if asked == "collective":
                log.warning("a Tier-2 group asked for exchange='collective' on a TLS cluster: by gRPC over TLS")
            return "grpc"
        return asked if asked in TRANSPORTS else "grpc"

    def share(self, name: str, members: list[str], shares: dict[int, list[tuple]]) -> None:
        """Slabs read by several ranks of a member's host get their reader counts there
        (``shares``: member -> [(slab, readers)]); ClusterError if one was released meanwhile."""
        futures = [
            self._pool.submit(
                self._call,
                i,
                members,
                pb.ExchangeRequest(round=name, share=[s for s, _ in got], readers=[n for _, n in got]),
                None,
                10.0,
            )
            for i, got in shares.items()
            if got
        ]
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
        from helix_core.tier2.collective import open_store

        store = None
        if transport == "collective":
            if self._store is None or self._store_for != members:
                self._close_store()
                self._generation += 1
                self._store, self._store_for = open_store(self.member.bind, len(members), timeout_s), list(members)
            store = self._store
        where = f"{self.member.bind}:{self._store.port}" if store is not None else ""
        todo = range(len(members)) if transport == "collective" else [i for i in range(len(members)) if sends.get(i)]
        futures = {
            i: self._pool.submit(
                self._call,
                i,
                members,
                pb.ExchangeRequest(
                    round=name,
                    members=members,
                    member=i,
                    transport=transport,
                    sends=sends.get(i, []),
                    store=where,
                    generation=self._generation,
                    timeout_s=timeout_s,
                ),
                store,
                timeout_s,
            )
            for i in todo
        }
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
            return pbg.DataServerStub(channel).Exchange(
                req, timeout=timeout_s + self.config.rpc_timeout_s, metadata=call_metadata(self.token)
            )
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
        if self._store is not None:
            self.member.leave(f"{self.member.bind}:{self._store.port}")
        self._store, self._store_for = None, None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._close_store()
        for ch in self._channels.values():
            ch.close()
