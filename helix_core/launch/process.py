"""Process entry points for the Coordinator and DataServers.

``python -m helix_core.launch.process coordinator|dataserver ...`` is what ``LocalCluster`` and
``helix coordinator`` / ``helix dataserver`` run. A process started by a LocalCluster prints one
ready line (``HELIX_READY {json}``) on stdout, logs to stderr only, and stops when its owner's
pipe (stdin) closes — so nothing outlives a crashed or interrupted training process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from helix_core.config import ClusterConfig
from helix_core.errors import ClusterError
from helix_core.security.tls import Tls
from helix_core.security.tokenfiles import load_token

__all__ = ["main"]

READY = "HELIX_READY"


def _watch_parent(stop: threading.Event) -> None:
    """Set ``stop`` when stdin (the owner's pipe) reaches EOF."""

    def run():
        try:
            while sys.stdin.buffer.read(1):
                pass
        except (OSError, ValueError):
            pass
        stop.set()

    threading.Thread(target=run, name="helix-parent-watch", daemon=True).start()


def _ready(info: dict) -> None:
    sys.stdout.write(f"{READY} {json.dumps(info)}\n")
    sys.stdout.flush()


def await_coordinator(
    coordinator: str,
    token_file: str | None,
    timeout_s: float,
    config: ClusterConfig,
    tls,
    stop: threading.Event,
    clock=time.monotonic,
) -> str | None:
    """The token for the Coordinator at ``coordinator``, once that Coordinator can be reached — up to
    ``timeout_s`` seconds of waiting for it (and for the token file it writes) when it is not up
    yet, saying once on stderr what it waits for; then what ``load_token`` has (None, or a
    ``ValueError``), so the caller fails with the error it would give at once. Sends no token while
    it waits: it only connects."""
    import grpc

    from helix_core.security.tokenfiles import token_path
    from helix_core.wire.rpc import connect

    deadline, said = clock() + timeout_s, set()

    def say(what: str) -> None:
        if what not in said:
            said.add(what)
            print(f"waiting up to {timeout_s:g} s for {what}", file=sys.stderr, flush=True)

    while True:  # the token: a file that appears (nothing to block on: looked at 5 times a second)
        try:
            token = load_token(token_file=token_file, coordinator=coordinator)
        except ValueError:  # a file not written yet is waited for; one we may not use is an error at once
            if token_file is None or os.path.lexists(token_file) or clock() >= deadline:
                raise
            token = None
        if token or clock() >= deadline or stop.is_set():
            break
        say(
            f"the token file {token_file}"
            if token_file
            else f"the Coordinator at {coordinator} to write its token ({token_path(coordinator)})"
        )
        stop.wait(0.2)
    if not token or stop.is_set():
        return token
    channel = connect(coordinator, config, tls, keepalive=False)
    try:  # the Coordinator itself (gRPC connects, and reconnects, by itself)
        ready = grpc.channel_ready_future(channel)
        while not stop.is_set() and clock() < deadline:
            try:
                ready.result(timeout=min(0.5, max(0.0, deadline - clock())))
                break
            except grpc.FutureTimeoutError:
                say(f"the Coordinator at {coordinator} to answer")
        ready.cancel()
    finally:
        channel.close()
    return token


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helix")
    sub = p.add_subparsers(dest="role", required=True)
    c = sub.add_parser("coordinator")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=7070)
    c.add_argument("--scheduler", default="deadline", help="placement policy of requests that name none")
    c.add_argument("--cluster-id", default=None)
    d = sub.add_parser("dataserver")
    d.add_argument("--coordinator", required=True)
    g = d.add_mutually_exclusive_group(required=True)
    g.add_argument("--local-rank", type=int)
    g.add_argument("--remote", action="store_true")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=0)
    d.add_argument(
        "--advertise",
        default=None,
        help="the host name or address peers dial this server by (default: --host; its FQDN for 0.0.0.0)",
    )
    d.add_argument(
        "--connect-timeout-s",
        type=float,
        default=60.0,
        help="how long to wait for the Coordinator (and the token file it writes) when it is not up yet: "
        "services may start in any order",
    )
    d.add_argument(
        "--host-id",
        default=None,
        help="this host's identity (default: HELIX_HOST_ID, else hostname + boot id); "
        "local servers serve the ranks of their own host only",
    )
    for s in (c, d):
        s.add_argument(
            "--token-file",
            default=None,
            help="file holding the token (or set HELIX_TOKEN; default: the one this user's Coordinator "
            "left in the private Helix folder, made by a Coordinator started without one)",
        )
        s.add_argument("--tls-cert", default=None, help="PEM certificate (chain) of this service (or HELIX_TLS_CERT)")
        s.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (or HELIX_TLS_KEY)")
        s.add_argument(
            "--tls-ca", default=None, help="PEM CA that peers' certificates are checked against (or HELIX_TLS_CA)"
        )
        s.add_argument(
            "--insecure",
            action="store_true",
            help="listen beyond loopback without TLS (a warning; pickled data is then refused)",
        )
        s.add_argument("--config-json", default=None, help="ClusterConfig fields as JSON")
        s.add_argument("--owned", action="store_true", help="stop when stdin closes (started by a LocalCluster)")
        s.add_argument("--log-level", default="WARNING")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.owned:
        _watch_parent(stop)
    try:
        config = ClusterConfig(**json.loads(args.config_json)) if args.config_json else ClusterConfig()
        tls = (
            Tls.from_files(args.tls_cert, args.tls_key, args.tls_ca)
            if (args.tls_cert or args.tls_key or args.tls_ca)
            else Tls.from_env()
        )
        if args.role == "dataserver":
            if not args.connect_timeout_s >= 0:
                raise ValueError(f"--connect-timeout-s must be >= 0 seconds, got {args.connect_timeout_s}")
            token = await_coordinator(args.coordinator, args.token_file, args.connect_timeout_s, config, tls, stop)
        else:
            token = load_token(token_file=args.token_file)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if stop.is_set():
        return 0
    try:
        if args.role == "coordinator":
            from helix_core.coordinator.service import serve_coordinator

            serve_coordinator(
                args.host,
                args.port,
                token,
                config,
                args.scheduler,
                stop,
                on_ready=lambda addr, cid: _ready({"address": addr, "cluster_id": cid, "pid": os.getpid()}),
                cluster_id=args.cluster_id,
                tls=tls,
                insecure=args.insecure,
            )
        else:
            from helix_core.server.serve import serve_dataserver

            kind = "remote" if args.remote else "local"
            serve_dataserver(
                args.coordinator,
                kind,
                -1 if args.remote else args.local_rank,
                args.workers,
                token,
                config,
                stop,
                host=args.host,
                port=args.port,
                host_id=args.host_id,
                tls=tls,
                insecure=args.insecure,
                advertise=args.advertise,
                on_ready=lambda addr, sid, cid: _ready(
                    {"address": addr, "server_id": sid, "cluster_id": cid, "pid": os.getpid()}
                ),
            )
    except (ValueError, ClusterError) as e:  # a non-loopback address without a token, no Coordinator, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the stdin watcher is a daemon thread blocked in read(): interpreter shutdown would abort on
    # its buffer lock (SIGABRT instead of this exit code); everything that needs stopping has stopped
    os._exit(code)
