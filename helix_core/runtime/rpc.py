"""gRPC plumbing shared by every service and client: server construction, channels, Hello."""
from __future__ import annotations

from concurrent import futures

import grpc

from ..config import PROTOCOL_VERSION, ClusterConfig
from ..errors import ClusterError
from .auth import AioTokenInterceptor, TokenInterceptor, call_metadata, check_bind
from .proto import helix_pb2 as pb

__all__ = ["channel_options", "check_hello", "connect", "create_aio_server", "create_server"]


def channel_options(config: ClusterConfig) -> list[tuple[str, int]]:
    """Options of every channel and server: message limits, and keepalive — a peer that stops
    answering HTTP/2 pings (SIGSTOPped, its host gone, a half-open connection) fails the calls in
    flight with UNAVAILABLE within ``keepalive_s + keepalive_timeout_s``, so they are resubmitted
    elsewhere instead of waiting out ``execute_timeout_s``. (gRPC's ping ack timeout,
    ``ping_timeout_ms``, defaults to a minute and overrides the keepalive timeout: both are set.)
    Servers accept pings that often without data frames (a decode sends none for seconds)."""
    ping_ms, timeout_ms = int(config.keepalive_s * 1000), int(config.keepalive_timeout_s * 1000)
    return [("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", ping_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms), ("grpc.http2.max_pings_without_data", 0),
            # the server side: never refuse a client's pings as too many (GOAWAY "too_many_pings")
            ("grpc.http2.min_recv_ping_interval_without_data_ms", max(1, ping_ms // 2)),
            ("grpc.http2.max_ping_strikes", 0),
            # a restarted peer (a Coordinator back on its address) is found within a second, not gRPC's
            # default back-off of up to two minutes. (Not min_reconnect_backoff_ms: gRPC also takes it
            # as the connect timeout, and a TLS handshake on a busy host takes longer than 100 ms.)
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]


def _bind(server, host: str, port: int, tls) -> int:
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, tls.server_credentials()) if tls is not None \
            else server.add_insecure_port(address)
    except RuntimeError:  # grpc raises instead of returning 0 on some failures
        bound = 0
    if bound == 0:
        raise ClusterError(f"cannot listen on {address}")
    return bound


def create_server(host: str, port: int, token: str | None, config: ClusterConfig, threads: int = 16,
                  tls=None, insecure: bool = False) -> tuple[grpc.Server, int]:
    """A gRPC server bound to ``host:port`` (0 picks a free port), with the token interceptor when
    a token is set, TLS when ``tls`` (a ``Tls``) is given, and message-size limits. Beyond
    loopback it needs a token, and TLS unless ``insecure``. Returns ``(server, port)``; the caller
    adds servicers and calls ``start()``."""
    check_bind(host, token, tls, insecure)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="helix-rpc"),
                         interceptors=[TokenInterceptor(token)] if token else [],
                         options=channel_options(config))
    return server, _bind(server, host, port, tls)


def create_aio_server(host: str, port: int, token: str | None, config: ClusterConfig, tls=None,
                      insecure: bool = False):
    """``create_server`` for an asyncio service (grpc.aio; call it inside the running loop)."""
    check_bind(host, token, tls, insecure)
    server = grpc.aio.server(interceptors=[AioTokenInterceptor(token)] if token else [],
                             options=channel_options(config))
    return server, _bind(server, host, port, tls)


def connect(address: str, config: ClusterConfig, tls=None) -> grpc.Channel:
    """A channel to ``address``: TLS checked against ``tls.ca`` when ``tls`` is given."""
    if tls is not None:
        return grpc.secure_channel(address, tls.channel_credentials(), options=channel_options(config) + tls.channel_options())
    return grpc.insecure_channel(address, options=channel_options(config))


def check_hello(stub, role: str, token: str | None, timeout_s: float, what: str, tls=None) -> pb.HelloReply:
    """Call ``Hello`` and compare protocol versions; raise ``ClusterError`` naming ``what``."""
    try:
        reply = stub.Hello(pb.HelloRequest(protocol_version=PROTOCOL_VERSION, role=role),
                           timeout=timeout_s, metadata=call_metadata(token))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            hint = "" if token else ("; none was passed, and this user's private Helix folder holds none for this "
                                     "address (its Coordinator runs under another user, or on another machine)")
            raise ClusterError(f"{what} refused the connection: {e.details()}{hint}") from None
        if tls is None:
            hint = "; if it uses TLS, set HELIX_TLS_CA, HELIX_TLS_CERT and HELIX_TLS_KEY (its CA, and a certificate it signed)"
        elif tls.cert is None:
            hint = (f"; with TLS every peer presents a certificate: give {tls.names[0]} and {tls.names[1]} "
                    "(one the cluster's CA signed)")
        else:
            hint = (f"; with TLS: is its certificate signed by the CA in {tls.names[2]} and made for this address, "
                    "and ours by its CA?")
        raise ClusterError(f"cannot reach {what}: {e.code().name} {e.details()}{hint}") from None
    if reply.protocol_version != PROTOCOL_VERSION:
        raise ClusterError(f"{what} speaks Helix protocol {reply.protocol_version}, this client "
                           f"{PROTOCOL_VERSION}: install the same Helix version everywhere")
    return reply
