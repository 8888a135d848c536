"""Who holds a loopback port: the one check before this user's token goes to one.

A loopback port is anyone's to take: once this user's Coordinator or DataServer stops, another local
user may bind its port, and a channel that gRPC reconnects in the background (or a new one) would
hand that user the token, and take its replies for pickles to load. So before anything carrying
the token goes to a loopback port, the kernel is asked who holds it: every TCP socket whose local
port it is (the listener, and the connections it accepted, which inherit its owner) must belong to
this user or to root. ``TokenGuard`` (``rpc.connect`` puts one on every loopback channel) asks
before each call that carries ``helix-token``, so a call on a connection made before the port changed hands, at
first connect or after any reconnect, never leaves; a refused call fails with UNAVAILABLE (the
server is gone) and nothing is sent. ``check_socket`` asks the same of one connected socket (a raw
TCP connection: the bulk path).

Per call the question is one netlink ``sock_diag`` lookup of the port's listener, its owner and
inode (a hash lookup in the kernel, on a netlink socket each thread keeps). A listener not seen
before (the first call, a restarted server) is checked in full: every socket holding the port, by
a dump the kernel filters to that port (it walks the whole table: only then). Where netlink is
refused, ``/proc/net/tcp`` and ``/proc/net/tcp6`` are read instead, whole, at every call.
What is left: a listener that changes hands between the question and gRPC's connect (its owner
must die in those microseconds, and another user bind at once). A loopback port whose listener
this network namespace does not see (a port forwarded into a container) gets no token.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import socket
import struct
import threading

import grpc

from helix_core.security.auth import TOKEN_METADATA, is_loopback

__all__ = ["ForeignListener", "TokenGuard", "check_listener", "check_socket", "guard", "port_owners"]

log = logging.getLogger("helix.auth")

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20  # one socket, looked up by its addresses
_TCPDIAG_GETSOCK = 18  # the first request form: its dump answers for IPv4 and IPv6 sockets alike
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_BC_S_GE, _BC_S_LE = 2, 3  # inet_diag bytecode: source port >= / <=
_ALL_STATES, _LISTEN = 0xFFF, 10
_OWNERLESS = (6, 12)  # TIME_WAIT and NEW_SYN_RECV sockets report no owner (uid 0)
_HDR = struct.Struct("=IHHII")
_DIAG_MSG = struct.Struct("=BBBB48sIIIII")  # inet_diag_msg: ..., sockid, expires, queues, uid, inode
_NO_COOKIE = struct.pack("=II", 0xFFFFFFFF, 0xFFFFFFFF)


class ForeignListener(ValueError):
    """A loopback port is held by another user: this user's token must not go there."""


class _NoListener(ForeignListener):
    """Nothing listens on the port (its server stopped): an outage, not an attack."""


_THREAD = threading.local()  # each thread's netlink socket, kept: opening one per call costs as much as the question


def _ask(request: bytes, dump: bool) -> list[tuple[int, int, int, int]]:
    """One sock_diag request: ``(state, local port, uid, inode)`` of each socket in the answer."""
    s = getattr(_THREAD, "sock", None)
    if s is None:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG)
        s.settimeout(1.0)
        _THREAD.sock, _THREAD.seq = s, 0
    _THREAD.seq = seq = (_THREAD.seq + 1) & 0xFFFFFFFF
    try:
        s.sendto(request[:8] + struct.pack("=I", seq) + request[12:], (0, 0))
        out = []
        while True:
            data = s.recv(65536)
            off = 0
            while off + _HDR.size <= len(data):
                length, kind, _, got_seq, _ = _HDR.unpack_from(data, off)
                if length < _HDR.size:
                    raise OSError("sock_diag: a malformed reply")
                step = (length + 3) & ~3
                if got_seq != seq:  # a late answer to an earlier question: not this one's
                    off += step
                    continue
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", data, off + _HDR.size)
                    if err == -errno.ENOENT:  # an exact lookup found no such socket
                        return out
                    raise OSError(-err, f"sock_diag: {os.strerror(-err)}")
                _, state, _, _, sockid, _, _, _, uid, inode = _DIAG_MSG.unpack_from(data, off + _HDR.size)
                out.append((state, struct.unpack_from("!H", sockid)[0], uid, inode))
                off += step
            if out and not dump:
                return out  # an exact lookup: one message, no DONE
    except BaseException:
        _THREAD.sock = None  # whatever it still holds is not read again
        s.close()
        raise


@functools.lru_cache(maxsize=1024)
def _lookup_request(family: int, local: str, port: int, remote: str | None, remote_port: int) -> bytes:
    src, dst = socket.inet_pton(family, local), socket.inet_pton(family, remote or local)
    body = (
        struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES)
        + struct.pack("!HH", port, remote_port)
        + src.ljust(16, b"\0")
        + dst.ljust(16, b"\0")
        + struct.pack("=I", 0)
        + _NO_COOKIE
    )
    return _HDR.pack(_HDR.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + body


def _lookup(family: int, local: str, port: int, remote: str | None = None, remote_port: int = 0):
    """``(uid, inode)`` of the socket that owns ``local:port`` (for ``remote:remote_port``): with
    no remote, the listener a new connection to it reaches now; None if there is none."""
    got = _ask(_lookup_request(family, local, port, remote, remote_port), False)
    if not got or (remote is None and got[0][0] != _LISTEN):
        return None
    return got[0][2], got[0][3]


def _dump_owners(port: int) -> set[int]:
    """The uids of every TCP socket (both families) whose local port is ``port``: the listener and
    the connections it accepted, which keep its owner after it closed. A dump walks the kernel's
    whole table, so it runs only when a port's listener is new."""
    body = struct.pack("=BBBB48sII", 0, 0, 0, 0, b"", _ALL_STATES, 0)
    # "source port >= port, and <= port"; a jump to the end + 4 rejects the socket
    code = struct.pack("=BBHBBH", _BC_S_GE, 8, 20, 0, 0, port) + struct.pack("=BBHBBH", _BC_S_LE, 8, 12, 0, 0, port)
    body += struct.pack("=HH", 4 + len(code), 1) + code  # INET_DIAG_REQ_BYTECODE
    got = _ask(_HDR.pack(_HDR.size + len(body), _TCPDIAG_GETSOCK, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + body, True)
    # the kernel filtered by port already; a kernel that ignored the filter listed every socket
    return {uid for state, local_port, uid, _ in got if local_port == port and state not in _OWNERLESS}


def _proc_sockets(port: int) -> list[tuple[int, int, int]]:
    """``(state, uid, inode)`` of the sockets whose local port is ``port``, from ``/proc/net/tcp*``."""
    out, read = [], False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        out.append((int(cols[3], 16), int(cols[7]), int(cols[9])))
            read = True
        except (OSError, ValueError, IndexError):
            continue
    if not read:
        raise OSError("neither sock_diag nor /proc/net/tcp answers")
    return out


_NETLINK = [True]  # False once the kernel refused it: /proc from then on
_REFUSALS = {errno.EPERM, errno.EACCES, errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EINVAL, errno.EOPNOTSUPP}


def _no_netlink(e: OSError) -> None:
    """Fall back to ``/proc`` for good where the kernel refuses sock_diag; re-raise anything else
    (a timeout on a busy host: this one question goes unanswered, and its call with it)."""
    if e.errno not in _REFUSALS:
        raise e
    log.warning("sock_diag refused (%s): reading /proc/net/tcp instead (slower)", e)
    _NETLINK[0] = False


def port_owners(port: int) -> set[int]:
    """The uids owning the TCP sockets whose local port is ``port`` here (listeners and the
    connections they accepted; sockets in TIME_WAIT belong to nobody); ``OSError`` if neither
    the kernel nor ``/proc`` says."""
    if _NETLINK[0]:
        try:
            return _dump_owners(port)
        except OSError as e:
            _no_netlink(e)
    return {uid for state, uid, _ in _proc_sockets(port) if state not in _OWNERLESS}


def _listener(family: int, ip: str, port: int):
    """``(uid, inode)`` of the listener a connection to ``ip:port`` reaches now, or None."""
    if _NETLINK[0]:
        try:
            return _lookup(family, ip, port)
        except OSError as e:
            _no_netlink(e)
    listening = [(uid, inode) for state, uid, inode in _proc_sockets(port) if state == _LISTEN]
    return listening[0] if listening else None


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _loopback_targets(host: str) -> list[tuple[int, str]]:
    """Where a connection to ``host`` lands on this machine, if it stays on it: ``[(family, ip)]``
    (empty beyond loopback: TLS checks the peer there)."""
    if host in ("", "0.0.0.0"):
        return [(socket.AF_INET, "127.0.0.1")]
    if host == "::":
        return [(socket.AF_INET6, "::1")]
    if host == "localhost":
        return [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
    if not is_loopback(host):
        return []
    return [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)]


def _refuse(where: str, why: str) -> ForeignListener:
    return ForeignListener(f"{where} {why}: refusing to send it this user's Helix token")


def _check_port(where: str, port: int) -> None:
    """``ForeignListener`` unless every socket holding ``port`` is this user's (or root's)."""
    try:
        owners = port_owners(port)
    except OSError as e:
        raise _refuse(where, f"cannot be checked ({e})") from None
    foreign = sorted(owners - {os.getuid(), 0})
    if foreign:
        raise _refuse(
            where,
            f"is listened on by uid {foreign[0]}, not this user ({os.getuid()}): its server stopped "
            "and another user took the port",
        )


def check_listener(address: str) -> None:
    """``ForeignListener`` (a ``ValueError``) if the loopback port of ``address`` ("host:port") is
    held by another user than this one (or root); nothing to check beyond loopback (TLS checks the
    peer there), nor where nothing listens (nothing to send to)."""
    host, port = _split(address)
    if _loopback_targets(host):
        _check_port(address, port)


def check_socket(sock: socket.socket) -> None:
    """``check_listener`` for a connected TCP socket, before the token goes on it: the socket that
    accepted this very connection must be this user's (or root's)."""
    peer, local = sock.getpeername(), sock.getsockname()
    if not _loopback_targets(peer[0]):
        return
    where = f"{peer[0]}:{peer[1]}"
    try:
        if _NETLINK[0]:
            got = _lookup(sock.family, peer[0], peer[1], local[0], local[1])
            uids = set() if got is None else {got[0]}
        else:
            uids = port_owners(peer[1])
    except OSError as e:
        raise _refuse(where, f"cannot be checked ({e})") from None
    if not uids:
        raise _refuse(where, "has no socket for this connection (it closed)")
    foreign = sorted(uids - {os.getuid(), 0})
    if foreign:
        raise _refuse(where, f"is listened on by uid {foreign[0]}, not this user ({os.getuid()})")


class _Refused(grpc.RpcError, grpc.Call, grpc.Future):
    """A call the guard stopped before it left: UNAVAILABLE, as a server that is gone."""

    def __init__(self, why: str):
        super().__init__(why)
        self._why = why

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return self._why

    def initial_metadata(self):
        return None

    def trailing_metadata(self):
        return None

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def add_callback(self, callback):
        return False

    def cancel(self):
        return False

    def cancelled(self):
        return False

    def running(self):
        return False

    def done(self):
        return True

    def result(self, timeout=None):
        raise self

    def exception(self, timeout=None):
        return self

    def traceback(self, timeout=None):
        return None

    def add_done_callback(self, fn):
        fn(self)

    def __iter__(self):
        return self

    def __next__(self):
        raise self


class TokenGuard:
    """The check of a channel to the loopback ``address``: a call that carries the Helix token goes
    only while the port's listener is this user's (or root's), asked anew for every call (one
    sock_diag lookup). A listener not seen before (the first call, a restarted server) is checked
    in full first (``check_listener``: the connections an earlier listener accepted too, one of
    which gRPC may still hold). Otherwise the call fails at once with UNAVAILABLE, as for a
    server that is gone, and nothing is sent."""

    def __init__(self, address: str):
        host, self._port = _split(address)
        self.address, self._targets = address, _loopback_targets(host)
        self._verified: tuple = ()  # inodes of the listeners last checked in full
        self._warned: set[str] = set()

    def check(self) -> None:
        """``ForeignListener`` unless this user's token may go to ``address`` now."""
        found = []
        for family, ip in self._targets:
            got = _listener(family, ip, self._port)
            if got is not None:
                found.append(got)
        if not found:  # nothing listens: a call could only ride a connection to a listener gone since
            raise _NoListener(f"{self.address} has no listener (its server stopped)")
        foreign = sorted(uid for uid, _ in found if uid not in (os.getuid(), 0))
        if foreign:
            raise _refuse(
                self.address,
                f"is listened on by uid {foreign[0]}, not this user ({os.getuid()}): its "
                "server stopped and another user took the port",
            )
        inodes = tuple(inode for _, inode in found)
        if inodes != self._verified:
            _check_port(self.address, self._port)
            self._verified = inodes

    def refusal(self, metadata) -> _Refused | None:
        """None if a call with ``metadata`` may go; else the failed call to return or raise."""
        if not any(k == TOKEN_METADATA for k, _ in metadata or ()):
            return None
        try:
            self.check()
        except (ForeignListener, OSError) as e:  # a lookup that failed (a busy netlink, EINTR) refuses too
            why = str(e) if isinstance(e, ForeignListener) else str(_refuse(self.address, f"cannot be checked ({e})"))
            if not isinstance(e, _NoListener) and why not in self._warned:  # once per cause, not per call
                self._warned.add(why)
                log.warning("%s", why)
            return _Refused(why)
        return None


class _Guarded:
    """A multi-callable of a guarded channel: the channel's own (made once, as gRPC's stubs do),
    with ``TokenGuard.refusal`` before each call."""

    def __init__(self, inner, guard: TokenGuard):
        self._inner, self._guard = inner, guard

    def __call__(self, request, timeout=None, metadata=None, **kw):
        refused = self._guard.refusal(metadata)
        if refused is not None:
            if isinstance(self._inner, (grpc.UnaryStreamMultiCallable, grpc.StreamStreamMultiCallable)):
                return refused  # a stream: its iteration raises
            raise refused
        return self._inner(request, timeout=timeout, metadata=metadata, **kw)

    def with_call(self, request, timeout=None, metadata=None, **kw):
        refused = self._guard.refusal(metadata)
        if refused is not None:
            raise refused
        return self._inner.with_call(request, timeout=timeout, metadata=metadata, **kw)

    def future(self, request, timeout=None, metadata=None, **kw):
        refused = self._guard.refusal(metadata)
        return refused if refused is not None else self._inner.future(request, timeout=timeout, metadata=metadata, **kw)


class _GuardedChannel(grpc.Channel):
    """A channel whose calls carrying the token pass a ``TokenGuard`` first. (Not gRPC's own
    interceptors: those make the method's multi-callable anew for every call, which gRPC does not
    make thread-safe, and which crashes when it meets the channel's ``close``.)"""

    def __init__(self, channel: grpc.Channel, guard: TokenGuard):
        self._channel, self.guard = channel, guard

    def subscribe(self, callback, try_to_connect=False):
        self._channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        self._channel.unsubscribe(callback)

    def unary_unary(self, method, *args, **kw):
        return _Guarded(self._channel.unary_unary(method, *args, **kw), self.guard)

    def unary_stream(self, method, *args, **kw):
        return _Guarded(self._channel.unary_stream(method, *args, **kw), self.guard)

    def stream_unary(self, method, *args, **kw):
        return _Guarded(self._channel.stream_unary(method, *args, **kw), self.guard)

    def stream_stream(self, method, *args, **kw):
        return _Guarded(self._channel.stream_stream(method, *args, **kw), self.guard)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._channel.close()
        return False


def guard(channel: grpc.Channel, address: str) -> grpc.Channel:
    """``channel`` to ``address`` with a ``TokenGuard`` where ``address`` is on loopback (beyond
    it, TLS checks the peer: the channel is returned as it is)."""
    host, _ = _split(address)
    return _GuardedChannel(channel, TokenGuard(address)) if _loopback_targets(host) else channel
