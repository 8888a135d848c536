"""The receiving side of the bulk path (``protocol.py``: the wire form): a DataServer's
``BulkListener``, which reads each transfer's payload straight into the slab it names.

Who may hold a connection: a peer that has not yet presented the token holds one of
``max_pending`` places, for at most the handshake deadline (TLS handshake, magic, token), however
slowly it sends — the accept thread cuts it off then, so nobody without the token holds more than
those few places for more than that. A peer that presented the token takes one of
``max_connections`` slots; when all are taken, the longest-idle connection (between two transfers,
after its first) is closed for it, and only when every slot carries a transfer is the newcomer told
``BUSY``. A full listener is thus always "not connected" to the sender (``send.py``), never a lost
delivery, and a sender's kept connections never keep another sender out.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time

from helix_core.wire.bulk.protocol import (
    ANSWER,
    BAD,
    BUSY,
    MAGIC,
    MAX_HEADER,
    OK,
    REFUSED,
    U16,
    U32,
    recv_bytes,
    recv_exact,
    seal_receiver,
    send_all,
    tls_contexts,
)
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["BulkListener"]

_MAX_TOKEN = 1024  # bytes: a connection that announces a longer token is closed unread
_IDLE_S = 30.0  # seconds: a connection idle this long is closed (and idle ones are evicted sooner when full)

log = logging.getLogger("helix.bulk")


class _Conn:
    """One accepted connection, as the listener's threads share it (under the listener's lock)."""

    __slots__ = ("dropped", "fd", "idle_since", "pending_until", "slot")

    def __init__(self, fd: int, pending_until: float):
        self.fd = fd  # stays this connection's while it is registered: its thread closes it only after
        self.pending_until: float | None = pending_until  # handshake deadline (monotonic); None: authenticated
        self.idle_since: float | None = None  # waiting for its next transfer since (None: busy, or no transfer yet)
        self.slot = False  # holds one of the listener's connection slots
        self.dropped = False  # shut down by the listener (deadline, eviction, close)


def _shut_fd(fd: int) -> None:
    """Shut down the socket of ``fd`` from any thread: a thread blocked on it wakes at once."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.detach()  # the fd stays its thread's to close


class BulkListener:
    """The receiving side, in a DataServer: accepts connections on ``host`` (``port``: the free
    one it bound) from senders that present the token, and hands each transfer's header to
    ``receive`` (see ``_transfer``), which names the slab to read the payload into.
    ``handshake_s``: a new connection's deadline to present the token (seconds; default
    ``keepalive_s + keepalive_timeout_s``)."""

    def __init__(
        self,
        host: str,
        token: str,
        config,
        tls=None,
        receive=None,
        max_connections: int = 64,
        max_pending: int = 16,
        handshake_s: float | None = None,
    ):
        if not token:
            raise ValueError("a bulk listener needs the cluster's token")
        if max_connections < 1 or max_pending < 1:
            raise ValueError(
                f"BulkListener(max_connections={max_connections}, max_pending={max_pending}): each must be at least 1"
            )
        self.token, self.config, self.receive = token.encode(), config, receive
        self.max_connections, self.max_pending = max_connections, max_pending
        self._progress = config.keepalive_s + config.keepalive_timeout_s
        self.handshake_s = self._progress if handshake_s is None else handshake_s
        self._ctx = tls_contexts(tls)[0] if tls is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(max_connections + max_pending)
        self.port = self._sock.getsockname()[1]
        self._conns: set[_Conn] = set()  # every connection whose thread runs (its fd open)
        self._pending: dict[_Conn, None] = {}  # not yet authenticated, oldest (earliest deadline) first
        self._slots_taken = 0
        self._lock = threading.Lock()
        self._closed = False
        self.received_bytes = 0
        self.connections = 0  # connections that presented the token (a sender keeps its own for many transfers)
        self.turned_away = 0  # connections closed at once: every pending place taken, or every slot busy
        self._thread = threading.Thread(target=self._accept, name="helix-bulk-accept", daemon=True)
        self._thread.start()

    # ---- who holds a connection ------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                wait = self._reap(time.monotonic())
            try:
                self._sock.settimeout(wait)  # wake at the oldest pending connection's deadline
                raw, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            c = _Conn(raw.fileno(), time.monotonic() + self.handshake_s)
            with self._lock:
                admit = not self._closed and len(self._pending) < self.max_pending
                if admit:
                    self._pending[c] = None
                    self._conns.add(c)
            if not admit:
                self._turn_away(raw)
                continue
            threading.Thread(target=self._serve, args=(raw, c), name="helix-bulk-conn", daemon=True).start()

    def _reap(self, now: float) -> float | None:
        """(Under the lock.) Cut off pending connections past their handshake deadline; the
        seconds until the next one's (None: none pending)."""
        for c in list(self._pending):
            if c.pending_until > now:
                return c.pending_until - now
            log.debug("bulk: a connection did not present the token within %.1f s: closed", self.handshake_s)
            self._drop(c)
        return None

    def _drop(self, c: _Conn) -> None:
        """(Under the lock.) Shut ``c`` down; its thread ends and closes it."""
        c.dropped = True
        self._pending.pop(c, None)
        _shut_fd(c.fd)

    def _turn_away(self, raw: socket.socket) -> None:
        with self._lock:
            self.turned_away += 1
        try:
            if self._ctx is None:  # (with TLS a plain byte would not parse: the close says it)
                raw.setblocking(False)
                raw.send(bytes((BUSY,)))
        except OSError:
            pass
        raw.close()

    def _admit(self, c: _Conn) -> bool:
        """A connection presented the token: give it a slot — a free one, or the longest-idle
        connection's (which is closed). False: every slot carries a transfer (or ``c`` was cut off)."""
        with self._lock:
            self._pending.pop(c, None)
            if c.dropped or self._closed:
                return False
            c.pending_until = None
            if self._slots_taken < self.max_connections:
                self._slots_taken += 1
            else:
                idle = [o for o in self._conns if o.slot and o.idle_since is not None and not o.dropped]
                if not idle:
                    self.turned_away += 1
                    return False
                victim = min(idle, key=lambda o: o.idle_since)
                victim.slot = False  # its slot passes to c
                self._drop(victim)
                log.debug("bulk: every slot taken: the longest-idle connection was closed for a new one")
            c.slot = True
            self.connections += 1
            return True

    def _release(self, c: _Conn) -> None:
        with self._lock:
            self._pending.pop(c, None)
            self._conns.discard(c)
            if c.slot:
                c.slot = False
                self._slots_taken -= 1

    # ---- one connection ------------------------------------------------------------------------------------
    def _handshake(self, conn, c: _Conn):
        """Magic and token, after TLS (the accept thread cuts them off at ``c``'s deadline, however
        slowly bytes come); the connection to read transfers from (``Sealed`` with TLS), or None:
        refused, turned away or cut off."""
        until = c.pending_until
        head = bytearray(6)
        recv_exact(conn, memoryview(head), until)
        (n,) = U16.unpack(head[4:])
        if head[:4] != MAGIC or n > _MAX_TOKEN:
            return None
        token = bytearray(n)
        recv_exact(conn, memoryview(token), until)
        if not hmac.compare_digest(bytes(token), self.token):
            reason = b"wrong or missing token"
            conn.sendall(bytes((REFUSED,)) + U16.pack(len(reason)) + reason)
            return None
        if not self._admit(c):
            conn.sendall(bytes((BUSY,)))
            return None
        conn.sendall(bytes((OK,)))
        return seal_receiver(conn, until) if self._ctx is not None else conn

    def _next(self, conn, c: _Conn, first: bool) -> int | None:
        """Wait for the next transfer's header length; None: the connection ends (closed by the
        sender, idle past ``_IDLE_S``, evicted). A new connection's first transfer comes at once
        (its sender connected to send it) and it cannot be evicted before; afterwards, while it
        waits, it may."""
        with self._lock:
            if c.dropped or self._closed:
                return None
            if not first:
                c.idle_since = time.monotonic()
        conn.settimeout(self._progress if first else _IDLE_S)
        try:
            (hlen,) = U32.unpack(recv_bytes(conn, 4))
        except (ConnectionError, TimeoutError, OSError):
            return None
        with self._lock:
            if c.dropped:  # evicted as its sender began: the sender retries on a new connection
                return None
            c.idle_since = None
        return hlen

    def _serve(self, raw: socket.socket, c: _Conn) -> None:
        conn = raw
        try:
            raw.settimeout(self._progress)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ctx is not None:  # the TLS handshake in our hands: a failed one leaves the fd open until our close
                conn = self._ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                conn.do_handshake()
            stream = self._handshake(conn, c)
            if stream is None:
                return
            first = True
            while (hlen := self._next(stream, c, first)) is not None:
                first = False
                stream.settimeout(self._progress)
                now = time.monotonic()
                until = now + self.config.execute_timeout_s
                if hlen > MAX_HEADER:  # a sender of this version never does: a peer to stop reading
                    reason = f"a transfer header of {hlen} bytes (at most {MAX_HEADER})".encode()
                    send_all(stream, ANSWER.pack(BAD, len(reason)) + reason, until)
                    return
                buf = bytearray(hlen)
                recv_exact(stream, memoryview(buf), min(until, now + self._progress))  # small: it comes at once
                header = pb.StreamHeader.FromString(buf)
                status, body, abort = self._transfer(stream, header, until)
                stream.settimeout(self._progress)
                try:
                    send_all(stream, ANSWER.pack(status, len(body)) + body, until)
                except BaseException:
                    abort()  # the sender never learns of the slab: it resubmits, nobody would release it
                    raise
                if status == BAD:
                    return  # the stream's position is unknown: start over on a new connection
        except Exception as e:  # noqa: BLE001 - a stopped or vanished sender, a bad header: its transfer fails on its side
            log.debug("bulk: a connection ended: %s: %s", type(e).__name__, e)
            return
        finally:
            self._release(c)  # before the close: the fd is never shut down once it may be another's
            conn.close()  # (a Sealed connection's socket: the same one, unwrapped)

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
            recv_exact(conn, view[: header.total_bytes], until)
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
            k = min(n, len(buf))
            recv_exact(conn, buf[:k], until)
            n -= k

    def close(self) -> None:
        with self._lock:
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept() (close alone does not)
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        self._sock.close()
        with self._lock:
            for c in list(self._conns):
                self._drop(c)
