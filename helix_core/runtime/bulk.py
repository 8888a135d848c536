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

This module holds the wire form (constants, ``BulkError``, TLS contexts, reads and writes with
deadlines); ``bulkrecv.py`` is the receiving side (``BulkListener``), ``bulksend.py`` the sending
side (``BulkSender``).
"""
from __future__ import annotations

import os
import ssl
import struct
import tempfile
import time

__all__ = ["BulkError", "OK", "NO_ROOM", "REFUSED", "BAD", "BUSY"]

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
