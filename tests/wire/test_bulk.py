"""The bulk delivery path (wire/bulk/protocol.py): a sidecar's batch goes straight into the
delivery server's slab over a token-checked TCP connection (TLS with the cluster's
certificates), and the cluster uses it for every remote delivery, falling back to gRPC's
``Deliver`` where it is off; a stalled receiver fails a transfer in seconds."""

import socket
import threading
import time

import pytest
from dataplane import CFG, assert_same_batches, torch_batches

import helix_core as hx
from helix_core.config import ClusterConfig
from helix_core.memory import shm
from helix_core.memory.slabpool import SlabPool
from helix_core.security.tls import Tls
from helix_core.testing.datasets import IndexDataset
from helix_core.wire.bulk.protocol import NO_ROOM, OK, REFUSED, BulkError
from helix_core.wire.bulk.recv import BulkListener
from helix_core.wire.bulk.send import BulkSender
from helix_core.wire.messages import slab_handle
from helix_core.wire.proto import helix_pb2 as pb

TOKEN = "t" * 32


class Receiver:
    """A listener writing into a real slab pool, as a DataServer's does."""

    def __init__(self, tls=None, refuse=None, config=CFG, **sizes):
        self.pool = SlabPool(f"helix-test-bulk-{id(self):x}")
        self.refuse, self.got = refuse, []
        self.listener = BulkListener("127.0.0.1", TOKEN, config, tls=tls, receive=self.receive, **sizes)

    def receive(self, header):
        if self.refuse is not None:
            return self.refuse, "no room for it", None, None, None
        slab = self.pool.acquire(header.total_bytes)

        def done():
            self.got.append(bytes(slab.payload[: header.total_bytes]))
            slab.release()
            return pb.DeliverReply(server_id="receiver").SerializeToString()

        return OK, "", slab.payload, done, slab.release

    def close(self):
        self.listener.close()
        self.pool.close()


def _threads(name: str) -> int:
    return sum(t.name == name and t.is_alive() for t in threading.enumerate())


def _header(n: int) -> pb.StreamHeader:
    return pb.StreamHeader(task_id=7, tree_json="{}", total_bytes=n)


def test_a_batch_arrives_byte_for_byte_over_kept_connections():
    rx = Receiver()
    tx = BulkSender(TOKEN, CFG)
    try:
        payloads = [bytes(range(256)) * (k * 4099 + 1) for k in range(3)]
        for p in payloads:
            reply = tx.send("127.0.0.1", rx.listener.port, _header(len(p)), memoryview(p))
            assert reply.server_id == "receiver"
        assert rx.got == payloads and rx.listener.received_bytes == sum(map(len, payloads))
        assert rx.listener.connections == 1  # one kept connection carried all three
    finally:
        tx.close()
        rx.close()


def test_a_wrong_token_and_a_refusal_are_named_and_the_listener_keeps_serving():
    rx = Receiver()
    try:
        with pytest.raises(BulkError, match="wrong or missing token") as e:
            BulkSender("x" * 32, CFG).send("127.0.0.1", rx.listener.port, _header(3), memoryview(b"abc"))
        assert e.value.status == REFUSED
        tx = BulkSender(TOKEN, CFG)
        rx.refuse = NO_ROOM
        with pytest.raises(BulkError, match="no room") as e:
            tx.send("127.0.0.1", rx.listener.port, _header(5), memoryview(b"hello"))
        assert e.value.status == NO_ROOM
        rx.refuse = None  # the refused payload was drained: the same connection goes on
        tx.send("127.0.0.1", rx.listener.port, _header(5), memoryview(b"hello"))
        assert rx.got == [b"hello"]
        tx.close()
    finally:
        rx.close()


def test_tls_both_ends_and_a_stranger_is_refused():
    job = Tls.for_job()
    rx = Receiver(tls=job)
    try:
        tx = BulkSender(TOKEN, CFG, tls=job)
        tx.send("127.0.0.1", rx.listener.port, _header(4), memoryview(b"data"))
        big = bytes(range(251)) * 12_533  # 3 MiB and then some: several sealed records
        rx.refuse = NO_ROOM  # a refused payload is drained record by record: the connection goes on
        with pytest.raises(BulkError, match="no room"):
            tx.send("127.0.0.1", rx.listener.port, _header(len(big)), memoryview(big))
        rx.refuse = None
        tx.send("127.0.0.1", rx.listener.port, _header(len(big)), memoryview(big))
        assert rx.got == [b"data", big] and rx.listener.connections == 1
        tx.close()
        rx.got.clear()
        stranger = BulkSender(TOKEN, CFG, tls=Tls.for_job())  # another CA: neither side trusts the other
        with pytest.raises(BulkError) as e:
            stranger.send("127.0.0.1", rx.listener.port, _header(4), memoryview(b"data"))
        assert e.value.status is None and rx.got == []
    finally:
        rx.close()


def test_a_receiver_that_stops_answering_fails_the_transfer_within_the_keepalive_deadline():
    cfg = ClusterConfig.for_tests()
    with socket.socket() as silent:  # accepts, then never reads nor answers (a SIGSTOPped server)
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        tx = BulkSender(TOKEN, cfg)
        t0 = time.monotonic()
        with pytest.raises(BulkError) as e:
            tx.send("127.0.0.1", silent.getsockname()[1], _header(64 << 20), memoryview(bytearray(64 << 20)))
        assert e.value.status is None
        assert time.monotonic() - t0 < 3 * (cfg.keepalive_s + cfg.keepalive_timeout_s)


@pytest.mark.parametrize("bulk", [True, False])
def test_a_cluster_delivers_remote_batches_by_the_bulk_path_or_by_grpc_identically(bulk):
    cfg = ClusterConfig.for_tests(bulk_delivery=bulk)
    ds = IndexDataset(24, shape=(3, 64, 64), delays={i: 0.05 for i in range(24)})
    with hx.LocalCluster(local_servers=1, remote_servers=1, workers_per_server=1, config=cfg) as cluster:
        with hx.DistributedDataLoader(
            ds, batch_size=2, coordinator=cluster.address, config=cfg, scheduler="least-request", prefetch_depth=6
        ) as ld:
            got = list(ld)
            moved = ld.stats()["cross_ds_bytes"]
            tele = ld.client.telemetry()
    assert_same_batches(got, torch_batches(ds, 2, 0, 1))
    remote = next(s for s in tele["servers"] if s["kind"] == "remote")  # as of its last heartbeat
    assert moved > 0 and remote["cross_ds_bytes"] > 0
    assert remote["bulk_bytes"] == (remote["cross_ds_bytes"] if bulk else 0)


def test_an_unauthenticated_trickle_is_cut_off_and_full_slots_send_senders_to_grpc():
    cfg = ClusterConfig.for_tests()  # handshake deadline: keepalive 0.5 + 1.0 s
    rx = Receiver(config=cfg, max_connections=1, max_pending=1)
    try:
        with socket.create_connection(("127.0.0.1", rx.listener.port)) as trickle:
            t0 = time.monotonic()
            with pytest.raises(BulkError) as e:  # the one pending place is the trickler's: the sender is told at once
                BulkSender(TOKEN, cfg).send("127.0.0.1", rx.listener.port, _header(3), memoryview(b"abc"))
            assert e.value.connected is False and time.monotonic() - t0 < 1.0
            trickle.settimeout(10)
            closed = None
            for _ in range(20):  # a byte every 0.4 s never completes the handshake in time
                try:
                    trickle.sendall(b"H")
                    if trickle.recv(1, socket.MSG_DONTWAIT) == b"":
                        closed = time.monotonic() - t0
                        break
                except BlockingIOError:
                    pass
                except OSError:
                    closed = time.monotonic() - t0
                    break
                time.sleep(0.4)
            assert closed is not None and closed < 3 * (cfg.keepalive_s + cfg.keepalive_timeout_s)
        tx = BulkSender(TOKEN, cfg)  # its slot is free again
        tx.send("127.0.0.1", rx.listener.port, _header(3), memoryview(b"abc"))
        tx.close()
        assert rx.got == [b"abc"]
    finally:
        rx.close()
    assert _threads("helix-bulk-accept") == 0  # close() ends the accept thread: the port takes no one
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", rx.listener.port), timeout=2).close()


def test_a_bulk_port_that_cannot_be_reached_sends_batches_by_grpc_and_is_left_alone_a_while(caplog):
    """A firewall that passes only the gRPC port: the first batch finds the bulk port closed and
    goes by gRPC's Deliver; the next ones go by gRPC at once (no connection tried per batch)."""
    from helix_core.memory.reader import SlabReader
    from helix_core.server.dataserver import DataServer
    from helix_core.server.service import DataServerServicer
    from helix_core.wire.delivery import Outbound
    from helix_core.wire.frames import add_servicer
    from helix_core.wire.rpc import create_server

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    rx_slabs, tx_slabs = (SlabPool(f"helix-test-bulkfw-{k}-{id(caplog):x}") for k in "rt")
    reader = SlabReader()
    server, port = create_server("127.0.0.1", 0, TOKEN, CFG, threads=4)
    dataserver = DataServer(None, rx_slabs, CFG, TOKEN, f"127.0.0.1:{port}", "local")
    servicer = DataServerServicer(dataserver, bulk_port=closed_port)  # what its Hello offers
    add_servicer(servicer, server)
    server.start()
    out = Outbound(TOKEN, CFG, None, reader)
    try:
        result, total, slab = decoded_batch(tx_slabs)
        with caplog.at_level("WARNING", logger="helix.delivery"):
            for task_id in (1, 2, 3):
                reply = out.send(task_id, result, f"127.0.0.1:{port}")
                got = reader.view(slab_handle(reply.batch.slab))
                assert bytes(got[:total]) == bytes(slab.payload[:total])  # every batch arrived, by gRPC
                got.release()
                shm.release_segment(slab_handle(reply.batch.slab))
        assert out.counters()["bulk_bytes"] == 0 and out.counters()["cross_ds_bytes"] >= 3 * total
        assert sum("bulk path to" in r.message for r in caplog.records) == 1  # tried once, then left alone
        slab.release()
    finally:
        out.close()
        server.stop(0).wait(5)
        reader.close()
        rx_slabs.close()
        tx_slabs.close()


def decoded_batch(tx_slabs) -> tuple[object, int, object]:
    """A DataServer's result for one decoded batch (a 512 KiB tensor) in a slab of ``tx_slabs``:
    ``(result, payload bytes, the slab)``, as a worker leaves it for delivery."""
    import torch

    from helix_core.memory.tensors import flatten, layout, write_tensors
    from helix_core.server.worker import TaskResult

    tree_json, tree_pickle, tensors = flatten({"video": torch.arange(1 << 16, dtype=torch.int64)})
    metas, total = layout(tensors)
    slab = tx_slabs.acquire(total)
    metas = write_tensors(slab.payload, tensors, metas)
    result = TaskResult(slab.handle(total), tree_json, tree_pickle, metas)
    return result, total, slab
