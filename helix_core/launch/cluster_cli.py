"""``helix status``, ``helix certs``, ``helix sidecars``: the commands of a running cluster."""

from __future__ import annotations

import os

__all__ = ["add_cluster_commands"]


def _cmd_status(a, console) -> int:
    """What a running cluster's Coordinator knows: its hosts, their servers, the sidecars, the clients."""
    import json

    from rich.table import Table

    from helix_core.config import ClusterConfig
    from helix_core.security.auth import call_metadata
    from helix_core.security.tls import Tls
    from helix_core.security.tokenfiles import load_token
    from helix_core.wire.proto import helix_pb2 as pb
    from helix_core.wire.proto import helix_pb2_grpc as pbg
    from helix_core.wire.rpc import check_hello, connect

    token, config, tls = load_token(token_file=a.token_file, coordinator=a.coordinator), ClusterConfig(), Tls.from_env()
    channel = connect(a.coordinator, config, tls)
    try:
        stub = pbg.CoordinatorStub(channel)
        check_hello(stub, "client", token, config.rpc_timeout_s, f"the Coordinator at {a.coordinator}", tls)
        info = json.loads(
            stub.Telemetry(
                pb.TelemetryRequest(last_decisions=0), timeout=config.rpc_timeout_s, metadata=call_metadata(token)
            ).json
        )
    finally:
        channel.close()
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    table = Table(title=f"cluster {info['cluster_id']} at {a.coordinator}: {info['routed']} requests routed")
    for col in (
        "server",
        "kind",
        "host",
        "local rank",
        "address",
        "workers",
        "alive",
        "completed",
        "cross-DS MB",
        "of it bulk MB",
        "storage MB/s + ms/sample",
    ):
        table.add_column(col, overflow="fold")
    for s in info["servers"]:
        table.add_row(
            s["server_id"],
            s["kind"],
            s["host"],
            str(s["local_rank"]) if s["kind"] == "local" else "",
            s["address"],
            str(s["workers"]),
            "yes" if s["alive"] else "no",
            str(s["completed"]),
            f"{s['cross_ds_bytes'] / 1e6:.1f}",
            f"{s.get('bulk_bytes', 0) / 1e6:.1f}",
            _storage(s),
        )
    console.print(table)
    clients = sorted(info["clients"].values(), key=lambda c: c["rank"])
    console.print(
        f"{len(info['hosts'])} hosts with local servers; {len(clients)} clients: "
        + ", ".join(f"rank {c['rank']} on {c['host']}" for c in clients)
    )
    return 0


def _storage(s: dict) -> str:
    """A server's measured storage reads (samples read by URL), or "-" before any."""
    bps = s.get("storage_bandwidth_bps", 0.0)
    return f"{bps / 1e6:.1f} + {s.get('storage_latency_s', 0.0) * 1e3:.0f}" if bps > 0 else "-"


def _cmd_certs(a, console) -> int:
    from helix_core.security.tls import write_certificates

    paths = write_certificates(a.out, [x for x in a.names.split(",") if x], a.days)
    console.print(f"wrote a new CA and a certificate for {a.names}: " + ", ".join(f"{k} {v}" for k, v in paths.items()))
    console.print(
        "start each service with --tls-cert, --tls-key, --tls-ca (or set HELIX_TLS_CERT / _KEY / _CA "
        "for every process, clients included)"
    )
    return 0


def _cmd_sidecars(a, console) -> int:
    """Start sidecars on a Ray cluster and keep them until Ctrl-C / SIGTERM; then end them."""
    import json
    import signal
    import threading

    from helix_core.launch.sidecars import ray_sidecars
    from helix_core.security.tokenfiles import load_token

    try:
        resources = json.loads(a.resources) if a.resources else {}
    except ValueError as e:
        raise ValueError(f"--resources must be a JSON object of Ray resources, got {a.resources!r}: {e}") from None
    if not isinstance(resources, dict):
        raise ValueError(f"--resources must be a JSON object of Ray resources, got {a.resources!r}")
    token = load_token(token_file=a.token_file, coordinator=a.coordinator)
    with console.status(f"starting {a.count} sidecar(s) on the Ray cluster at {a.ray} ..."):
        sidecars = ray_sidecars(
            a.coordinator,
            a.count,
            a.workers,
            token,
            ray_address=a.ray,
            host=a.host,
            insecure=a.insecure,
            **({"resources": resources} if resources else {}),
        )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for s in sidecars.describe():
            console.print(f"sidecar {s['server_id']} at {s['address']} (Ray actor pid {s['actor_pid']})")
        console.print(f"{a.count} sidecar(s) joined {a.coordinator}; Ctrl-C ends them")
        stop.wait()
    finally:
        sidecars.close()
    return 0


def add_cluster_commands(sub) -> None:
    """Add the cluster's commands to ``helix``'s sub-parsers."""
    s = sub.add_parser("status", help="a running cluster's hosts, servers and clients, as its Coordinator sees them")
    s.add_argument(
        "--coordinator",
        default=os.environ.get("HELIX_COORDINATOR"),
        required="HELIX_COORDINATOR" not in os.environ,
        help="HOST:PORT (default HELIX_COORDINATOR)",
    )
    s.add_argument(
        "--token-file",
        default=None,
        help="file holding the token (or set HELIX_TOKEN; default: the one "
        "this user's Coordinator left in the private Helix folder)",
    )
    s.add_argument("--json", action="store_true", help="print the Coordinator's telemetry as JSON")
    s.set_defaults(fn=_cmd_status)
    s = sub.add_parser("sidecars", help="sidecars as Ray actors joining a Coordinator (until Ctrl-C)")
    s.add_argument("--ray", required=True, help="the Ray cluster's address (e.g. HEAD:6379, or auto)")
    s.add_argument("--coordinator", required=True, help="HOST:PORT of the Helix Coordinator to join")
    s.add_argument("--count", type=int, required=True, help="sidecars to start")
    s.add_argument("--workers", type=int, required=True, help="worker processes per sidecar (CPUs it reserves)")
    s.add_argument(
        "--token-file",
        default=None,
        help="file holding the cluster's token (or set HELIX_TOKEN; default: "
        "the one this user's Coordinator left in the private Helix folder)",
    )
    s.add_argument("--resources", default=None, help='extra Ray resources per sidecar as JSON, e.g. {"cpu_node": 1}')
    s.add_argument(
        "--host",
        default=None,
        help="address each sidecar listens on (default: its node's interface toward "
        "the Coordinator: loopback for a loopback Coordinator)",
    )
    s.add_argument(
        "--insecure", action="store_true", help="listen beyond loopback without TLS (see --tls-* of dataserver)"
    )
    s.set_defaults(fn=_cmd_sidecars)
    s = sub.add_parser("certs", help="make a CA and a certificate for a cluster's hosts (TLS across hosts)")
    s.add_argument("out", help="folder for tls-ca.pem, tls-cert.pem, tls-key.pem")
    s.add_argument(
        "--names", required=True, help="comma-separated host names and IP addresses the services are dialled by"
    )
    s.add_argument("--days", type=int, default=365, help="how long the CA and certificate are valid")
    s.set_defaults(fn=_cmd_certs)
