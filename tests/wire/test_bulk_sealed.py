"""Sealed records (wire/bulk/protocol.py): after the bulk path's TLS handshake, the payload travels in
AES-GCM records of up to 1 MiB. What a user relies on: bytes arrive exactly, in any read size;
nothing readable crosses the wire; a record altered, dropped or replayed breaks the connection
(the transfer fails and is resubmitted) instead of landing in a batch. Real sockets (socketpairs)."""

import os
import socket
import threading

import pytest

from helix_core.wire.bulk.protocol import _RECORD, Sealed

KEYS = (os.urandom(16), os.urandom(16))


def _pair():
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(10.0)
    return a, b, Sealed(a, KEYS[0], KEYS[1]), Sealed(b, KEYS[1], KEYS[0])


def _read(sealed: Sealed, n: int, step: int) -> bytes:
    out, got = bytearray(n), 0
    view = memoryview(out)
    while got < n:
        got += sealed.recv_into(view[got : got + step])
    return bytes(out)


def _wire(messages: list[bytes]) -> bytes:
    """What ``Sealed.sendall`` of ``messages`` puts on the wire, raw."""
    a, b = socket.socketpair()
    chunks = []

    def drain():
        while chunk := b.recv(1 << 20):
            chunks.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    tx = Sealed(a, *KEYS)
    for m in messages:
        tx.sendall(m)
    a.shutdown(socket.SHUT_WR)
    reader.join()
    a.close()
    b.close()
    return b"".join(chunks)


def _recv_from(raw: bytes, n: int) -> bytes:
    a, b = socket.socketpair()

    def send():
        try:
            a.sendall(raw)
            a.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the receiver gave up first: what the test looks at

    sender = threading.Thread(target=send)
    sender.start()
    try:
        return _read(Sealed(b, KEYS[1], KEYS[0]), n, n)  # the receiving side's keys, mirrored
    finally:
        b.close()
        sender.join()
        a.close()


@pytest.mark.parametrize("n", [1, _RECORD - 1, _RECORD, 3 * _RECORD + 5])
@pytest.mark.parametrize("step", [7, 1 << 16, 8 << 20])
def test_bytes_arrive_exactly_whatever_the_read_size(n, step):
    a, b, tx, rx = _pair()
    payload = os.urandom(n)
    try:
        sender = threading.Thread(target=lambda: (tx.sendall(payload), tx.sendall(b"next")))
        sender.start()
        assert _read(rx, n, step) == payload
        assert _read(rx, 4, 4) == b"next"  # the stream's framing holds after the payload
        sender.join()
        rx.sendall(b"back")  # and the other direction, with its own key
        assert _read(tx, 4, 4) == b"back"
    finally:
        a.close()
        b.close()


def test_the_wire_carries_no_plaintext():
    secret = b"the training set's frames " * 40_000
    wire = _wire([secret])
    assert b"training set" not in wire and len(wire) >= len(secret)


def test_an_altered_record_fails_the_connection_not_the_batch():
    payload = os.urandom(2 * _RECORD)
    wire = bytearray(_wire([payload]))
    wire[100] ^= 1
    with pytest.raises(ConnectionError, match="authentication tag"):
        _recv_from(bytes(wire), len(payload))


def test_a_dropped_or_replayed_record_fails_the_connection():
    first, second = os.urandom(1000), os.urandom(1000)
    wire = _wire([first, second])
    one = wire[: len(wire) // 2]  # two records of the same size
    assert _recv_from(wire, 2000) == first + second
    with pytest.raises(ConnectionError, match="authentication tag"):
        _recv_from(one + one, 2000)  # the first record again in the second's place
    with pytest.raises(ConnectionError, match="authentication tag"):
        _recv_from(wire[len(one) :], 1000)  # the first dropped


def test_a_record_longer_than_the_protocol_allows_is_refused():
    with pytest.raises(ConnectionError, match="at most"):
        _recv_from((_RECORD + 1).to_bytes(4, "big")[::-1] + bytes(64), 64)
