"""Which storage errors are worth another try: a 5xx or 429, a timeout, a reset or refused
connection. A missing object (404), a refused request (403) and anything else are final."""

from __future__ import annotations

import errno

__all__ = ["is_transient", "describe"]

_TRANSIENT_ERRNO = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE}


def _status(e: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        v = getattr(e, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v
    resp = getattr(e, "response", None)  # botocore's ClientError
    if isinstance(resp, dict):
        v = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(v, int):
            return v
    return None


def is_transient(e: BaseException) -> bool:
    """True for an error a later try may not meet (server busy, network flake, timeout)."""
    cause = e.__cause__
    if isinstance(e, FileNotFoundError) and cause is not None and cause is not e:
        return is_transient(cause)  # fsspec's HTTP info says "not found" for a 503 it met
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (TimeoutError, ConnectionError)):
        return True
    status = _status(e)
    if status is not None:
        return status >= 500 or status == 429
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO:
        return True
    name = type(e).__name__
    if name in (
        "FSTimeoutError",
        "ServerDisconnectedError",
        "ClientConnectorError",
        "ClientOSError",
        "ClientPayloadError",
        "EndpointConnectionError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ConnectionClosedError",
        "IncompleteReadError",
        "ResponseStreamingError",
    ):
        return True
    cause = e.__cause__ or e.__context__
    return cause is not None and cause is not e and is_transient(cause)


def describe(e: BaseException) -> str:
    """A short cause for an error message (no credentials: fsspec's errors carry none)."""
    if isinstance(e, FileNotFoundError):
        if e.__cause__ is not None and _status(e.__cause__) not in (None, 404):
            return describe(e.__cause__)
        return "object not found (404 or no such key)"
    status = _status(e)
    text = str(e).strip() or type(e).__name__
    if isinstance(e, PermissionError) or status in (401, 403):  # fsspec's HTTP raises aiohttp's error as is
        return f"access refused ({status or 403}: check the credentials in the environment): {text}"
    return f"HTTP {status}: {text}" if status is not None and str(status) not in text else text
