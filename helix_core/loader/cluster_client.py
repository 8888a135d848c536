"""The client's wires: the Coordinator (routes) and DataServers (execute, shared-memory handles).

``ClusterClient`` is what the loader talks to. It makes the DataServer calls itself (Execute,
Cancel, a Tier-2 round's Rebalance / AskRound / LeaveRound) and holds two parts, each with its own
state: ``coordinator``, a ``CoordinatorCalls`` (``coordinator_calls.py``: the Coordinator's channel,
registering, routing and its fallback while the Coordinator is away, the lease, completions), and
``reader``, the ``SlabReader`` that maps the batches' slabs, which the functions of ``replies.py``
turn replies into batches with.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc

from helix_core.config import ClusterConfig
from helix_core.errors import ClusterError
from helix_core.loader import replies
from helix_core.loader.coordinator_calls import CoordinatorCalls
from helix_core.loader.fallback import KnownServers
from helix_core.memory.reader import SlabReader
from helix_core.security.auth import call_metadata, pickle_allowed
from helix_core.security.hostid import host_id
from helix_core.security.listeners import check_listener
from helix_core.security.tls import Tls
from helix_core.security.tokenfiles import load_token
from helix_core.tier2.errors import RoundStopped, RoundUnknown
from helix_core.wire.locallink.link import LocalLink, link_name
from helix_core.wire.messages import Route, slab_handle
from helix_core.wire.proto import helix_pb2 as pb
from helix_core.wire.proto import helix_pb2_grpc as pbg
from helix_core.wire.rpc import check_hello, connect

__all__ = ["ClusterClient", "TRANSIENT"]

#: Status codes that mean "this server (or the path to it) is gone": resubmit elsewhere.
#: (A full /dev/shm is not among them: it comes back as ``ErrorKind.NO_ROOM``, final.)
TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.FAILED_PRECONDITION,
}


log = logging.getLogger("helix.client")


class _Unavailable(grpc.RpcError):
    """A DataServer that fails its Hello: handled like any lost server (resubmit elsewhere)."""

    def __init__(self, address: str):
        super().__init__(f"DataServer {address} unavailable")
        self._address = address

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return f"DataServer {self._address} failed the protocol check"


class ClusterClient:
    """One rank's connection to a Helix cluster. Thread-safe."""

    def __init__(
        self,
        address: str,
        token: str | None,
        config: ClusterConfig,
        rank: int,
        world_size: int,
        local_rank: int | None = None,
        tls=None,
    ):
        """``token``: default ``HELIX_TOKEN``, else the one this user's Coordinator at ``address``
        left in the private Helix folder; ``tls``: a ``Tls`` for every channel (default:
        ``HELIX_TLS_*``, else none)."""
        token = load_token(token, coordinator=address)
        try:
            check_listener(address)  # a loopback port another user took: this user's token never goes there
        except ValueError as e:
            raise ClusterError(str(e)) from None
        self.address, self.token, self.config = address, token, config
        self.tls = Tls.from_env() if tls is None else tls
        self.rank, self.world_size = rank, world_size
        # its host's identity and its slot among that host's local servers (torchrun's LOCAL_RANK)
        self.host = host_id()
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else int(local_rank)
        self.metadata = call_metadata(token)
        self._lock = threading.Lock()
        self._fired: set = set()  # fire-and-forget calls still in flight (``close`` lets them land)
        self._landed_cond = threading.Condition(self._lock)
        self.coordinator = CoordinatorCalls(
            address, token, config, self.tls, rank, world_size, self.host, self.local_rank, fire=self._fire
        )
        self.cluster_id = self.coordinator.cluster_id
        # pickles only with a token, and only where it can't be read off the wire (loopback or TLS)
        self.pickle_allowed = self.coordinator.pickle_allowed and pickle_allowed(
            address.rsplit(":", 1)[0], token, self.tls, config.allow_pickle
        )
        self._stubs: dict[str, pbg.DataServerStub] = {}
        self._channels: list[grpc.Channel] = []  # to the DataServers
        self._configured: set[tuple[str, str]] = set()
        self._links: dict[str, LocalLink | None] = {}  # Execute to the DataServers of this host (None: gRPC)
        self.reader = SlabReader()

    # -- the Coordinator's side (``self.coordinator``), as the loader calls it

    @property
    def client_id(self) -> str:
        """This client's id (the Coordinator's, where an older one made it)."""
        return self.coordinator.client_id

    @property
    def task_id_base(self) -> int:
        return self.coordinator.task_id_base

    @property
    def servers(self) -> KnownServers:
        """The servers learnt from routes (``KnownServers``)."""
        return self.coordinator.servers

    def route(self, part, deadline_s: float | None = None, scheduler: str = "", stop=None) -> Route:
        """Where to run one ``Part`` (``CoordinatorCalls.route``)."""
        return self.coordinator.route(part, deadline_s, scheduler, stop)

    def completed(self, task_id: int) -> None:
        """A request's reply landed (or it failed or was given up): the next Route tells the Coordinator."""
        self.coordinator.completed(task_id)

    def flush_completions(self) -> None:
        """Tell the Coordinator now of the completions no Route has carried yet (fire and forget)."""
        self.coordinator.flush_completions()

    def telemetry(self, last_decisions: int = 0) -> dict:
        return self.coordinator.telemetry(last_decisions)

    def round_leader(self, rank: int, stop=None) -> str:
        """Tier 2: the address of the DataServer leading the rounds of the group whose lowest rank is ``rank``."""
        return self.coordinator.round_leader(rank, stop)

    # -- replies into batches (``replies.py``)

    def materialize(self, reply: pb.ExecuteReply, copy: bool, pad: bool = True, grow: list | None = None):
        """The batch of a successful reply (``replies.materialize``), read through this client's slab reader."""
        return replies.materialize(reply, self.reader, self.pickle_allowed, copy, pad, grow)

    def release(self, reply: pb.ExecuteReply) -> None:
        """Give a reply's slabs back unread (its request was cancelled)."""
        replies.release(reply, self.reader)

    @staticmethod
    def error_of(reply: pb.ExecuteReply) -> Exception | None:
        """The error a failed reply stands for; None for a successful one."""
        return replies.error_of(reply)

    # -- fire and forget: the Coordinator's reports, the DataServers' cancels

    def _fire(self, method, request) -> None:
        """Fire and forget (``close`` lets these land before it closes the channels)."""
        try:
            fut = method.future(request, timeout=self.config.rpc_timeout_s, metadata=self.metadata)
        except (grpc.RpcError, ValueError):  # ValueError: the channel is closed already
            return
        with self._lock:
            self._fired.add(fut)
        fut.add_done_callback(self._landed)

    def _landed(self, fut) -> None:
        with self._lock:
            self._fired.discard(fut)
            self._landed_cond.notify_all()

    # -- the DataServers

    def stub(self, address: str) -> pbg.DataServerStub:
        with self._lock:
            s = self._stubs.get(address)
        if s is None:  # a new connection starts with the protocol-version check
            ch = connect(address, self.config, self.tls)
            s = pbg.DataServerStub(ch)
            try:
                check_hello(s, "client", self.token, self.config.rpc_timeout_s, f"the DataServer at {address}")
            except ClusterError:
                ch.close()
                raise _Unavailable(address) from None
            with self._lock:
                self._channels.append(ch)
                self._stubs[address] = s
                if not pickle_allowed(address.rsplit(":", 1)[0], self.token, self.tls):
                    self.pickle_allowed = False  # a peer beyond loopback without TLS: no pickles from anyone
        return s

    def execute(self, address: str, spec: tuple[str, bytes, str], request: pb.ExecuteRequest):
        """Configure ``address`` with ``spec`` once, then start ``Execute`` — over the server's local
        link where it has one on this host, else gRPC; returns a future of the reply (its
        exception: a ``grpc.RpcError``)."""
        stub = self.stub(address)
        key = (address, spec[0])
        if key not in self._configured:
            stub.Configure(
                pb.ConfigureRequest(spec_id=spec[0], payload=spec[1], format=spec[2]),
                timeout=self.config.rpc_timeout_s,
                metadata=self.metadata,
            )
            with self._lock:
                self._configured.add(key)
        link = self._link(address)
        if link is not None:
            return link.execute(request)
        return stub.Execute.future(request, timeout=self.config.execute_timeout_s, metadata=self.metadata)

    def _link(self, address: str) -> LocalLink | None:
        """The local link to the DataServer at ``address``: connected once, again after it broke
        (the server restarted); None where there is none (another host, a sidecar, no token)."""
        if not self.config.local_link or not self.token:
            return None
        with self._lock:
            if address in self._links and not (self._links[address] is not None and self._links[address].broken):
                return self._links[address]
        link = LocalLink.connect(
            link_name(self.cluster_id, address), self.token, self.config.keepalive_s, self.config.keepalive_timeout_s
        )
        with self._lock:
            old, self._links[address] = self._links.get(address), link
        if old is not None:
            old.close()
        return link

    def forget(self, address: str) -> None:
        """A server failed: configure it again if it is ever used again (it may have restarted)."""
        with self._lock:
            self._configured = {k for k in self._configured if k[0] != address}
            if self._links.get(address, 1) is None:  # no link before: it may have one now (restarted)
                del self._links[address]

    def cancel(self, address: str, task_ids: list[int]) -> None:
        try:
            stub = self.stub(address)
        except grpc.RpcError:
            return
        self._fire(stub.Cancel, pb.CancelRequest(task_ids=task_ids, client_id=self.client_id))

    def rebalance(
        self,
        address: str,
        request: pb.RebalanceRequest,
        timeout_s: float,
        stop,
        leave_s: float,
        wanted=None,
        grace_s: float = 0.0,
    ):
        """Tier 2: this rank's batch into its round at ``address``; the reply, or None when the rank
        keeps its batch (the leader could not be reached, or the batch left its round). ``wanted``
        (a future) is done once the rank waits in ``next()`` for the batch: ``grace_s`` later, a
        round still open is asked to close now (``AskRound``). A call that does not answer (the
        loader stopped, or it failed) is cancelled and the leader says who owns the batch
        (``LeaveRound``, within ``leave_s``): still the rank's, or the round's answer, which a
        stopped loader gives back (``RoundStopped(reply)``). When the leader cannot say (it died),
        the Coordinator does (``_round_fate``)."""
        sent = time.monotonic()
        try:
            fut = self.stub(address).Rebalance.future(request, timeout=timeout_s, metadata=self.metadata)
        except _Unavailable as e:
            log.warning("Tier-2 round at %s: %s (rank %d keeps its batch)", address, e, self.rank)
            return None
        self._hold(address, request, fut, timeout_s + self.config.rpc_timeout_s, stop, wanted, grace_s)
        why = "the loader stopped" if stop.is_set() else f"no answer in {timeout_s:.0f} s"
        if fut.done() and not fut.cancelled():
            try:
                reply = fut.result(timeout=0)
            except grpc.RpcError as e:
                why = f"{e.code().name}: {e.details()}"
            else:
                if stop.is_set():
                    raise RoundStopped(reply)
                return reply
        fut.cancel()
        leave = pb.LeaveRoundRequest(
            group=request.group,
            run=request.run,
            step=request.step,
            rank=request.rank,
            client_id=request.client_id,
            timeout_s=leave_s,
        )
        try:
            answer = self.stub(address).LeaveRound(
                leave, timeout=leave_s + self.config.rpc_timeout_s, metadata=self.metadata
            )
        except (grpc.RpcError, _Unavailable) as e:  # the leader is gone: the Coordinator knows its rounds
            log.warning(
                "Tier-2 round at %s: %s, and no LeaveRound (%s)",
                address,
                why,
                e.code().name if isinstance(e, grpc.RpcError) else e,
            )
            answer = pb.LeaveRoundReply()
        reply = None if answer.left or not answer.HasField("reply") else answer.reply
        if not answer.HasField("reply") and not stop.is_set():  # the leader is gone, or never had the call
            self._round_fate(address, request, stop, sent, sure=not answer.left)  # (it restarted?)
        if stop.is_set():
            raise RoundStopped(reply)
        if reply is None:
            log.warning("Tier-2 round at %s: %s (rank %d keeps its batch)", address, why, self.rank)
        return reply

    def _round_fate(self, address: str, request: pb.RebalanceRequest, stop, sent: float, sure: bool) -> None:
        """Tier 2: the round at ``address`` cannot answer for the batch sent at ``sent``. Returns if
        the rank keeps it (never committed: a reader count set on its slabs is undone); else
        ``RoundUnknown``, with what the committed round gave the rank, or none if the Coordinator
        cannot say — where the leader never had the call (not ``sure``) one try, then it keeps."""
        ask = pb.RoundFateRequest(group=request.group, run=request.run, step=request.step, rank=request.rank)
        try:
            fate = self.coordinator.round_fate(ask, sent, stop, retry=sure)
        except (ClusterError, grpc.RpcError) as e:
            if sure:
                raise RoundUnknown(
                    f"neither its Tier-2 round's leader at {address} nor the Coordinator can say what "
                    f"became of it ({e})"
                ) from None
            return
        if fate.moved:
            raise RoundUnknown(
                f"its Tier-2 round's leader at {address} cannot answer; the round moved samples",
                list(fate.indices),
                [slab_handle(h) for h in fate.release],
            )
        for b in request.batches:  # no rank reads them now: the rank's own again
            try:
                self.reader.share(slab_handle(b.slab), 1)
            except OSError:
                pass  # gone with its server: the batch is resubmitted as any lost one

    def _hold(self, address: str, request, fut, limit_s: float, stop, wanted, grace_s: float) -> None:
        """Wait for the round's reply ``fut`` (``limit_s`` at most); once ``wanted`` is done and
        ``grace_s`` has passed with no reply, ask the leader to close the round now."""
        end = time.monotonic() + limit_s
        if wanted is None or stop.wait(fut, limit_s, or_=wanted) or stop.is_set() or fut.done():
            return
        if (
            wanted.done()
            and not stop.wait(fut, min(grace_s, end - time.monotonic()))
            and not stop.is_set()
            and not fut.done()
        ):
            ask = pb.AskRoundRequest(
                group=request.group, run=request.run, step=request.step, rank=request.rank, client_id=request.client_id
            )
            try:  # answered at once; the held call then answers once the round ran
                self.stub(address).AskRound(ask, timeout=self.config.rpc_timeout_s, metadata=self.metadata)
            except grpc.RpcError as e:  # the leader is gone: the held call fails too, and is settled as such
                log.debug("AskRound at %s: %s", address, e)
        stop.wait(fut, max(0.0, end - time.monotonic()))

    def close(self) -> None:
        self.coordinator.stop()  # no more lease renewals; the completions not reported yet go out
        with self._lock:  # reports and cancels in flight land first (a dead peer: not long)
            self._landed_cond.wait_for(lambda: not self._fired, min(2.0, self.config.rpc_timeout_s))
        self.coordinator.close()
        for ch in self._channels:
            ch.close()
        with self._lock:
            links, self._links = [k for k in self._links.values() if k is not None], {}
        for link in links:
            link.close()
        self.reader.close()
