"""Who may hold the bulk listener's connections (wire/bulk/recv.py): a full listener is always
"not connected" to a sender (its batch goes by gRPC, never as a lost delivery), peers without the
token hold a few pending places for at most the handshake deadline, idle kept connections give way
to new ones, and a transfer's header and payload each have an overall deadline. Real sockets; the
peers without the token run as another user (as root) in a process of their own."""

import os
import subprocess
import sys
import threading
import time

import pytest
from test_bulk import TOKEN, Receiver, _header, decoded_batch

from helix_core.config import ClusterConfig
from helix_core.memory import shm
from helix_core.memory.reader import SlabReader
from helix_core.memory.slabpool import SlabPool
from helix_core.security.tls import Tls
from helix_core.server.dataserver import DataServer
from helix_core.server.service import DataServerServicer
from helix_core.wire.bulk.protocol import BAD, MAX_HEADER, U32, BulkError
from helix_core.wire.bulk.send import BulkSender
from helix_core.wire.delivery import Outbound
from helix_core.wire.frames import add_servicer
from helix_core.wire.messages import slab_handle
from helix_core.wire.rpc import create_server

TLS = pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
_SQUAT = """import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
print("ready", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


class Squatter:
    """``n`` connections that never present the token, held by another process (of another user,
    nobody, where the test runs as root) until ``close``."""

    def __init__(self, port: int, n: int):
        as_other = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"] if os.geteuid() == 0 else []
        self.proc = subprocess.Popen(
            [*as_other, sys.executable, "-c", _SQUAT, str(port), str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = threading.Event()
        threading.Thread(target=lambda: self.proc.stdout.readline() == "ready\n" and ready.set(), daemon=True).start()
        assert ready.wait(30), "the squatter did not connect"

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


class Trickle:
    """An authenticated transfer kept going a byte at a time (a slot busy with a transfer)."""

    def __init__(self, sender: BulkSender, port: int, every_s: float = 0.3, total: int = 1 << 20, header=None):
        self.sock = sender._connect("127.0.0.1", port)
        head = (header or _header(total)).SerializeToString()
        self.sock.sendall(U32.pack(len(head)) + head)
        self.stop, self.every_s = threading.Event(), every_s
        self.ended: float | None = None  # when the receiver cut it off (monotonic)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(self.every_s):
            try:
                self.sock.sendall(b"x")
            except OSError:
                self.ended = time.monotonic()
                return

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.sock.close()


@TLS
def test_a_full_listener_is_always_not_connected_to_the_sender(tls):
    """Every slot carries a transfer: a new sender is told so, whether the pending places are free
    (it presents the token and hears BUSY) or taken by peers without the token (it is closed at
    once, a reset under TLS) — every time "not connected", so the batch goes by gRPC."""
    job = Tls.for_job() if tls else None
    rx = Receiver(tls=job, max_connections=2, max_pending=2, handshake_s=60.0)
    busy = [Trickle(BulkSender(TOKEN, rx.listener.config, job), rx.listener.port) for _ in range(2)]
    squat = None
    try:
        for round_ in ("pending free", "pending taken"):
            if round_ == "pending taken":
                squat = Squatter(rx.listener.port, 2)
            for _ in range(15):
                t0 = time.monotonic()
                with pytest.raises(BulkError) as e:
                    BulkSender(TOKEN, rx.listener.config, job).send(
                        "127.0.0.1", rx.listener.port, _header(3), memoryview(b"abc")
                    )
                assert e.value.connected is False and e.value.status is None, (round_, str(e.value))
                assert time.monotonic() - t0 < 2.0, round_
        assert rx.listener.connections == 2 and rx.listener.turned_away >= 30
        assert all(t.ended is None for t in busy)  # the transfers under way were never cut for a newcomer
    finally:
        for t in busy:
            t.close()
        if squat is not None:
            squat.close()
        rx.close()


def _delivery_server(tls, handshake_s: float):
    """A delivering DataServer's two ways in, as ``serve_dataserver`` makes them: gRPC and the bulk listener."""
    from helix_core.wire.bulk.recv import BulkListener

    cfg = ClusterConfig.for_tests()
    slabs = SlabPool(f"helix-test-bslot-r{os.getpid()}-")
    server, port = create_server("127.0.0.1", 0, TOKEN, cfg, threads=4, tls=tls)
    dataserver = DataServer(None, slabs, cfg, TOKEN, f"127.0.0.1:{port}", "local", tls)
    bulk = BulkListener(
        "127.0.0.1", TOKEN, cfg, tls, dataserver.take_bulk, handshake_s=handshake_s
    )  # 64 slots, 16 pending
    servicer = DataServerServicer(dataserver, bulk_port=bulk.port)
    add_servicer(servicer, server)
    server.start()

    def close():
        bulk.close()
        server.stop(0).wait(5)
        dataserver.close()
        slabs.close()

    return f"127.0.0.1:{port}", bulk, close


@TLS
def test_idle_and_unauthenticated_connections_never_keep_a_batch_from_landing(tls):
    """64 idle kept connections of other senders fill every slot and another user holds
    connections without the token: a sidecar's batch still lands — by the bulk path while a
    pending place is free (the longest-idle connection gives way), by gRPC when the other user
    holds every pending place — and never fails as a lost delivery. (The handshake deadline is
    long here so that the other user's connections stay for the whole test: cutting them off is
    ``test_bulk``'s trickle test.)"""
    job = Tls.for_job() if tls else None
    address, bulk, close_server = _delivery_server(job, handshake_s=60.0)
    cfg = bulk.config
    tx_slabs, reader = SlabPool(f"helix-test-bslot-t{os.getpid()}-"), SlabReader()
    idle, squat, outs = [], [], []
    try:
        for _ in range(64):  # other senders' kept connections, each idle after one batch
            s = BulkSender(TOKEN, cfg, job)
            reply = s.send("127.0.0.1", bulk.port, _header(3), memoryview(b"abc"))
            shm.release_segment(slab_handle(reply.batch.slab))
            idle.append(s)
        assert bulk.connections == 64
        squat.append(Squatter(bulk.port, 5))  # fewer than the pending places

        result, total, slab = decoded_batch(tx_slabs)

        def deliver(task_id: int) -> dict:
            out = Outbound(TOKEN, cfg, job, reader)  # a sidecar that has not sent here yet
            outs.append(out)
            reply = out.send(task_id, result, address)  # raises DeliveryFailed on a lost delivery
            handle = slab_handle(reply.batch.slab)
            got = reader.view(handle)
            assert bytes(got[:total]) == bytes(slab.payload[:total])
            got.release()
            shm.release_segment(handle)
            return out.counters()

        by_bulk = deliver(1)
        assert by_bulk["bulk_bytes"] >= total  # it took the longest-idle connection's slot
        assert bulk.connections == 65
        squat.append(Squatter(bulk.port, bulk.max_pending))  # now every pending place is held without the token
        for task_id in range(2, 8):
            by_grpc = deliver(task_id)
            assert by_grpc["bulk_bytes"] == 0 and by_grpc["cross_ds_bytes"] >= total
        assert bulk.turned_away >= 6
        slab.release()
    finally:
        for out in outs:
            out.close()
        for s in idle:
            s.close()
        for q in squat:
            q.close()
        close_server()
        reader.close()
        tx_slabs.close()


def _ended_within(sock, limit_s: float, every_s: float = 0.3) -> float:
    """Seconds until the receiver ends ``sock`` (EOF, a reset), sending a byte every ``every_s``
    meanwhile (a peer that trickles); fails past ``limit_s``."""
    t0 = time.monotonic()
    sock.settimeout(every_s)
    buf = bytearray(64)
    while time.monotonic() - t0 < limit_s:
        try:
            sock.sendall(b"x")
            if sock.recv_into(buf) == 0:
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:  # (ConnectionError among them; a sealed connection's EOF too)
            return time.monotonic() - t0
    raise AssertionError(f"the receiver kept the connection past {limit_s} s")


@TLS
def test_a_header_over_the_bound_or_stalled_and_a_stalled_payload_are_cut_off_within_their_deadlines(tls):
    cfg = ClusterConfig.for_tests(execute_timeout_s=4.0, sample_timeout_s=1.0)  # header deadline: 0.5 + 1.0 s
    job = Tls.for_job() if tls else None
    rx = Receiver(tls=job, config=cfg)
    sender = BulkSender(TOKEN, cfg, job)
    port = rx.listener.port
    try:
        sock = sender._connect("127.0.0.1", port)  # with the token, then a header over the bound
        t0 = time.monotonic()
        sock.sendall(U32.pack(MAX_HEADER + 1))
        sock.settimeout(5.0)
        answer = bytearray(5)
        n = sock.recv_into(answer)
        assert n == 5 and answer[0] == BAD
        reason = bytearray(int.from_bytes(answer[1:5], "little"))
        sock.recv_into(reason)
        assert f"at most {MAX_HEADER}" in reason.decode() and time.monotonic() - t0 < 2.0
        sock.close()

        sock = sender._connect("127.0.0.1", port)  # a header announced, then trickled a byte at a time
        sock.sendall(U32.pack(1000) + b"\0" * 10)
        assert _ended_within(sock, 6.0) < 3.0
        sock.close()

        trickle = Trickle(sender, port, every_s=0.3)  # a payload trickled: the transfer's deadline (4 s)
        t0 = time.monotonic()
        trickle.thread.join(12)
        assert trickle.ended is not None and trickle.ended - t0 < 4.0 + 2.0
        trickle.close()

        with pytest.raises(BulkError) as e:  # the sender never sends a header over the bound: gRPC carries it
            sender.send("127.0.0.1", port, _header_over_bound(), memoryview(b""))
        assert e.value.connected is False
        sender.send("127.0.0.1", port, _header(5), memoryview(b"hello"))  # and the listener keeps serving
        assert rx.got == [b"hello"]
    finally:
        sender.close()
        rx.close()


def _header_over_bound():
    h = _header(0)
    h.tree_pickle = b"\0" * (MAX_HEADER + 1)
    return h


def test_a_sender_keeps_a_few_connections_per_receiver_and_drops_idle_ones(monkeypatch):
    from helix_core.wire.bulk import send as bulksend

    rx = Receiver()
    sender = BulkSender(TOKEN, rx.listener.config)
    try:
        socks = [sender._connect("127.0.0.1", rx.listener.port) for _ in range(6)]  # a burst's connections
        for s in socks:
            sender._keep(("127.0.0.1", rx.listener.port), s)
        assert len(sender._idle[("127.0.0.1", rx.listener.port)]) == bulksend._KEEP_PER_PEER
        monkeypatch.setattr(bulksend, "_SENDER_IDLE_S", 0.0)  # every kept one is now past its idle time
        assert sender._take(("127.0.0.1", rx.listener.port)) is None and sender._idle == {}
        assert all(s.fileno() == -1 for s in socks)  # closed, none left holding a slot at the receiver
    finally:
        sender.close()
        rx.close()
