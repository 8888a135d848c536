"""The yardstick for ``helix bench --overhead`` (b): what one bare gRPC unary call costs on this
machine at the same rate, with nothing of Helix in it — an echo server in its own process, sync
(as a DataServer serves) and ``grpc.aio`` (as the Coordinator serves) — and one bare call over the
local link (``wire/locallink/link.py``: an echo ``Execute`` on a Unix socket). A batch takes two calls,
Route to the Coordinator and Execute to a DataServer: both by the local link where the server is
on the rank's host, by gRPC to other hosts and sidecars."""

from __future__ import annotations

import multiprocessing as mp
import time

import psutil

__all__ = ["measure_rpc_floor"]

_METHOD = "/helix.bench.Echo/Call"


def _bytes(x):
    return x


def _echo(request, context):
    return request


async def _echo_async(request, context):
    return request


def _echo_execute(request, context):
    from helix_core.wire.proto import helix_pb2 as pb

    return pb.ExecuteReply(task_id=request.task_id)


def _serve(kind: str, ports, stop) -> None:
    """The echo server (a spawned process): its port (its link name) on ``ports``, until ``stop`` is set."""
    import grpc

    if kind == "link":
        import uuid

        from helix_core.wire.locallink.link import link_name
        from helix_core.wire.locallink.server import LocalListener

        listener = LocalListener(link_name(uuid.uuid4().hex, "echo"), "bench", _echo_execute, 10.0, 1)
        ports.put(listener.name)
        stop.wait()
        listener.close()
        return

    service, method = _METHOD.strip("/").split("/")
    if kind == "sync":
        from concurrent import futures

        handler = grpc.method_handlers_generic_handler(
            service, {method: grpc.unary_unary_rpc_method_handler(_echo, _bytes, _bytes)}
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        server.add_generic_rpc_handlers((handler,))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        stop.wait()
        server.stop(0)
        return
    import asyncio

    async def main():
        handler = grpc.method_handlers_generic_handler(
            service, {method: grpc.unary_unary_rpc_method_handler(_echo_async, _bytes, _bytes)}
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await server.stop(0)

    asyncio.run(main())


def _one(kind: str, calls: int, rate_hz: float, payload: int) -> dict:
    import grpc

    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve, args=(kind, ports, stop), name=f"helix-bench-echo-{kind}", daemon=True)
    proc.start()
    try:
        port = ports.get(timeout=60)
        if kind == "link":
            from helix_core.wire.locallink.link import LocalLink
            from helix_core.wire.proto import helix_pb2 as pb

            link = LocalLink.connect(port, "bench")
            request = pb.ExecuteRequest(task_id=1, spec_id="x" * payload)
            try:
                return _timed(lambda: link.execute(request).result(10), proc, calls, rate_hz)
            finally:
                link.close()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(_METHOD)
            body = b"x" * payload
            return _timed(lambda: call(body, timeout=10), proc, calls, rate_hz)
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _timed(call, proc, calls: int, rate_hz: float) -> dict:
    """CPU-seconds per ``call()`` of the server process and of this one, ``rate_hz`` calls a second."""
    for _ in range(50):  # connection, first-call setup
        call()
    time.sleep(0.5)
    server, client = psutil.Process(proc.pid), psutil.Process()
    s0, c0 = sum(server.cpu_times()[:2]), sum(client.cpu_times()[:2])
    t0 = time.perf_counter()
    for i in range(calls):
        call()
        pause = t0 + (i + 1) / rate_hz - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    return {
        "server_cpu_s": (sum(server.cpu_times()[:2]) - s0) / calls,
        "client_cpu_s": (sum(client.cpu_times()[:2]) - c0) / calls,
    }


def measure_rpc_floor(calls: int = 400, rate_hz: float = 50.0, payload: int = 256) -> dict:
    """CPU-seconds per bare unary call (server process, calling process) for a sync and an aio
    echo server and the local link, at ``rate_hz`` calls a second."""
    return {kind: _one(kind, calls, rate_hz, payload) for kind in ("sync", "aio", "link")}
