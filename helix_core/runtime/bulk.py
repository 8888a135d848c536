"""The bulk delivery path: a remote DataServer's batch straight into the delivering server's slab.

gRPC Python costs the receiving host ~1.2–1.5 ms of CPU per MB (HTTP/2 framing, one Python bytes
object per 4 MiB chunk, then a copy into the slab) — on a GPU host whose CPU is the scarce thing,
that is what sidecars were meant to relieve. Here a plain TCP connection (TLS with the cluster's
certificates when it has them) carries the same ``StreamHeader`` and then the payload, which the
receiver reads with ``recv_into`` directly into one of its slabs: no per-chunk object, no copy.

Wire form (little-endian). A connection opens with ``b"HXB1"``, the token's length (u16) and the
token; the receiver answers one status byte (0: accepted) and, if refused, a reason. Then any
number of transfers, one at a time: ``u32`` header length, the ``StreamHeader`` (protobuf), the
``total_bytes`` of payload; the answer is a status byte and ``u32`` length, then a ``DeliverReply``
(status 0) or the reason (UTF-8). Nothing is unpickled here: a header whose batch structure is
pickled is refused where the server takes no pickles, exactly as ``Deliver`` refuses it.

Every read and write of a transfer has a deadline (``keepalive_s + keepalive_timeout_s``): a
stopped or vanished peer fails the transfer in seconds, and the sender's caller treats it like a
lost delivery server (the client resubmits). The gRPC ``Deliver`` stays as the path for a peer
that offers no bulk port.
"""
from __future__ import annotations

import hmac
import os
import socket
import ssl
import struct
import tempfile
import threading
import time

from .auth import is_loopback
from .proto import helix_pb2 as pb
from .tokenfiles import check_listener

__all__ = ["BulkError", "BulkListener", "BulkSender", "OK", "NO_ROOM", "REFUSED", "BAD", "BUSY"]

MAGIC = b"HXB1"
OK, NO_ROOM, REFUSED, BAD, BUSY = 0, 1, 2, 3, 4  # BUSY: every connection slot taken (the sender uses gRPC)
_U16, _U32, _ANSWER = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<BI")
_MAX_HEADER = 64 << 20
_MAX_TOKEN = 1024
_CHUNK = 4 << 20  # sends go in pieces of this, each with the progress deadline
_IDLE_S = 120.0  # a receiver closes a connection idle this long; senders drop theirs sooner
_SENDER_IDLE_S = 60.0


class BulkError(Exception):
    """A transfer failed: ``status`` is ``NO_ROOM`` / ``REFUSED`` / ``BAD`` from the receiver, or
    None when the connection failed — ``connected`` False: it could not be made (the peer offers
    no bulk port there, or is gone); True: it broke or stalled mid-transfer."""

    def __init__(self, message: str, status: int | None = None, connected: bool = True):
        super().__init__(message)
        self.status, self.connected = status, connected


def _contexts(tls) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts from a ``Tls``: mutual, checked against the cluster's CA."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for ctx in (server, client):
        ctx.load_verify_locations(cadata=tls.ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
        if tls.cert is not None:  # load_cert_chain reads files only: a private folder, gone at once
            with tempfile.TemporaryDirectory(prefix="helix-tls-") as d:
                cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
                for path, data in ((cert, tls.cert), (key, tls.key)):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                ctx.load_cert_chain(cert, key)
    return server, client


def _recv_exact(sock, view: memoryview, until: float | None = None) -> None:
    """Fill ``view``; each ``recv`` has the socket's timeout (progress), and the whole read ends
    by ``until`` (``time.monotonic``), so a peer that trickles bytes cannot hold it for ever."""
    got = 0
    while got < len(view):
        if until is not None and time.monotonic() > until:
            raise TimeoutError(f"{got} of {len(view)} bytes within the transfer's deadline")
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


def _send_all(sock, data, until: float) -> None:
    """``sendall`` in pieces: a socket timeout bounds a whole ``sendall``, so a large batch on a
    slow link would fail although it progresses; here each piece has it, and all end by ``until``."""
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        if time.monotonic() > until:
            raise TimeoutError(f"{start} of {len(view)} bytes sent within the transfer's deadline")
        sock.sendall(view[start:start + _CHUNK])


def _recv(sock, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf))
    return bytes(buf)


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

    def _handshake(self, conn) -> bool:
        """Magic and token within one deadline (an unauthenticated peer holds a slot at most that long)."""
        until = time.monotonic() + self.config.keepalive_s + self.config.keepalive_timeout_s
        head = bytearray(6)
        _recv_exact(conn, memoryview(head), until)
        (n,) = _U16.unpack(head[4:])
        if head[:4] != MAGIC or n > _MAX_TOKEN:
            return False
        token = bytearray(n)
        _recv_exact(conn, memoryview(token), until)
        if not hmac.compare_digest(bytes(token), self.token):
            reason = b"wrong or missing token"
            conn.sendall(bytes((REFUSED,)) + _U16.pack(len(reason)) + reason)
            return False
        conn.sendall(bytes((OK,)))
        return True

    def _serve(self, raw: socket.socket) -> None:
        progress = self.config.keepalive_s + self.config.keepalive_timeout_s
        conn = raw
        try:
            conn = self._wrap(raw)  # a failed TLS handshake raises here
            if not self._handshake(conn):
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
                self._conns.discard(conn)
            try:
                conn.close()
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


class BulkSender:
    """The sending side, in a remote DataServer: a few kept connections per receiver."""

    def __init__(self, token: str, config, tls=None):
        self.token, self.config, self.tls = token.encode(), config, tls
        self._ctx = _contexts(tls)[1] if tls is not None else None
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, host: str, port: int) -> socket.socket:
        """A new connection, token accepted. ``BulkError`` with ``connected`` False where the
        caller may fall back to gRPC (nothing listens there, or the TLS certificates don't fit),
        True where the peer took the connection and then fell silent (stopped: gRPC would wait too)."""
        deadline = self.config.keepalive_s + self.config.keepalive_timeout_s
        try:
            if is_loopback(host):  # never this user's token to a port another user took meanwhile
                check_listener(f"{host}:{port}")
            sock = socket.create_connection((host, port), timeout=deadline)
        except (OSError, ValueError) as e:
            raise BulkError(f"cannot connect to the bulk port {host}:{port}: {e}", connected=False) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ctx is not None:
                sock = self._ctx.wrap_socket(sock, server_hostname=self.tls.server_name or host)
            sock.sendall(MAGIC + _U16.pack(len(self.token)) + self.token)
            try:
                status = _recv(sock, 1)[0]
            except ConnectionError:  # closed before it answered: it is closing, or its slots are full
                status = BUSY
            if status == BUSY:
                sock.close()
                raise BulkError(f"the bulk port {host}:{port} takes no more connections", connected=False)
            if status != OK:
                (n,) = _U16.unpack(_recv(sock, 2))
                raise BulkError(f"bulk port {host}:{port} refused us: {_recv(sock, n).decode(errors='replace')}",
                                REFUSED)
        except ssl.SSLError as e:  # (before OSError, its base) a certificate mismatch: gRPC's own TLS decides
            sock.close()
            raise BulkError(f"TLS with the bulk port {host}:{port} failed: {e}", connected=False) from None
        except (ConnectionError, TimeoutError, OSError) as e:
            sock.close()
            raise BulkError(f"the bulk port {host}:{port} took the connection and stopped answering: "
                            f"{type(e).__name__}: {e}") from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _take(self, key) -> socket.socket | None:
        now = time.monotonic()
        with self._lock:
            pool = self._idle.get(key, [])
            while pool:
                sock, since = pool.pop()
                if now - since < _SENDER_IDLE_S:
                    return sock
                sock.close()
        return None

    def send(self, host: str, port: int, header: pb.StreamHeader, payload: memoryview) -> pb.DeliverReply:
        """Send one batch (``header.total_bytes`` of ``payload``); the receiver's ``DeliverReply``.
        ``BulkError``: refused or failed (``status`` None: the connection; the batch did not arrive)."""
        key = (host, port)
        head = header.SerializeToString()
        for attempt in (0, 1):  # a kept connection the receiver closed meanwhile: once more on a new one
            sock = self._take(key) if attempt == 0 else None
            fresh = sock is None
            if sock is None:
                sock = self._connect(host, port)
            until = time.monotonic() + self.config.execute_timeout_s  # progress: the socket's timeout per piece
            try:
                _send_all(sock, _U32.pack(len(head)) + head, until)
                _send_all(sock, payload[:header.total_bytes], until)
                status, n = _ANSWER.unpack(_recv(sock, _ANSWER.size))
                body = _recv(sock, n)
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
        with self._lock:
            if not self._closed:
                self._idle.setdefault(key, []).append((sock, time.monotonic()))
                return
        sock.close()  # closed meanwhile: nobody would take it again

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._idle = list(self._idle.values()), {}
        for pool in pools:
            for sock, _ in pool:
                sock.close()
