"""The local link (Execute over an abstract Unix socket between a rank and a DataServer of its host):
replies and errors as gRPC would give them, the token, and what a broken link does to calls in flight."""

import multiprocessing
import os
import socket
import threading
import uuid

import grpc
import pytest
import torch

import helix_core as hx
from helix_core.config import ClusterConfig
from helix_core.launch.cluster import LocalCluster
from helix_core.testing.datasets import IndexDataset
from helix_core.wire.locallink.link import LinkError, LocalLink, link_name
from helix_core.wire.locallink.server import LocalListener
from helix_core.wire.proto import helix_pb2 as pb


def _name():
    return link_name(uuid.uuid4().hex[:12], "127.0.0.1:1")


def _listener(execute, token="secret"):
    return LocalListener(_name(), token, execute, timeout_s=30.0, threads=4)


def test_replies_come_back_to_their_own_calls_in_any_order():
    release = threading.Event()

    def execute(request, context):
        if request.task_id == 1:  # the first call answers last
            release.wait(10)
        else:
            release.set()
        return pb.ExecuteReply(task_id=request.task_id, exec_s=float(request.task_id))

    server = _listener(execute)
    name = server.name
    link = LocalLink.connect(name, "secret")
    try:
        first, second = link.execute(pb.ExecuteRequest(task_id=1)), link.execute(pb.ExecuteRequest(task_id=2))
        assert second.result(10).exec_s == 2.0 and first.result(10).exec_s == 1.0
    finally:
        link.close()
        server.close()


def test_an_aborted_call_raises_its_status_code_and_a_wrong_token_is_refused():
    def execute(request, context):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unknown dataset spec s1: Configure first")

    server = _listener(execute)
    name = server.name
    try:
        assert LocalLink.connect(name, "not-the-token") is None
        link = LocalLink.connect(name, "secret")
        with pytest.raises(LinkError) as e:
            link.execute(pb.ExecuteRequest(task_id=7)).result(10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Configure first" in e.value.details()
        assert isinstance(e.value, grpc.RpcError)  # the request path resubmits it as it would a gRPC error
        link.close()
    finally:
        server.close()


def test_a_link_that_closes_fails_its_calls_as_unavailable_and_cancels_them_at_the_server():
    started, cancelled = threading.Event(), threading.Event()

    def execute(request, context):
        context.add_callback(cancelled.set)
        started.set()
        cancelled.wait(10)
        assert not context.is_active()
        return pb.ExecuteReply(task_id=request.task_id)

    server = _listener(execute)
    name = server.name
    link = LocalLink.connect(name, "secret")
    fut = link.execute(pb.ExecuteRequest(task_id=3))
    assert started.wait(10)
    server.close()  # the server goes: its call in flight fails, and the server's side is told
    with pytest.raises(LinkError) as e:
        fut.result(10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert cancelled.wait(10)
    assert link.broken
    again = link.execute(pb.ExecuteRequest(task_id=4))  # a call on a broken link fails at once
    assert isinstance(again.exception(5), LinkError)
    link.close()


def test_a_loader_reads_the_same_batches_over_the_link_as_over_grpc():
    ds = IndexDataset(48, shape=(8,))
    out = {}
    for local_link in (True, False):
        config = ClusterConfig.for_tests(local_link=local_link)
        with (
            LocalCluster(local_servers=2, workers_per_server=1, token=True, config=config) as cluster,
            hx.DistributedDataLoader(
                ds, 4, rank=0, world_size=1, coordinator=cluster.address, token=cluster.token, config=config
            ) as loader,
        ):
            out[local_link] = [b for b in loader]
    assert len(out[True]) == len(out[False]) == 12
    for a, b in zip(out[True], out[False]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a listener as another user")
def test_no_token_goes_to_a_link_name_another_user_holds():
    """A squatter of another user on the name a DataServer would take gets nothing: the client
    checks the listener's user (SO_PEERCRED) before it sends the token, and falls back to gRPC."""
    name = _name()
    ready, received = multiprocessing.get_context("fork").Pipe(duplex=False)
    got_r, got_w = multiprocessing.get_context("fork").Pipe(duplex=False)

    def squat():
        os.setgid(65534)
        os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(name)
        s.listen(1)
        received.send(True)
        conn, _ = s.accept()
        conn.settimeout(3.0)
        data = b""
        try:
            while chunk := conn.recv(1024):
                data += chunk
        except OSError:
            pass
        got_w.send(data)

    p = multiprocessing.get_context("fork").Process(target=squat, daemon=True)
    p.start()
    try:
        assert ready.poll(10) and ready.recv()
        assert LocalLink.connect(name, "secret") is None
        assert got_r.poll(10) and got_r.recv() == b""
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()


def test_the_coordinators_call_link_answers_in_order_and_fails_as_grpc_would():
    """Route over the Coordinator's link (an asyncio server): answers, an abort's status code, and
    a call past its timeout, which breaks the link (a late answer must not be read as the next one's)."""
    import asyncio

    from helix_core.wire.locallink.link import CallLink
    from helix_core.wire.locallink.server import serve_call_link

    name, loop = _name(), asyncio.new_event_loop()

    async def route(request, context):
        if request.rank == 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no delivery server on host h")
        if request.rank == 2:
            await asyncio.sleep(2.0)
        return pb.RouteReply(exec_server_id=f"s{request.task_id}")

    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = asyncio.run_coroutine_threadsafe(serve_call_link(name, "secret", route, pb.RouteRequest), loop).result(10)
    try:
        assert CallLink.connect(name, "wrong") is None
        link = CallLink.connect(name, "secret")
        assert [link.call(pb.RouteRequest(task_id=i), pb.RouteReply, 5.0).exec_server_id for i in (7, 8)] == [
            "s7",
            "s8",
        ]
        with pytest.raises(LinkError) as e:
            link.call(pb.RouteRequest(rank=1), pb.RouteReply, 5.0)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "host h" in e.value.details()
        with pytest.raises(LinkError) as e:
            link.call(pb.RouteRequest(rank=2), pb.RouteReply, 0.2)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and link.broken
        with pytest.raises(LinkError) as e:
            link.call(pb.RouteRequest(task_id=9), pb.RouteReply, 5.0)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        again = CallLink.connect(name, "secret")  # what the client does next: connect again
        assert again.call(pb.RouteRequest(task_id=9), pb.RouteReply, 5.0).exec_server_id == "s9"
        again.close()
    finally:

        async def shutdown():
            server.close()
            await server.wait_closed()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:  # the connections' handlers (the slow call's included)
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def _link_threads() -> int:
    return sum(t.name == "helix-link-conn" and t.is_alive() for t in threading.enumerate())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_a_connection_of_another_user_is_refused_before_a_thread_starts():
    """Another user's process reaches the abstract name (it lives in the network namespace), even
    with the token: the listener asks SO_PEERCRED at accept and closes it, reading nothing and
    starting no thread; the DataServer's own user is served as before."""
    calls = []
    server = _listener(lambda request, context: calls.append(request) or pb.ExecuteReply(task_id=request.task_id))
    got_r, got_w = multiprocessing.get_context("fork").Pipe(duplex=False)
    hold_r, hold_w = multiprocessing.get_context("fork").Pipe(duplex=False)

    def other_user():
        os.setgid(65534)
        os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10.0)
        s.connect(server.name)
        data = b""
        try:
            s.sendall(b"HXL1" + len(b"secret").to_bytes(2, "little") + b"secret")
            while chunk := s.recv(1024):
                data += chunk
        except OSError:
            pass
        got_w.send(data)
        hold_r.poll(10)  # keep the process (its socket closed) until the test has looked

    before = _link_threads()
    p = multiprocessing.get_context("fork").Process(target=other_user, daemon=True)
    p.start()
    try:
        assert got_r.poll(15) and got_r.recv() == b""  # closed at once: not even the refusal byte
        assert server.refused == 1 and _link_threads() == before and calls == []
        link = LocalLink.connect(server.name, "secret")  # this user's own rank: served
        assert link is not None and link.execute(pb.ExecuteRequest(task_id=5)).result(10).task_id == 5
        link.close()
    finally:
        hold_w.send(True)
        p.join(10)
        if p.is_alive():
            p.kill()
        server.close()


def test_a_silent_or_trickling_connection_is_closed_at_the_handshake_deadline():
    import time

    server = LocalListener(
        _name(), "secret", lambda r, c: pb.ExecuteReply(), timeout_s=30.0, threads=2, handshake_s=0.5
    )
    try:
        for trickle in (False, True):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.name)
            s.settimeout(0.2)
            t0, closed = time.monotonic(), None
            payload = iter(b"HXL1\x06\x00secr")  # a byte every 0.2 s: each read is quick, the whole is not
            while time.monotonic() - t0 < 5.0:
                try:
                    if trickle:
                        s.sendall(bytes((next(payload),)))
                    if s.recv(1) == b"":
                        closed = time.monotonic() - t0
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed = time.monotonic() - t0
                    break
            s.close()
            assert closed is not None and 0.4 < closed < 2.0, (trickle, closed)
        link = LocalLink.connect(server.name, "secret")  # and the listener keeps serving
        assert link is not None
        link.close()
    finally:
        server.close()


def test_the_coordinators_call_link_closes_a_silent_connection_at_the_handshake_deadline():
    import asyncio
    import time

    from helix_core.wire.locallink.link import CallLink
    from helix_core.wire.locallink.server import serve_call_link

    async def route(request, context):
        return pb.RouteReply(exec_server_id="s")

    name, loop = _name(), asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = asyncio.run_coroutine_threadsafe(
        serve_call_link(name, "secret", route, pb.RouteRequest, handshake_s=0.5), loop
    ).result(10)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(name)
            s.settimeout(5.0)
            t0 = time.monotonic()
            assert s.recv(1) == b"" and 0.4 < time.monotonic() - t0 < 2.0  # closed at the deadline
        link = CallLink.connect(name, "secret")  # and it keeps serving
        assert link.call(pb.RouteRequest(), pb.RouteReply, 5.0).exec_server_id == "s"
        link.close()
    finally:

        async def shutdown():
            server.close()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
