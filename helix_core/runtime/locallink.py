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
order. Everything else stays on gRPC (Configure, Cancel, Tier 2): the link carries only Execute.
A link that breaks fails its calls in flight as UNAVAILABLE, which the request path resubmits; as
gRPC's keepalive does on a channel with calls in flight, a link with calls in flight sends ``PING``
after ``keepalive_s`` of silence, and a server that has not answered ``keepalive_timeout_s`` later
(SIGSTOPped, hung) breaks it.
"""
from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from .proto import helix_pb2 as pb

__all__ = ["LinkError", "LocalLink", "LocalListener", "link_name"]

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


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
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


class _Abort(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What ``DataServerServicer.Execute`` asks of its gRPC context, for one request on a link."""

    def __init__(self, conn: "_Conn", timeout_s: float):
        self._conn, self._end = conn, time.monotonic() + timeout_s
        self.callbacks: list = []

    def abort(self, code, details):
        raise _Abort(code, details)

    def time_remaining(self):
        return max(0.0, self._end - time.monotonic())

    def is_active(self) -> bool:
        return not self._conn.closed

    def add_callback(self, fn) -> None:
        """``fn`` runs if the link closes while this request runs (as gRPC runs it when a call ends)."""
        if not self._conn.watch(self):
            fn()
            return
        self.callbacks.append(fn)


class _Conn:
    """One client's connection at the listener: requests in, replies out (under a lock); the
    requests running, whose callbacks run if it closes."""

    def __init__(self, sock):
        self.sock, self.closed = sock, False
        self._lock = threading.Lock()
        self._running: set[_Context] = set()

    def watch(self, context: _Context) -> bool:
        with self._lock:
            if not self.closed:
                self._running.add(context)
            return not self.closed

    def done(self, context: _Context) -> None:
        with self._lock:
            self._running.discard(context)

    def send(self, kind: int, body: bytes) -> bool:
        with self._lock:
            if self.closed:
                return False
            try:
                self.sock.sendall(_FRAME.pack(len(body), kind) + body)
                return True
            except OSError:
                return False

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            running, self._running = list(self._running), set()
        _shut(self.sock)
        for context in running:  # the requests still running are cancelled, as a gRPC call's would be
            for fn in context.callbacks:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - one callback's failure must not skip the others
                    log.warning("local link: a close callback failed: %s", e)


class LocalListener:
    """A local DataServer's end: serves ``execute(request, context)`` (the servicer's ``Execute``)
    to the rank processes of its host on ``link_name(cluster_id, address)``."""

    def __init__(self, name: str, token: str, execute, timeout_s: float, threads: int, unsent=lambda reply: None):
        """``unsent(reply)``: a reply whose link closed before it went (its slabs are nobody's)."""
        self.name, self.token, self.execute, self.timeout_s = name, token.encode(), execute, timeout_s
        self.unsent = unsent
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(name)
        self._sock.listen(64)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="helix-link")
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="helix-link-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock,), name="helix-link-conn", daemon=True).start()

    def _serve(self, sock) -> None:
        conn = _Conn(sock)
        try:
            sock.settimeout(5.0)  # the handshake only
            if _peer_uid(sock) != os.getuid() or _recv_exact(sock, 4) != MAGIC:
                return
            n, = struct.unpack("<H", _recv_exact(sock, 2))
            if not hmac.compare_digest(_recv_exact(sock, n), self.token):
                sock.sendall(b"\1")
                return
            sock.sendall(b"\0")
            sock.settimeout(None)
            with self._lock:
                if self._closed:
                    return
                self._conns.add(conn)
            while True:
                kind, body = _recv_frame(sock)
                if kind == PING:
                    conn.send(PONG, b"")
                elif kind == REQUEST:
                    self._pool.submit(self._run, conn, pb.ExecuteRequest.FromString(body))
                else:
                    return
        except Exception as e:  # noqa: BLE001 - a peer gone or bad input ends its connection, never the server
            log.debug("local link: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _run(self, conn: _Conn, request) -> None:
        context = _Context(conn, self.timeout_s)
        try:
            reply = self.execute(request, context)
        except _Abort as e:
            conn.send(ERROR, _ERROR.pack(request.task_id, e.code.value[0]) + str(e.details).encode())
            return
        except Exception as e:  # noqa: BLE001 - as gRPC would: the call fails, the server goes on
            log.exception("local link: Execute of task %d failed", request.task_id)
            conn.send(ERROR, _ERROR.pack(request.task_id, grpc.StatusCode.UNKNOWN.value[0]) + repr(e).encode())
            return
        finally:
            conn.done(context)
        if not conn.send(REPLY, reply.SerializeToString()):
            self.unsent(reply)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        _shut(self._sock)
        for c in conns:
            c.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


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
    def connect(cls, name: str, token: str, keepalive_s: float = 2.0,
                keepalive_timeout_s: float = 3.0) -> "LocalLink | None":
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
        return cls(sock, keepalive_s, keepalive_timeout_s)

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
        self._fail(LinkError(grpc.StatusCode.UNAVAILABLE, "the local link to the DataServer broke"))
        if not fut.done():
            fut.set_exception(LinkError(grpc.StatusCode.UNAVAILABLE, "the local link to the DataServer broke"))
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
                        fut.set_exception(LinkError(_CODES.get(code, grpc.StatusCode.UNKNOWN),
                                                    body[_ERROR.size:].decode(errors="replace")))
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
