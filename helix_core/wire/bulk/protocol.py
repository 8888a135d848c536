"""The bulk delivery path: a sidecar's batch straight into the delivery server's slab.

gRPC Python costs the receiving host CPU for every MB (HTTP/2 framing, one Python bytes object per
4 MiB chunk, then a copy into the slab) — on a GPU host whose CPU is the scarce thing, that is what
sidecars were meant to relieve. Here a plain TCP connection (TLS with the cluster's
certificates when it has them) carries the same ``StreamHeader`` and then the payload, which the
receiver reads with ``recv_into`` directly into one of its slabs: no per-chunk object, no copy.

Wire form (little-endian). A connection opens with ``MAGIC``, the token's length (u16) and the token; the
receiver answers one status byte (``OK``; ``BUSY``: every connection slot carries a transfer) and, if
refused, a reason. Then any number of transfers, one at a time: ``u32`` header length, the
``StreamHeader`` (protobuf), the ``total_bytes`` of payload; the answer is a status byte and ``u32``
length, then a ``DeliverReply`` (status 0) or the reason (UTF-8). Nothing is unpickled here: a
header whose batch structure is pickled is refused where the server takes no pickles, exactly as
``Deliver`` refuses it.

Every read and write of a transfer has a deadline (``keepalive_s + keepalive_timeout_s``): a
stopped or vanished peer fails the transfer in seconds, and the sender's caller treats it like a
lost delivery server (the client resubmits). A transfer's header (at most ``MAX_HEADER`` bytes;
a larger one goes by gRPC) must arrive within that deadline too, and its payload within
``execute_timeout_s``, however slowly the bytes trickle. The gRPC ``Deliver`` stays as the path
for a peer that offers no bulk port.

Slots (``recv.py``): a connection that has not yet presented the token (TLS handshake, magic,
token) holds one of a few pending places, for at most the handshake deadline; only then does it
take one of the listener's connection slots, evicting the longest-idle connection when all are
taken. A listener that cannot take a connection says so (``BUSY``) or closes it before accepting
the token, and the sender reads any end of a connection before that point — a busy answer, a
close, a reset, a failed TLS handshake — as "not connected": the batch goes by gRPC, never as a
lost delivery. Only a peer that falls silent (a timeout) is "connected and stopped".

With TLS, the handshake (certificates, then the token) runs on TLS, and the sender then hands
the receiver two fresh AES-128-GCM keys (one per direction) inside it; both sides close the TLS
session (``unwrap``) and the rest of the connection travels as ``Sealed`` records of up to 1 MiB:
``u32`` length (the record's associated data), ciphertext and tag, with a per-direction counter as
nonce, so a record altered, dropped, replayed or reordered fails its tag and the connection. It
is TLS's record layer with records 64 times larger: Python's ``ssl`` reads one 16 KiB record per
call, which costs the receiving GPU host more CPU per GiB than ``cryptography``'s ``decrypt_into``
straight into the slab.

This module holds the wire form both sides speak (constants, ``BulkError``, TLS contexts, reads and
writes with deadlines, sealed records); ``recv.py`` is the receiving side (``BulkListener``),
``send.py`` the sending side (``BulkSender``).
"""

from __future__ import annotations

import os
import secrets
import ssl
import struct
import tempfile
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "ANSWER",
    "BAD",
    "BUSY",
    "MAGIC",
    "MAX_HEADER",
    "NO_ROOM",
    "OK",
    "REFUSED",
    "U16",
    "U32",
    "BulkError",
    "Sealed",
    "recv_bytes",
    "recv_exact",
    "seal_receiver",
    "seal_sender",
    "send_all",
    "tls_contexts",
]

MAGIC = b"HXB2"  # 2: sealed records after the TLS handshake; a receiver of 1 refuses it (the sender uses gRPC)
OK, NO_ROOM, REFUSED, BAD, BUSY = 0, 1, 2, 3, 4  # BUSY: every connection slot taken (the sender uses gRPC)
U16, U32 = struct.Struct("<H"), struct.Struct("<I")
ANSWER = struct.Struct("<BI")  # a transfer's answer: status, then the length of what follows
MAX_HEADER = 4 << 20  # a StreamHeader's bytes (inline tensors are < 4 KiB each): larger ones go by gRPC
_CHUNK = 4 << 20  # sends go in pieces of this, each with the progress deadline
_RECORD = 1 << 20  # a Sealed record's most plaintext bytes
_TAG = 16


class BulkError(Exception):
    """A transfer failed: ``status`` is ``NO_ROOM`` / ``REFUSED`` / ``BAD`` from the receiver, or
    None when the connection failed — ``connected`` False: it could not be made (the peer offers
    no bulk port there, or is gone); True: it broke or stalled mid-transfer."""

    def __init__(self, message: str, status: int | None = None, connected: bool = True):
        super().__init__(message)
        self.status, self.connected = status, connected


def tls_contexts(tls) -> tuple[ssl.SSLContext, ssl.SSLContext]:
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


def recv_exact(sock, view: memoryview, until: float | None = None) -> None:
    """Fill ``view``; each ``recv`` has the socket's timeout (progress), and the whole read ends
    by ``until`` (``time.monotonic``): the last ``recv`` waits no longer than what is left, so a
    peer that trickles bytes cannot hold it past the deadline. (The socket's timeout may be left
    lowered: callers set it afresh for each phase.)"""
    sealed = isinstance(sock, Sealed)  # it keeps the deadline on each of its records' reads
    got = 0
    while got < len(view):
        if until is not None and not sealed:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {len(view)} bytes within the transfer's deadline")
            if left < (sock.gettimeout() or float("inf")):
                sock.settimeout(left)
        n = sock.recv_into(view[got:], until) if sealed else sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


def send_all(sock, data, until: float) -> None:
    """``sendall`` in pieces: a socket timeout bounds a whole ``sendall``, so a large batch on a
    slow link would fail although it progresses; here each piece has it, and all end by ``until``."""
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        if time.monotonic() > until:
            raise TimeoutError(f"{start} of {len(view)} bytes sent within the transfer's deadline")
        sock.sendall(view[start : start + _CHUNK])


def recv_bytes(sock, n: int, until: float | None = None) -> bytes:
    """``n`` bytes, as ``recv_exact`` reads them."""
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), until)
    return bytes(buf)


class Sealed:
    """A bulk connection after its TLS handshake (module docstring): ``sendall`` and ``recv_into``
    as on a socket, over AES-128-GCM records. A record that fails its tag raises
    ``ConnectionError``: the transfer fails as on a broken connection (the client resubmits)."""

    def __init__(self, raw, send_key: bytes, recv_key: bytes):
        self._raw = raw
        self._tx, self._rx = AESGCM(bytes(send_key)), AESGCM(bytes(recv_key))
        self._sent = self._received = 0
        self._out = memoryview(bytearray(4 + _RECORD + _TAG))
        self._in = memoryview(bytearray(_RECORD + _TAG))
        self._plain: memoryview | None = None  # for records read into a smaller view than theirs
        self._left = memoryview(b"")  # plaintext read and not yet handed out

    @staticmethod
    def _nonce(counter: int) -> bytes:
        return counter.to_bytes(12, "big")

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _RECORD):
            piece = view[start : start + _RECORD]
            n = len(piece)
            U32.pack_into(self._out, 0, n)
            self._tx.encrypt_into(self._nonce(self._sent), piece, self._out[:4], self._out[4 : 4 + n + _TAG])
            self._sent += 1
            self._raw.sendall(self._out[: 4 + n + _TAG])

    def recv_into(self, view, until: float | None = None) -> int:
        """Plaintext into ``view`` (a record at a time); the record's reads end by ``until``."""
        if not self._left:
            head = bytearray(4)
            recv_exact(self._raw, memoryview(head), until)
            (n,) = U32.unpack(head)
            if not 0 < n <= _RECORD:
                raise ConnectionError(f"a bulk record of {n} bytes (at most {_RECORD})")
            recv_exact(self._raw, self._in[: n + _TAG], until)
            direct = len(view) >= n  # the payload's records land in the slab at once
            if not direct and self._plain is None:
                self._plain = memoryview(bytearray(_RECORD))
            into = view[:n] if direct else self._plain[:n]
            try:
                self._rx.decrypt_into(self._nonce(self._received), self._in[: n + _TAG], bytes(head), into)
            except InvalidTag:
                raise ConnectionError(
                    "a bulk record failed its authentication tag (altered, or out of order)"
                ) from None
            self._received += 1
            if direct:
                return n
            self._left = into
        k = min(len(view), len(self._left))
        view[:k] = self._left[:k]
        self._left = self._left[k:]
        return k

    def settimeout(self, seconds) -> None:
        self._raw.settimeout(seconds)

    def gettimeout(self):
        return self._raw.gettimeout()

    def shutdown(self, how) -> None:
        self._raw.shutdown(how)

    def close(self) -> None:
        self._raw.close()


def seal_sender(sock) -> Sealed:
    """The sender's side, once the token was accepted over TLS: fresh keys to the peer, TLS closed."""
    keys = secrets.token_bytes(32)
    sock.sendall(keys)
    return Sealed(sock.unwrap(), keys[:16], keys[16:])


def seal_receiver(conn, until: float) -> Sealed:
    """The receiver's side of ``seal_sender``."""
    keys = bytearray(32)
    recv_exact(conn, memoryview(keys), until)
    return Sealed(conn.unwrap(), keys[16:], keys[:16])
