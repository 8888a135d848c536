"""The sending side of the bulk path (``protocol.py``: the wire form): a sidecar's
``BulkSender``, which keeps a few connections per receiver and sends a batch over one."""

from __future__ import annotations

import socket
import ssl
import threading
import time

from helix_core.security.auth import is_loopback
from helix_core.security.listeners import check_socket
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
    BulkError,
    recv_bytes,
    seal_sender,
    send_all,
    tls_contexts,
)
from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["BulkSender"]

_SENDER_IDLE_S = 15.0  # seconds: sooner than receivers close idle ones, so a sender rarely sends on one just closed
_KEEP_PER_PEER = 4  # connections a sender keeps per receiver between batches (more are closed after use)


class BulkSender:
    """The sending side, in a sidecar: a few kept connections per receiver."""

    def __init__(self, token: str, config, tls=None):
        self.token, self.config, self.tls = token.encode(), config, tls
        self._ctx = tls_contexts(tls)[1] if tls is not None else None
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, host: str, port: int) -> socket.socket:
        """A new connection, token accepted. ``BulkError`` with ``connected`` False where the
        caller may fall back to gRPC: the connection ended before the receiver accepted the token
        (nothing listens there, its slots are full — a ``BUSY`` answer, a close or a reset —, it is
        closing, or the TLS certificates don't fit; no byte of a batch went); True where the peer
        took the connection and then fell silent (stopped: gRPC would wait too)."""
        deadline = self.config.keepalive_s + self.config.keepalive_timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=deadline)
        except (OSError, ValueError) as e:
            raise BulkError(f"cannot connect to the bulk port {host}:{port}: {e}", connected=False) from None
        if is_loopback(host):  # never this user's token to a port another user took: the socket that accepted us
            try:
                check_socket(sock)
            except ValueError as e:
                sock.close()
                raise BulkError(f"cannot connect to the bulk port {host}:{port}: {e}", connected=False) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ctx is not None:
                sock = self._ctx.wrap_socket(sock, server_hostname=self.tls.server_name or host)
            sock.sendall(MAGIC + U16.pack(len(self.token)) + self.token)
            try:
                status = recv_bytes(sock, 1)[0]
            except ConnectionError:  # closed before it answered: it is closing, or its slots are full
                status = BUSY
            if status == BUSY:
                sock.close()
                raise BulkError(f"the bulk port {host}:{port} takes no more connections", connected=False)
            if status != OK:
                (n,) = U16.unpack(recv_bytes(sock, 2))
                raise BulkError(
                    f"bulk port {host}:{port} refused us: {recv_bytes(sock, n).decode(errors='replace')}", REFUSED
                )
            if self._ctx is not None:
                sock = seal_sender(sock)  # the payload in large AES-GCM records (protocol.py)
        except TimeoutError as e:  # (before OSError, its base) silent: a stopped receiver
            sock.close()
            raise BulkError(
                f"the bulk port {host}:{port} took the connection and stopped answering: {type(e).__name__}: {e}"
            ) from None
        except OSError as e:  # ssl.SSLError among them: a reset, a close or a TLS failure before it took us
            sock.close()
            raise BulkError(
                f"the bulk port {host}:{port} did not take the connection: {type(e).__name__}: {e}", connected=False
            ) from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _expire(self, now: float) -> list:
        """(Under the lock.) Take out every kept connection idle past ``_SENDER_IDLE_S`` (to close):
        a receiver closes idle ones later, and must not find them holding its slots meanwhile."""
        stale = []
        for key in list(self._idle):
            pool = self._idle[key]
            fresh = [(s, since) for s, since in pool if now - since < _SENDER_IDLE_S]
            stale += [s for s, since in pool if now - since >= _SENDER_IDLE_S]
            if fresh:
                self._idle[key] = fresh
            else:
                del self._idle[key]
        return stale

    def _take(self, key) -> socket.socket | None:
        with self._lock:
            stale = self._expire(time.monotonic())
            pool = self._idle.get(key)
            sock = pool.pop()[0] if pool else None  # the most recently used: the others may expire
        for s in stale:
            s.close()
        return sock

    def send(self, host: str, port: int, header: pb.StreamHeader, payload: memoryview) -> pb.DeliverReply:
        """Send one batch (``header.total_bytes`` of ``payload``); the receiver's ``DeliverReply``.
        ``BulkError``: refused or failed (``status`` None: the connection; the batch did not arrive)."""
        key = (host, port)
        head = header.SerializeToString()
        if len(head) > MAX_HEADER:  # the receiver would refuse it: gRPC carries it (64 MiB messages)
            raise BulkError(
                f"a transfer header of {len(head)} bytes is over the bulk path's {MAX_HEADER}", connected=False
            )
        for attempt in (0, 1):  # a kept connection the receiver closed meanwhile: once more on a new one
            sock = self._take(key) if attempt == 0 else None
            fresh = sock is None
            if sock is None:
                sock = self._connect(host, port)
            until = time.monotonic() + self.config.execute_timeout_s  # progress: the socket's timeout per piece
            try:
                send_all(sock, U32.pack(len(head)) + head, until)
                send_all(sock, payload[: header.total_bytes], until)
                status, n = ANSWER.unpack(recv_bytes(sock, ANSWER.size))
                body = recv_bytes(sock, n)
            except (ConnectionError, TimeoutError, OSError, ssl.SSLError) as e:
                sock.close()
                # a kept connection the receiver closed (idle) breaks at once: once more on a new one; a
                # silent receiver (stopped) is not asked twice — that would double the time to notice it
                if fresh or isinstance(e, TimeoutError):
                    raise BulkError(f"bulk delivery to {host}:{port} failed: {type(e).__name__}: {e}") from None
                continue
            if status != OK:
                sock.close() if status == BAD else self._keep(key, sock)
                raise BulkError(f"{host}:{port}: {body.decode(errors='replace')}", status)
            self._keep(key, sock)
            return pb.DeliverReply.FromString(body)
        raise AssertionError("unreachable")

    def _keep(self, key, sock) -> None:
        now, stale = time.monotonic(), [sock]
        with self._lock:
            if not self._closed:  # (closed meanwhile: nobody would take it again)
                stale = self._expire(now)
                pool = self._idle.setdefault(key, [])
                if len(pool) < _KEEP_PER_PEER:
                    pool.append((sock, now))
                else:
                    stale.append(sock)  # a burst's extra connections: not held at the receiver for nothing
        for s in stale:
            s.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._idle = list(self._idle.values()), {}
        for pool in pools:
            for sock, _ in pool:
                sock.close()
