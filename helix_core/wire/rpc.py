"""gRPC plumbing shared by every service and client: server construction, channels, Hello."""

from __future__ import annotations

from concurrent import futures

import grpc

from helix_core.config import PROTOCOL_VERSION, ClusterConfig
from helix_core.errors import ClusterError
from helix_core.security.auth import AioTokenInterceptor, TokenInterceptor, call_metadata, check_bind
from helix_core.security.listeners import guard
from helix_core.wire.proto import helix_pb2 as pb

__all__ = [
    "channel_options",
    "check_hello",
    "connect",
    "connected",
    "create_aio_server",
    "create_server",
    "server_options",
]


def channel_options(config: ClusterConfig, keepalive: bool = True) -> list[tuple[str, int]]:
    """Options of a channel: message limits, reconnects, and (``keepalive``) HTTP/2 pings — a peer
    that stops answering them (SIGSTOPped, its host gone, a half-open connection) fails the calls in
    flight with UNAVAILABLE within ``keepalive_s + keepalive_timeout_s``, so they are resubmitted
    elsewhere instead of waiting out ``execute_timeout_s``. (gRPC's ping ack timeout,
    ``ping_timeout_ms``, defaults to a minute and overrides the keepalive timeout: both are set.)
    Only the side that waits on a peer pings: the channels that carry batches (client -> server,
    sender -> delivery server). A channel of short control calls (heartbeats) keeps none: each call
    has its deadline, and an armed keepalive timer wakes gRPC's threads even with no call to watch."""
    ping_ms, timeout_ms = int(config.keepalive_s * 1000), int(config.keepalive_timeout_s * 1000)
    options = _common_options(config) + [
        # a restarted peer (a Coordinator back on its address) is found within a second, not gRPC's
        # default back-off of up to two minutes. (Not min_reconnect_backoff_ms: gRPC also takes it
        # as the connect timeout, and a TLS handshake on a busy host takes longer than 100 ms.)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if keepalive:
        options += [
            ("grpc.keepalive_time_ms", ping_ms),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    return options


def server_options(config: ClusterConfig) -> list[tuple[str, int]]:
    """Options of every server: message limits, and clients' keepalive pings accepted as often as
    they come, without data frames (a decode sends none for seconds), never refused as too many
    (GOAWAY "too_many_pings"). Servers ping no one: their callers watch them."""
    return _common_options(config) + [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", max(1, int(config.keepalive_s * 1000) // 2)),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _common_options(config: ClusterConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def _bind(server, host: str, port: int, tls) -> int:
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, tls.server_credentials())
            if tls is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # grpc raises instead of returning 0 on some failures
        bound = 0
    if bound == 0:
        raise ClusterError(f"cannot listen on {address}")
    return bound


def create_server(
    host: str, port: int, token: str | None, config: ClusterConfig, threads: int = 16, tls=None, insecure: bool = False
) -> tuple[grpc.Server, int]:
    """A gRPC server bound to ``host:port`` (0 picks a free port), with the token interceptor when
    a token is set, TLS when ``tls`` (a ``Tls``) is given, and message-size limits. Beyond
    loopback it needs a token, and TLS unless ``insecure``. Returns ``(server, port)``; the caller
    adds servicers and calls ``start()``."""
    check_bind(host, token, tls, insecure)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="helix-rpc"),
        interceptors=[TokenInterceptor(token)] if token else [],
        options=server_options(config),
    )
    return server, _bind(server, host, port, tls)


def create_aio_server(host: str, port: int, token: str | None, config: ClusterConfig, tls=None, insecure: bool = False):
    """``create_server`` for an asyncio service (grpc.aio; call it inside the running loop)."""
    check_bind(host, token, tls, insecure)
    server = grpc.aio.server(interceptors=[AioTokenInterceptor(token)] if token else [], options=server_options(config))
    return server, _bind(server, host, port, tls)


def connect(address: str, config: ClusterConfig, tls=None, keepalive: bool = True) -> grpc.Channel:
    """A channel to ``address``: TLS checked against ``tls.ca`` when ``tls`` is given; keepalive
    pings while calls are in flight unless ``keepalive=False`` (``channel_options``). On loopback,
    a call that carries the token goes only while this user (or root) listens there
    (``listeners.TokenGuard``: asked at every call, so at every reconnect)."""
    options = channel_options(config, keepalive)
    if tls is not None:
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=options + tls.channel_options())
    else:
        channel = grpc.insecure_channel(address, options=options)
    return guard(channel, address)


def connected(channel: grpc.Channel) -> bool:
    """Whether ``channel`` holds a live connection now (READY), asked once, without connecting.
    gRPC Python's public way, ``subscribe``, starts a thread that polls every 200 ms and keeps the
    event engine's threads waking ~25 times a second each, for the life of the channel (most of an
    idle DataServer's CPU); the core's own check is one call. Without it: False (the caller then
    takes the careful path)."""
    core = getattr(channel, "_channel", None)
    if core is not None and not hasattr(core, "check_connectivity_state"):  # a guarded channel (listeners.py)
        core = getattr(core, "_channel", None)
    check = getattr(core, "check_connectivity_state", None)
    if check is None:
        return False
    try:
        return check(False) == grpc.ChannelConnectivity.READY.value[0]
    except Exception:  # noqa: BLE001 - a closed channel, or another grpc's internals
        return False


def check_hello(stub, role: str, token: str | None, timeout_s: float, what: str, tls=None) -> pb.HelloReply:
    """Call ``Hello`` and compare protocol versions; raise ``ClusterError`` naming ``what``."""
    try:
        reply = stub.Hello(
            pb.HelloRequest(protocol_version=PROTOCOL_VERSION, role=role),
            timeout=timeout_s,
            metadata=call_metadata(token),
        )
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            hint = (
                ""
                if token
                else (
                    "; none was passed, and this user's private Helix folder holds none for this "
                    "address (its Coordinator runs under another user, or on another machine)"
                )
            )
            raise ClusterError(f"{what} refused the connection: {e.details()}{hint}") from None
        if tls is None:
            hint = "; if it uses TLS, set HELIX_TLS_CA, HELIX_TLS_CERT and HELIX_TLS_KEY (its CA, and a certificate it signed)"
        elif tls.cert is None:
            hint = (
                f"; with TLS every peer presents a certificate: give {tls.names[0]} and {tls.names[1]} "
                "(one the cluster's CA signed)"
            )
        else:
            hint = (
                f"; with TLS: is its certificate signed by the CA in {tls.names[2]} and made for this address, "
                "and ours by its CA?"
            )
        raise ClusterError(f"cannot reach {what}: {e.code().name} {e.details()}{hint}") from None
    if reply.protocol_version != PROTOCOL_VERSION:
        raise ClusterError(
            f"{what} speaks Helix protocol {reply.protocol_version}, this client "
            f"{PROTOCOL_VERSION}: install the same Helix version everywhere"
        )
    return reply
