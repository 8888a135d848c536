"""Where a DataServer process is put together (the composition root): ``serve_dataserver`` builds
its slabs, CPU slots, worker pool, the ``DataServer``, its gRPC adapter and its listeners (the
bulk path, the local link), registers with the Coordinator, heartbeats, and closes each part it
built when ``stop`` is set. Each part gets what it needs in its constructor.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from helix_core.config import ClusterConfig
from helix_core.memory import shm
from helix_core.memory.slabpool import SlabPool
from helix_core.security.auth import call_metadata, is_loopback, pickle_allowed
from helix_core.security.hostid import host_id as this_host
from helix_core.security.listeners import check_listener as check_coordinator
from helix_core.security.tokenfiles import token_path
from helix_core.server.cpuslots import HostSlots
from helix_core.server.dataserver import DataServer
from helix_core.server.heartbeats import heartbeats
from helix_core.server.pool import WorkerPool
from helix_core.server.service import DataServerServicer, release_unsent
from helix_core.tier2.crosshost import load_row_code
from helix_core.wire.bulk.recv import BulkListener
from helix_core.wire.frames import add_servicer
from helix_core.wire.locallink.link import link_name
from helix_core.wire.locallink.server import LocalListener
from helix_core.wire.messages import slab_handle_pb
from helix_core.wire.proto import helix_pb2 as pb
from helix_core.wire.proto import helix_pb2_grpc as pbg
from helix_core.wire.rpc import check_hello, connect, create_server

__all__ = ["serve_dataserver"]

log = logging.getLogger("helix.dataserver")


def _round_committer(coord: pbg.CoordinatorStub, token: str | None, config: ClusterConfig):
    """Tier 2's ``commit``: a moved round recorded at the Coordinator before a rank sees it."""

    def commit_round(group: str, run: str, step: int, moved: dict, release: dict, age_s: float) -> bool:
        # (a port another user took once the Coordinator stopped gets no token: rpc.connect's guard)
        ranks = [
            pb.RankSamples(rank=r, indices=v, release=[slab_handle_pb(h) for h in release.get(r, ())])
            for r, v in moved.items()
        ]
        return coord.CommitRound(
            pb.CommitRoundRequest(group=group, run=run, step=step, ranks=ranks, age_s=age_s),
            timeout=config.rpc_timeout_s,
            metadata=call_metadata(token),
        ).committed

    return commit_round


def serve_dataserver(
    coordinator: str,
    kind: str,
    local_rank: int,
    workers: int,
    token: str | None,
    config: ClusterConfig,
    stop: threading.Event,
    host: str = "127.0.0.1",
    port: int = 0,
    on_ready=None,
    host_id: str | None = None,
    tls=None,
    insecure: bool = False,
    advertise: str | None = None,
) -> None:
    """Run a DataServer until ``stop`` is set (blocking): serve, register, heartbeat. ``host``:
    the address to listen on; ``host_id``: this host's identity (default ``hostid.host_id()``);
    ``tls``: a ``Tls`` for its port and its channels; ``insecure``: beyond loopback without TLS;
    ``advertise``: the name peers dial it by (default ``host``, or the FQDN when ``host`` is a wildcard)."""
    check_coordinator(coordinator)  # never this user's token to another user's port
    if not token:
        raise ValueError(
            f"no token for the Coordinator at {coordinator}: pass --token-file FILE or set HELIX_TOKEN "
            f"(a Coordinator this user started on this machine leaves it in {token_path(coordinator)})"
        )
    host_id = this_host(host_id)
    if not is_loopback(host):  # reachable from other hosts: Tier-2 rows may cross (torch), loaded before it serves
        load_row_code()  # (in the background it held the GIL for seconds: heartbeats missed, the server marked dead)
    server, bound = create_server(host, port, token, config, threads=config.server_threads, tls=tls, insecure=insecure)
    allow_pickle = pickle_allowed(host, token, tls, config.allow_pickle)
    coord_channel = connect(coordinator, config, tls, keepalive=False)  # heartbeats: short calls with deadlines
    coord = pbg.CoordinatorStub(coord_channel)
    hello = check_hello(coord, "dataserver", token, config.rpc_timeout_s, f"the Coordinator at {coordinator}", tls)
    # bound to every interface: peers need a name that reaches this machine, not the wildcard
    address = f"{advertise or (socket.getfqdn() if host in ('0.0.0.0', '::', '') else host)}:{bound}"
    tag = f"{kind[0]}{local_rank if kind == 'local' else ''}p{os.getpid()}-"
    slabs = SlabPool(
        f"helix-{hello.cluster_id}-{tag}d-",
        orphan_s=config.execute_timeout_s + config.rpc_timeout_s,
        idle_s=config.slab_idle_s,
    )
    slots = config.decode_slots or os.cpu_count() or 1  # one decode per core, across the host's servers
    host_slots = HostSlots(f"helix-{hello.cluster_id}-cpu")  # the last server of the host unlinks them
    try:
        pool = WorkerPool(
            workers,
            f"helix-{hello.cluster_id}-{tag}",
            allow_pickle=allow_pickle,
            config=config,
            cpu_slots=(f"helix-{hello.cluster_id}-cpu", slots),
        )
    except BaseException:
        host_slots.close()
        raise
    dataserver = DataServer(
        pool,
        slabs,
        config,
        token,
        address,
        kind,
        tls,
        allow_pickle,
        host_id,
        cluster_id=hello.cluster_id,
        commit=_round_committer(coord, token, config),  # Tier 2: a moved round is recorded before a rank sees it
    )
    # a local server takes remote batches by the bulk path too, on the host it serves gRPC on
    bulk = (
        BulkListener(host, token, config, tls, dataserver.take_bulk)
        if kind == "local" and config.bulk_delivery
        else None
    )
    servicer = DataServerServicer(dataserver, bulk_port=bulk.port if bulk is not None else 0)
    link = None  # the ranks of its host send Execute over a Unix socket (the bulk of its calls)
    if kind == "local" and config.local_link:
        try:
            link = LocalListener(
                link_name(hello.cluster_id, address),
                token,
                servicer.Execute,
                config.execute_timeout_s,
                config.server_threads,
                unsent=release_unsent,
            )
        except OSError as e:  # its name taken: the ranks use gRPC
            log.warning("no local link for the DataServer at %s: %s", address, e)
    add_servicer(servicer, server)  # the generated registration, with zero-copy Deliver chunks
    server.start()

    def register():
        reply = coord.RegisterServer(
            pb.RegisterServerRequest(address=address, kind=kind, local_rank=local_rank, host=host_id, workers=workers),
            timeout=config.rpc_timeout_s,
            metadata=call_metadata(token),
        )
        dataserver.registered(reply.server_id)

    try:
        register()
        hb = threading.Thread(
            target=heartbeats,
            args=(dataserver, coord, token, config, stop, register),
            name="helix-heartbeat",
            daemon=True,
        )
        hb.start()
        if on_ready is not None:
            on_ready(address, dataserver.server_id, hello.cluster_id)
        while not stop.wait(30.0):  # woken by stop (a signal handler sets it); the timeout is only a backstop
            pass
    finally:
        dataserver.beats.close()  # the heartbeat thread ends
        server.stop(grace=min(1.0, config.stop_timeout_s)).wait(config.stop_timeout_s)
        if bulk is not None:
            bulk.close()
        if link is not None:
            link.close()
        dataserver.close()
        pool.close()
        slabs.close()
        shm.sweep(f"helix-{hello.cluster_id}-{tag}")
        host_slots.close()
