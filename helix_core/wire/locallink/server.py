"""The local link's server ends (``link.py``: the clients' ends; ``protocol.py``: the wire): a local
DataServer's ``LocalListener``, which serves the servicer's ``Execute`` to the rank processes of
its host, each request with a context that answers what a gRPC context would; and the
Coordinator's ``serve_call_link``, which serves ``Route`` on its event loop."""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from helix_core.wire.locallink.protocol import (
    ACCEPTED,
    ERROR,
    FRAME,
    MAGIC,
    MAX_FRAME,
    PING,
    PONG,
    REFUSED,
    REPLY,
    REQUEST,
    TOKEN_LENGTH,
    error_body,
    frame,
    peer_uid,
    recv_exact,
    recv_frame,
    shut,
)
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["LocalListener", "serve_call_link"]

log = logging.getLogger("helix.link")


class _Abort(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What ``DataServerServicer.Execute`` asks of its gRPC context, for one request on a link."""

    def __init__(self, conn: _Conn, timeout_s: float):
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
                self.sock.sendall(frame(kind, body))
                return True
            except OSError:
                return False

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            running, self._running = list(self._running), set()
        shut(self.sock)
        for context in running:  # the requests still running are cancelled, as a gRPC call's would be
            for fn in context.callbacks:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - one callback's failure must not skip the others
                    log.warning("local link: a close callback failed: %s", e)


class LocalListener:
    """A local DataServer's end: serves ``execute(request, context)`` (the servicer's ``Execute``)
    to the rank processes of its host on ``link_name(cluster_id, address)``.

    A connection is taken only from a process of this user (``SO_PEERCRED``, asked in the accept
    thread before anything else: another user's connection is closed and starts no thread), and
    must present the token within ``handshake_s`` seconds, however slowly its bytes come."""

    def __init__(
        self,
        name: str,
        token: str,
        execute,
        timeout_s: float,
        threads: int,
        unsent=lambda reply: None,
        handshake_s: float = 5.0,
    ):
        """``unsent(reply)``: a reply whose link closed before it went (its slabs are nobody's)."""
        self.name, self.token, self.execute, self.timeout_s = name, token.encode(), execute, timeout_s
        self.unsent, self.handshake_s = unsent, handshake_s
        self.refused = 0  # connections of another user, closed at accept
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
            try:
                uid = peer_uid(sock)
            except OSError:
                uid = None
            if uid != os.getuid():  # another user's process: nothing read, no thread
                self.refused += 1
                (log.warning if self.refused == 1 else log.debug)(  # (a flood of them writes one line)
                    "local link %r: a connection of uid %s refused (not this user's)", self.name[1:], uid
                )
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock,), name="helix-link-conn", daemon=True).start()

    def _serve(self, sock) -> None:
        conn = _Conn(sock)
        try:
            until = time.monotonic() + self.handshake_s  # the whole handshake, however slowly it comes
            if recv_exact(sock, len(MAGIC), until) != MAGIC:
                return
            (n,) = TOKEN_LENGTH.unpack(recv_exact(sock, TOKEN_LENGTH.size, until))
            if not hmac.compare_digest(recv_exact(sock, n, until), self.token):
                sock.settimeout(self.handshake_s)
                sock.sendall(REFUSED)
                return
            sock.settimeout(self.handshake_s)
            sock.sendall(ACCEPTED)
            sock.settimeout(None)
            with self._lock:
                if self._closed:
                    return
                self._conns.add(conn)
            while True:
                kind, body = recv_frame(sock)
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
            conn.send(ERROR, error_body(request.task_id, e.code, str(e.details)))
            return
        except Exception as e:  # noqa: BLE001 - as gRPC would: the call fails, the server goes on
            log.exception("local link: Execute of task %d failed", request.task_id)
            conn.send(ERROR, error_body(request.task_id, grpc.StatusCode.UNKNOWN, repr(e)))
            return
        finally:
            conn.done(context)
        if not conn.send(REPLY, reply.SerializeToString()):
            self.unsent(reply)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        shut(self._sock)
        for c in conns:
            c.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _AioContext:
    """What the Coordinator's ``Route`` asks of its grpc.aio context, on a link."""

    async def abort(self, code, details):
        raise _Abort(code, details)


async def serve_call_link(name: str, token: str, handle, request_cls, handshake_s: float = 5.0):
    """The Coordinator's end of a link (``link.CallLink``), on its event loop:
    ``await handle(request, context)`` for each request, answered in order. Returns the
    ``asyncio.Server`` (``close()`` it). As ``LocalListener``: only this user's processes, and
    the token within ``handshake_s`` seconds."""
    import asyncio

    expected = token.encode()

    async def handshake(reader, writer) -> bool:
        if await reader.readexactly(len(MAGIC)) != MAGIC:
            return False
        (n,) = TOKEN_LENGTH.unpack(await reader.readexactly(TOKEN_LENGTH.size))
        if not hmac.compare_digest(await reader.readexactly(n), expected):
            writer.write(REFUSED)
            return False
        return True

    async def serve(reader, writer):
        try:
            if peer_uid(writer.get_extra_info("socket")) != os.getuid():
                return  # another user's process: nothing read
            if not await asyncio.wait_for(handshake(reader, writer), handshake_s):  # TimeoutError past it
                return
            writer.write(ACCEPTED)
            while True:
                n, kind = FRAME.unpack(await reader.readexactly(FRAME.size))
                if kind != REQUEST or n > MAX_FRAME:
                    return
                request = request_cls.FromString(await reader.readexactly(n))
                try:
                    body, kind = (await handle(request, _AioContext())).SerializeToString(), REPLY
                except _Abort as e:
                    body, kind = error_body(0, e.code, str(e.details)), ERROR
                writer.write(frame(kind, body))
        except asyncio.CancelledError:  # the Coordinator stops: Python 3.11's StreamReaderProtocol would log a
            pass  # cancelled handler as an error (a traceback at the training script's exit)
        except Exception as e:  # noqa: BLE001 - a peer gone or bad input ends its connection, never the server
            log.debug("local link: %s", e)
        finally:
            writer.close()

    return await asyncio.start_unix_server(serve, path=name)
