"""The local link: ``Execute`` between a rank and a DataServer of its own host, over a Unix socket.

A batch's request and its reply are small (the reply names a slab), yet a gRPC call costs this
machine 0.5-0.9 ms of CPU on each side; the same exchange over a Unix socket costs 0.1-0.2 ms
(``helix bench --overhead``'s yardstick, and the note of issue 12). A local DataServer therefore
also listens on an abstract Unix socket named after its cluster and address. Abstract names live in
the network namespace, so only a process of the same host (the same namespace) reaches it; the
client checks that the listener runs as its own user (``SO_PEERCRED``) before it sends the token,
and the server takes only peers of its own user that present the token.

Wire (both ways, after the handshake): frames ``u32 length | u8 kind | body``. The client sends
``REQUEST`` (an ``ExecuteRequest``); the server answers each with ``REPLY`` (an ``ExecuteReply``) or
``ERROR`` (``u64 task_id | u8 status code | details``, what a gRPC call would have raised), in any
order. The Coordinator's link carries ``Route`` the same way, one call at a time answered in order
(``CallLink``; its server is ``linkserver.serve_call_link``). Everything else stays on gRPC
(Configure, Cancel, Tier 2, heartbeats). The DataServer's end is ``linkserver.LocalListener``; this
module holds the wire and the clients' ends.
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

from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["CallLink", "LinkError", "LocalLink", "link_name"]

log = logging.getLogger("helix.link")

MAGIC = b"HXL1"
REQUEST, REPLY, ERROR, PING, PONG = 1, 2, 3, 4, 5
_FRAME = struct.Struct("<IB")
_ERROR = struct.Struct("<QB")
_MAX_FRAME = 64 << 20
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_PEERCRED = struct.Struct("3i")


def link_name(cluster_id: str, address: str) -> str:
    """The abstract socket name of the DataServer at ``address`` of cluster ``cluster_id``."""
    return f"\0helix-link-{cluster_id}-{address}"


def _peer_uid(sock) -> int:
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]


def _recv_exact(sock, n: int, until: float | None = None) -> bytes:
    """``n`` bytes; with ``until`` (``time.monotonic``), all of them by then however slowly they
    come (``TimeoutError``), else each read within the socket's timeout."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if until is not None:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes within the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("link closed")
        got += k
    return bytes(buf)


def _recv_frame(sock) -> tuple[int, bytes]:
    n, kind = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if n > _MAX_FRAME:
        raise EOFError(f"frame of {n} bytes")
    return kind, _recv_exact(sock, n)


def _shut(sock) -> None:
    """Close ``sock`` so that a thread blocked on it wakes (a plain close leaves it blocked, and sends nothing)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


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
        if _peer_uid(sock) != os.getuid():  # not this user's server: no token goes there
            sock.close()
            return None
        t = token.encode()
        sock.sendall(MAGIC + struct.pack("<H", len(t)) + t)
        if _recv_exact(sock, 1) != b"\0":
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
                self._sock.sendall(_FRAME.pack(len(body), REQUEST) + body)
                kind, answer = _recv_frame(self._sock)
            except (OSError, EOFError) as e:
                self.broken = True
                _shut(self._sock)
                code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(e, TimeoutError) else grpc.StatusCode.UNAVAILABLE
                raise LinkError(code, f"the local link: {e or 'closed'}") from None
        if kind == REPLY:
            return reply_cls.FromString(answer)
        task_id, code = _ERROR.unpack_from(answer)
        raise LinkError(_CODES.get(code, grpc.StatusCode.UNKNOWN), answer[_ERROR.size :].decode(errors="replace"))

    def close(self) -> None:
        with self._lock:
            self.broken = True
        _shut(self._sock)


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
                    self._sock.sendall(_FRAME.pack(len(body), REQUEST) + body)
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
                            self._sock.sendall(_FRAME.pack(0, PING))
                    elif time.monotonic() - ping_at > self.keepalive_timeout_s:
                        why = f"did not answer a keepalive ping in {self.keepalive_timeout_s:g} s"
                        break
                    continue
                kind, body = _recv_frame(self._sock)
                ping_at = None  # anything it sends shows it is alive
                if kind == REPLY:
                    reply = pb.ExecuteReply.FromString(body)
                    fut = self._take(reply.task_id)
                    if fut is not None:
                        fut.set_result(reply)
                elif kind == ERROR:
                    task_id, code = _ERROR.unpack_from(body)
                    fut = self._take(task_id)
                    if fut is not None:
                        fut.set_exception(
                            LinkError(
                                _CODES.get(code, grpc.StatusCode.UNKNOWN), body[_ERROR.size :].decode(errors="replace")
                            )
                        )
        except (OSError, EOFError, ValueError, struct.error):
            pass
        self._fail(LinkError(grpc.StatusCode.UNAVAILABLE, f"the local link to the DataServer {why}"))
        _shut(self._sock)

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
        _shut(self._sock)
