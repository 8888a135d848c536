"""The local link: ``Execute`` between a rank and a DataServer of its own host, over a Unix socket.

A batch's request and its reply are small (the reply names a slab), yet a gRPC call costs each
side several times the CPU of the same exchange over a Unix socket (``helix bench --overhead``
measures both). A local DataServer therefore also listens on an abstract Unix socket named after
its cluster and address. Abstract names live in the network namespace, so only a process of the
same host (the same namespace) reaches it; the client checks that the listener runs as its own
user (``SO_PEERCRED``) before it sends the token, and the server takes only peers of its own user
that present the token.

The client sends ``REQUEST`` (an ``ExecuteRequest``); the server answers each with ``REPLY`` (an
``ExecuteReply``) or ``ERROR`` (what a gRPC call would have raised), in any order; the frames and
the handshake are ``protocol.py``. The Coordinator's link carries ``Route`` the same way, one call
at a time answered in order (``CallLink``; its server is ``server.serve_call_link``). Everything
else stays on gRPC (Configure, Cancel, Tier 2, heartbeats). The DataServer's end is
``server.LocalListener``; this module holds the clients' ends.

A link that breaks fails its calls in flight as UNAVAILABLE, which the request path resubmits; as
gRPC's keepalive does on a channel with calls in flight, a link with calls in flight sends ``PING``
after ``keepalive_s`` of silence, and a server that has not answered ``keepalive_timeout_s`` later
(SIGSTOPped, hung) breaks it.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
from concurrent.futures import Future

import grpc

from helix_core.wire.locallink.protocol import (
    ACCEPTED,
    ERROR,
    PING,
    REPLY,
    REQUEST,
    frame,
    hello,
    parse_error,
    peer_uid,
    recv_exact,
    recv_frame,
    shut,
)
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["CallLink", "LinkError", "LocalLink", "link_name"]

log = logging.getLogger("helix.link")


def link_name(cluster_id: str, address: str) -> str:
    """The abstract socket name of the DataServer at ``address`` of cluster ``cluster_id``."""
    return f"\0helix-link-{cluster_id}-{address}"


class LinkError(grpc.RpcError):
    """An Execute over the local link that failed as its gRPC call would have (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def _handshake(name: str, token: str):
    """A socket connected to the link ``name`` that took ``token``; None where there is none, or
    it is not this user's (then no token went there), or it refused the token."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5.0)
        sock.connect(name)
        if peer_uid(sock) != os.getuid():  # not this user's server: no token goes there
            sock.close()
            return None
        sock.sendall(hello(token.encode()))
        if recv_exact(sock, 1) != ACCEPTED:
            sock.close()
            return None
        sock.settimeout(None)
    except (OSError, EOFError):
        sock.close()
        return None
    return sock


class CallLink:
    """A client's link for one call at a time, answered in order (the Coordinator's ``Route``):
    the caller's thread sends and reads the answer itself, with no thread of the link's own. A
    call that fails or runs past its timeout breaks the link (a late answer would be read as the
    next call's) and raises as its gRPC call would have."""

    def __init__(self, sock):
        self._sock, self._lock, self.broken = sock, threading.Lock(), False

    @classmethod
    def connect(cls, name: str, token: str) -> CallLink | None:
        sock = _handshake(name, token)
        return None if sock is None else cls(sock)

    def call(self, request, reply_cls, timeout_s: float):
        body = request.SerializeToString()
        with self._lock:
            if self.broken:
                raise LinkError(grpc.StatusCode.UNAVAILABLE, "the local link is broken")
            try:
                self._sock.settimeout(timeout_s)
                self._sock.sendall(frame(REQUEST, body))
                kind, answer = recv_frame(self._sock)
            except (OSError, EOFError) as e:
                self.broken = True
                shut(self._sock)
                code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(e, TimeoutError) else grpc.StatusCode.UNAVAILABLE
                raise LinkError(code, f"the local link: {e or 'closed'}") from None
        if kind == REPLY:
            return reply_cls.FromString(answer)
        _task_id, code, details = parse_error(answer)
        raise LinkError(code, details)

    def close(self) -> None:
        with self._lock:
            self.broken = True
        shut(self._sock)


class LocalLink:
    """A client's end of one DataServer's link: ``execute(request) -> Future`` of the reply.
    ``connect`` returns None where there is no link to that server (another host, or none)."""

    def __init__(self, sock, keepalive_s: float, keepalive_timeout_s: float):
        self._sock, self.keepalive_s, self.keepalive_timeout_s = sock, keepalive_s, keepalive_timeout_s
        self._lock = threading.Lock()
        self._pending: dict[int, list[Future]] = {}
        self.broken = False
        threading.Thread(target=self._read, name="helix-link-reader", daemon=True).start()

    @classmethod
    def connect(
        cls, name: str, token: str, keepalive_s: float = 2.0, keepalive_timeout_s: float = 3.0
    ) -> LocalLink | None:
        sock = _handshake(name, token)
        return None if sock is None else cls(sock, keepalive_s, keepalive_timeout_s)

    def execute(self, request) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        body = request.SerializeToString()
        with self._lock:
            if not self.broken:
                self._pending.setdefault(request.task_id, []).append(fut)
                try:
                    self._sock.sendall(frame(REQUEST, body))
                    return fut
                except OSError:
                    pass
        error = LinkError(grpc.StatusCode.UNAVAILABLE, "the local link to the DataServer broke")
        self._fail(error)  # every call in flight on it, this one among them
        if not fut.done():  # (already broken: it was never registered)
            fut.set_exception(error)
        return fut

    def _read(self) -> None:
        why, ping_at = "closed", None
        try:
            while True:
                if not select.select([self._sock], [], [], self.keepalive_s)[0]:  # silence: is it alive?
                    with self._lock:
                        busy = bool(self._pending)
                    if not busy:
                        ping_at = None
                    elif ping_at is None:
                        ping_at = time.monotonic()
                        with self._lock:
                            self._sock.sendall(frame(PING))
                    elif time.monotonic() - ping_at > self.keepalive_timeout_s:
                        why = f"did not answer a keepalive ping in {self.keepalive_timeout_s:g} s"
                        break
                    continue
                kind, body = recv_frame(self._sock)
                ping_at = None  # anything it sends shows it is alive
                if kind == REPLY:
                    reply = pb.ExecuteReply.FromString(body)
                    fut = self._take(reply.task_id)
                    if fut is not None:
                        fut.set_result(reply)
                elif kind == ERROR:
                    task_id, code, details = parse_error(body)
                    fut = self._take(task_id)
                    if fut is not None:
                        fut.set_exception(LinkError(code, details))
        except (OSError, EOFError, ValueError, struct.error):
            pass
        self._fail(LinkError(grpc.StatusCode.UNAVAILABLE, f"the local link to the DataServer {why}"))
        shut(self._sock)

    def _take(self, task_id: int) -> Future | None:
        with self._lock:
            futs = self._pending.get(task_id)
            if not futs:
                return None
            fut = futs.pop(0)
            if not futs:
                del self._pending[task_id]
            return fut

    def _fail(self, error: LinkError) -> None:
        with self._lock:
            self.broken = True
            pending, self._pending = self._pending, {}
        for futs in pending.values():
            for f in futs:
                if not f.done():
                    f.set_exception(error)

    def close(self) -> None:
        shut(self._sock)
