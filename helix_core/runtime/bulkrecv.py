"""The receiving side of the bulk path (``bulk.py``: the wire form): a DataServer's
``BulkListener``, which reads each transfer's payload straight into the slab it names."""
from __future__ import annotations

import hmac
import socket
import threading
import time

from .bulk import (_ANSWER, _IDLE_S, _MAX_HEADER, _MAX_TOKEN, _U16, _U32, BAD, BUSY, MAGIC, OK, REFUSED, _contexts,
                   _recv, _recv_exact, _send_all, seal_receiver)
from .proto import helix_pb2 as pb

__all__ = ["BulkListener"]


class BulkListener:
    """The receiving side, in a DataServer: accepts connections on ``host`` (``port``: the free
    one it bound) from senders that present the token, and hands each transfer's header to
    ``receive`` (see ``_transfer``), which names the slab to read the payload into."""

    def __init__(self, host: str, token: str, config, tls=None, receive=None, max_connections: int = 64):
        if not token:
            raise ValueError("a bulk listener needs the cluster's token")
        self.token, self.config, self.receive = token.encode(), config, receive
        self._ctx = _contexts(tls)[0] if tls is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(max_connections)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(max_connections)
        self._conns: set = set()
        self._lock = threading.Lock()
        self._closed = False
        self.received_bytes = 0
        self.connections = 0  # connections accepted (a sender keeps its own for many transfers)
        self._thread = threading.Thread(target=self._accept, name="helix-bulk-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if self._closed:
                conn.close()
                return
            if not self._slots.acquire(blocking=False):  # every slot taken: say so, the sender uses gRPC
                try:
                    conn.setblocking(False)
                    conn.send(bytes((BUSY,))) if self._ctx is None else None  # (with TLS: the handshake fails)
                except OSError:
                    pass
                conn.close()
                continue
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), name="helix-bulk-conn", daemon=True).start()

    def _wrap(self, raw: socket.socket):
        raw.settimeout(self.config.keepalive_s + self.config.keepalive_timeout_s)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = self._ctx.wrap_socket(raw, server_side=True) if self._ctx is not None else raw
        with self._lock:
            self._conns.add(conn)
        return conn

    def _handshake(self, conn):
        """Magic and token within one deadline (an unauthenticated peer holds a slot at most that
        long); the connection to read transfers from (``Sealed`` with TLS), or None: refused."""
        until = time.monotonic() + self.config.keepalive_s + self.config.keepalive_timeout_s
        head = bytearray(6)
        _recv_exact(conn, memoryview(head), until)
        (n,) = _U16.unpack(head[4:])
        if head[:4] != MAGIC or n > _MAX_TOKEN:
            return None
        token = bytearray(n)
        _recv_exact(conn, memoryview(token), until)
        if not hmac.compare_digest(bytes(token), self.token):
            reason = b"wrong or missing token"
            conn.sendall(bytes((REFUSED,)) + _U16.pack(len(reason)) + reason)
            return None
        conn.sendall(bytes((OK,)))
        return seal_receiver(conn, until) if self._ctx is not None else conn

    def _serve(self, raw: socket.socket) -> None:
        progress = self.config.keepalive_s + self.config.keepalive_timeout_s
        wrapped = raw
        try:
            wrapped = self._wrap(raw)  # a failed TLS handshake raises here
            conn = self._handshake(wrapped)
            if conn is None:
                return
            while not self._closed:
                conn.settimeout(_IDLE_S)
                try:
                    (hlen,) = _U32.unpack(_recv(conn, 4))
                except (ConnectionError, TimeoutError, OSError):
                    return  # closed by the sender, or idle
                conn.settimeout(progress)
                until = time.monotonic() + self.config.execute_timeout_s
                if hlen > _MAX_HEADER:
                    return
                header = pb.StreamHeader.FromString(_recv(conn, hlen))
                status, body, abort = self._transfer(conn, header, until)
                try:
                    _send_all(conn, _ANSWER.pack(status, len(body)) + body, until)
                except BaseException:
                    abort()  # the sender never learns of the slab: it resubmits, nobody would release it
                    raise
                if status == BAD:
                    return  # the stream's position is unknown: start over on a new connection
        except Exception:  # a stopped or vanished sender, a bad header: its transfer fails on its side
            return
        finally:
            with self._lock:
                self._conns.discard(wrapped)
            try:
                wrapped.close()  # (a Sealed connection's socket: the same one, unwrapped)
            finally:
                self._slots.release()

    def _transfer(self, conn, header, until: float):
        """One transfer: ``receive(header) -> (status, reason, view, done, abort)``. Accepted
        (``OK``): the payload is read into ``view``, then ``done()`` is the reply's bytes (an error
        on the way calls ``abort()``, which frees the slab). Refused: the payload is read and
        dropped. Returns ``(status, answer body, abort)``."""
        status, reason, view, done, abort = self.receive(header)
        if status != OK:  # refused before any payload: drain it, or the connection's framing is lost
            self._drain(conn, header.total_bytes, until)
            return status, reason.encode(), lambda: None
        try:
            _recv_exact(conn, view[:header.total_bytes], until)
            body = done()
        except BaseException:
            abort()
            raise
        with self._lock:
            self.received_bytes += header.total_bytes
        return OK, body, abort

    @staticmethod
    def _drain(conn, n: int, until: float) -> None:
        buf = memoryview(bytearray(min(n, 1 << 20) or 1))
        while n > 0:
            if time.monotonic() > until:
                raise TimeoutError("a refused payload was not drained within the transfer's deadline")
            k = conn.recv_into(buf[:min(n, len(buf))])
            if k == 0:
                raise ConnectionError("peer closed the connection")
            n -= k

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept() (close alone does not)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5.0)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
