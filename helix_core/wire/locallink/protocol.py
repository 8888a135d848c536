"""The local link's wire, as both ends speak it (``link.py``: the clients; ``server.py``: the servers).

Handshake: the client checks that the listener runs as its own user (``peer_uid``, ``SO_PEERCRED``)
before it sends ``hello(token)``: ``MAGIC``, the token's length (u16) and the token; the server
answers one byte, ``ACCEPTED`` or ``REFUSED``.

Then frames, both ways: ``u32 length | u8 kind | body`` (``frame``). The client sends ``REQUEST``
(an ``ExecuteRequest``, or the Coordinator's ``RouteRequest``); the server answers each with
``REPLY`` or ``ERROR`` (``error_body``: ``u64 task_id | u8 status code | details``, what a gRPC
call would have raised; ``parse_error`` reads it back). ``PING`` asks a silent server whether it is
alive, ``PONG`` answers. A frame longer than ``MAX_FRAME`` bytes ends the connection.
"""

from __future__ import annotations

import socket
import struct
import time

import grpc

__all__ = [
    "ACCEPTED",
    "ERROR",
    "FRAME",
    "MAGIC",
    "MAX_FRAME",
    "PING",
    "PONG",
    "REFUSED",
    "REPLY",
    "REQUEST",
    "TOKEN_LENGTH",
    "error_body",
    "frame",
    "hello",
    "parse_error",
    "peer_uid",
    "recv_exact",
    "recv_frame",
    "shut",
]

MAGIC = b"HXL1"
ACCEPTED, REFUSED = b"\0", b"\1"  # the server's answer to the handshake
REQUEST, REPLY, ERROR, PING, PONG = 1, 2, 3, 4, 5
FRAME = struct.Struct("<IB")  # body length (bytes), kind
TOKEN_LENGTH = struct.Struct("<H")
MAX_FRAME = 64 << 20  # bytes
_ERROR = struct.Struct("<QB")  # task id, status code
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_PEERCRED = struct.Struct("3i")


def hello(token: bytes) -> bytes:
    """The client's handshake: ``MAGIC``, the token's length and the token."""
    return MAGIC + TOKEN_LENGTH.pack(len(token)) + token


def frame(kind: int, body: bytes = b"") -> bytes:
    return FRAME.pack(len(body), kind) + body


def error_body(task_id: int, code: grpc.StatusCode, details: str) -> bytes:
    """An ``ERROR`` frame's body: the call ``task_id`` failed with ``code`` and ``details``."""
    return _ERROR.pack(task_id, code.value[0]) + details.encode()


def parse_error(body: bytes) -> tuple[int, grpc.StatusCode, str]:
    """``(task_id, code, details)`` of an ``ERROR`` frame's body (an unknown code reads UNKNOWN)."""
    task_id, code = _ERROR.unpack_from(body)
    return task_id, _CODES.get(code, grpc.StatusCode.UNKNOWN), body[_ERROR.size :].decode(errors="replace")


def peer_uid(sock) -> int:
    """The uid of the process at the other end of the Unix socket ``sock`` (``SO_PEERCRED``)."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]


def recv_exact(sock, n: int, until: float | None = None) -> bytes:
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


def recv_frame(sock) -> tuple[int, bytes]:
    """``(kind, body)`` of the next frame; ``EOFError`` for one past ``MAX_FRAME``."""
    n, kind = FRAME.unpack(recv_exact(sock, FRAME.size))
    if n > MAX_FRAME:
        raise EOFError(f"frame of {n} bytes")
    return kind, recv_exact(sock, n)


def shut(sock) -> None:
    """Close ``sock`` so that a thread blocked on it wakes (a plain close leaves it blocked, and sends nothing)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
