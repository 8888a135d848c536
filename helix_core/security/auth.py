"""Token authentication: a server interceptor checks every RPC; clients attach the token.

Every cluster has a token: a Coordinator started on loopback without one makes one and leaves
it in the user's private Helix folder for the same user's processes (``tokenfiles``, which also
says where a process finds its token). Services bind 127.0.0.1 unless told otherwise; any other
address needs a token given to it and TLS (or ``--insecure``). Pickled payloads travel only with a
token and where it can't be read off the wire: loopback, or TLS.

This module is the bottom of ``security/``: ``listeners`` (who may receive the token on a loopback
port) and ``tokenfiles`` build on it, and it imports neither.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets

import grpc

log = logging.getLogger("helix.auth")
__all__ = [
    "AioTokenInterceptor",
    "TOKEN_METADATA",
    "TokenInterceptor",
    "call_metadata",
    "check_bind",
    "is_loopback",
    "new_token",
    "pickle_allowed",
]

TOKEN_METADATA = "helix-token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 reaches loopback too
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def check_bind(host: str, token: str | None, tls=None, insecure: bool = False) -> None:
    """Refuse to listen without a token, and beyond loopback without TLS unless ``insecure``."""
    if not token and is_loopback(host):
        raise ValueError(
            f"a Helix service on {host} needs a token (every cluster has one: a Coordinator started "
            "without one makes one)"
        )
    if is_loopback(host):
        return
    if not token:
        raise ValueError(
            f"listening on {host} needs a token: pass --token-file FILE or set HELIX_TOKEN "
            "(without one Helix only binds 127.0.0.1)"
        )
    if tls is None and not insecure:
        raise ValueError(
            f"listening on {host} needs TLS (--tls-cert, --tls-key, --tls-ca or HELIX_TLS_CERT / _KEY / "
            "_CA): the token would cross the network in clear text. --insecure runs without it "
            "(and then accepts no pickled data)"
        )
    if tls is None:
        log.warning(
            "listening on %s without TLS (--insecure): the token crosses the network in clear text; "
            "pickled datasets and batches are refused",
            host,
        )


def pickle_allowed(host: str, token: str | None, tls=None, allowed: bool = True) -> bool:
    """Whether a service (or a client, by the address it dials) may exchange pickled data: only
    with a token, only where the token can't be read off the wire (loopback, or TLS), and only if
    the cluster allows it (``ClusterConfig.allow_pickle``)."""
    return allowed and bool(token) and (tls is not None or is_loopback(host))


def call_metadata(token: str | None) -> tuple:
    return ((TOKEN_METADATA, token),) if token else ()


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects, with UNAUTHENTICATED and at once, any call without the right token."""

    def __init__(self, token: str):
        self._token = token.encode()

        def deny(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong Helix token (pass token=... or set HELIX_TOKEN)"
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        got = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        if hmac.compare_digest(got.encode(), self._token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.request_streaming:
            return self._deny_stream
        return self._deny_unary


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """``TokenInterceptor`` for grpc.aio services (the Coordinator)."""

    def __init__(self, token: str):
        self._token = token.encode()

        async def deny(request, context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong Helix token (pass token=... or set HELIX_TOKEN)"
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        got = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        if hmac.compare_digest(got.encode(), self._token):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.request_streaming:
            return self._deny_stream
        return self._deny_unary
