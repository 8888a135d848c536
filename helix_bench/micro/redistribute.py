"""``helix bench --redistribute``: moving a round of decoded clips between DataServer processes —
one gloo ``all_to_all`` (Tier 2's collective path) against one gRPC call per clip (the fallback)
and a same-host handle exchange (the slabs stay; only their handles travel).

Each of ``servers`` processes decodes its share of ``clips`` real clips (kinetics-mixed, PyAV),
then, ``repeats`` times and interleaved: (1) all_to_all: clip k of member r goes to member
``(r + k) % servers`` (so ``1/servers`` stay), packed per destination, one collective of sizes and
one of bytes; (2) gRPC: the same clips, each in one client-streaming call (4 MiB chunks, the
token checked) to the destination's server; (3) handles: an all-gather of the clips' slab handles
(JSON). A round's time is its slowest member's; the report gives medians, bytes moved and GB/s.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_redistribute"]

_METHOD = "/helix.bench.Redistribute/Push"


def _member(a: dict) -> dict:
    import dataclasses
    import threading

    import grpc
    import torch

    import helix_core as hx
    from helix_core.config import ClusterConfig
    from helix_core.memory.shm import SlabHandle
    from helix_core.security.auth import call_metadata
    from helix_core.tier2.collective import GlooGroup, pack, pack_many, unpack
    from helix_core.wire.rpc import connect, create_server

    rank, world, config = a["rank"], a["world"], ClusterConfig()
    ds = hx.VideoClipDataset(a["manifest"], model=a["model"])
    mine = [ds[i] for i in range(rank, a["clips"], world)]
    received, lock = [], threading.Lock()

    def push(chunks, context):  # one clip: its packed bytes in chunks
        buf = bytearray()
        for c in chunks:
            buf += c
        out = unpack(torch.frombuffer(buf, dtype=torch.uint8))
        with lock:
            received.extend(out)
        return b""

    bind = a.get("bind", "127.0.0.1")  # on emulated hosts: this host's address (the bench's own token; no TLS)
    server, port = create_server(bind, 0, a["token"], config, threads=8, insecure=True)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "helix.bench.Redistribute", {"Push": grpc.stream_unary_rpc_method_handler(push)}
            )
        ]
    )
    server.start()
    group = GlooGroup(rank, world, a.get("store_host", "127.0.0.1"), a["store_port"], timeout_s=120)
    try:
        peers = group.all_gather_json(f"{bind}:{port}")
        channels = [connect(p, config) for p in peers]
        calls = [ch.stream_unary(_METHOD, request_serializer=None, response_deserializer=None) for ch in channels]
        dest = [(rank + k) % world for k in range(len(mine))]
        outgoing = [[s for s, d in zip(mine, dest) if d == r] if r != rank else [] for r in range(world)]  # keeps stay
        packed = [pack([s]) for s in mine]
        send_bufs = pack_many(outgoing)  # one buffer, a part per destination
        moved = sum(p.numel() for p, d in zip(packed, dest) if d != rank)
        handles = [  # the JSON form of a handle (its fields by name)
            dataclasses.asdict(SlabHandle(f"helix-bench-{rank}-{k}", k, int(p.numel()))) for k, p in enumerate(packed)
        ]
        rows = []
        chunk = config.stream_chunk_bytes
        for _ in range(a["repeats"]):
            group.all_gather_json(0)  # barrier
            t0 = time.perf_counter()  # packed beforehand, as the gRPC path's clips are: the move alone
            incoming = [unpack(b) if b.numel() else [] for b in group.all_to_all_bytes(*send_bufs)]
            t_a2a = time.perf_counter() - t0
            assert sum(map(len, incoming)) == sum(1 for _, d in _dests(world, a["clips"]) if d == rank)
            group.all_gather_json(0)
            with lock:
                received.clear()
            t0 = time.perf_counter()
            for p, d in zip(packed, dest):
                if d == rank:
                    continue
                mv = memoryview(p.numpy())
                calls[d](
                    iter([bytes(mv[i : i + chunk]) for i in range(0, len(mv), chunk)]),
                    timeout=300,
                    metadata=call_metadata(a["token"]),
                )
            group.all_gather_json(0)  # every sender's calls returned: everything arrived
            t_grpc = time.perf_counter() - t0
            group.all_gather_json(0)
            t0 = time.perf_counter()
            got = group.all_gather_json([h for h, d in zip(handles, dest) if d != rank])
            t_handles = time.perf_counter() - t0
            assert len(got) == world
            rows.append({"all_to_all_s": t_a2a, "grpc_s": t_grpc, "handles_s": t_handles})
        for ch in channels:
            ch.close()
        return {"rank": rank, "moved_bytes": moved, "rows": rows}
    finally:
        group.close()
        server.stop(0)


def _dests(world: int, clips: int) -> list[tuple[int, int]]:
    """``(source member, destination member)`` of every clip that moves (the same rule as above)."""
    out = []
    for r in range(world):
        for k, _ in enumerate(range(r, clips, world)):
            if (r + k) % world != r:
                out.append((r, (r + k) % world))
    return out


def run_redistribute(
    servers: int = 4,
    clips: int = 64,
    repeats: int = 5,
    scale: float = 1.0,
    model: str = "videomae",
    out: Path | None = None,
    console=None,
    hosts: int = 0,
) -> dict:
    """Run the benchmark (``servers`` member processes; ``hosts`` >= 2: spread over that many
    emulated hosts, ``servers / hosts`` each, gloo and gRPC over their bridge); print and return
    the figures."""
    import socket

    from helix_core.config import cache_dir
    from helix_core.data.media.synth import make_dataset
    from helix_core.security.auth import new_token

    if hosts and (hosts < 2 or servers % hosts):
        raise ValueError(f"--hosts {hosts}: two or more, dividing --ranks {servers}")
    if servers < 2 or clips < servers or repeats < 1:
        raise ValueError(
            f"--redistribute needs servers >= 2, clips >= servers, repeats >= 1 (got {servers}, {clips}, {repeats})"
        )
    say = console.print if console is not None else print
    root = cache_dir() / "bench-data" / f"redistribute-kinetics-mixed-{clips}-s{scale}"
    if not (root / "manifest.jsonl").exists():
        say(f"synthesizing {clips} kinetics-mixed clips (scale {scale}) in {root} ...")
        make_dataset(root, "kinetics-mixed", clips, seed=0, scale=scale)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store_port = s.getsockname()[1]
    token = new_token()
    where = f"{hosts} emulated hosts" if hosts else "one host"
    say(f"{servers} member processes on {where} decode {clips} clips, then {repeats} interleaved rounds ...")
    if hosts:
        from helix_core.testing.emulated_hosts import EmulatedHosts

        with EmulatedHosts([f"h{i}" for i in range(hosts)]) as eh:
            files = _run_members(servers, clips, repeats, model, token, root, store_port, out, eh)
    else:
        files = _run_members(servers, clips, repeats, model, token, root, store_port, out, None)
    members = [json.loads(f.read_text()) for f in files]
    for f in files:
        f.unlink()
    moved = sum(m["moved_bytes"] for m in members)
    figures = {
        "servers": servers,
        "hosts": hosts or 1,
        "clips": clips,
        "repeats": repeats,
        "scale": scale,
        "model": model,
        "moved_bytes": moved,
        "moved_clips": len(_dests(servers, clips)),
    }
    rounds = {
        key: [max(m["rows"][i][key] for m in members) for i in range(repeats)]
        for key in ("all_to_all_s", "grpc_s", "handles_s")
    }
    for key, per_round in rounds.items():
        figures[key] = statistics.median(per_round)
        figures[key.replace("_s", "_gbps")] = moved / figures[key] / 1e9 if key != "handles_s" else None
    # the machine drifts: the ratio is the median of each round's own (the systems alternate in a round)
    figures["grpc_over_all_to_all"] = statistics.median(g / a for g, a in zip(rounds["grpc_s"], rounds["all_to_all_s"]))
    figures["rounds"] = rounds
    say(
        f"{figures['moved_clips']} clips ({moved / 1e6:.0f} MB) moved among {servers} processes on {where}, "
        f"medians of {repeats}:"
    )
    say(f"  all_to_all (gloo)      {figures['all_to_all_s']:.3f} s  {figures['all_to_all_gbps']:.2f} GB/s")
    say(
        f"  gRPC, one call a clip  {figures['grpc_s']:.3f} s  {figures['grpc_gbps']:.2f} GB/s  "
        f"(per round, median: {figures['grpc_over_all_to_all']:.2f}x the all_to_all's time)"
    )
    say(
        f"  handle exchange        {figures['handles_s'] * 1e6:.0f} µs (its control round: within a host, 0 bytes copied)"
    )
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"redistribute{'-hosts' if hosts else ''}.json").write_text(json.dumps(figures, indent=2))
    return figures


def _run_members(servers, clips, repeats, model, token, root, store_port, out, eh) -> list[Path]:
    """Start the members (on emulated host ``r * hosts // servers`` when ``eh``), wait, return their files."""
    import os

    procs, files = [], []
    names = eh.names if eh is not None else []
    for rank in range(servers):
        path = (Path(out).resolve() if out else Path("/tmp")) / f".helix-redistribute-{os.getpid()}-{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        args = dict(
            rank=rank,
            world=servers,
            store_port=store_port,
            manifest=str(root / "manifest.jsonl"),
            clips=clips,
            repeats=repeats,
            model=model,
            token=token,
            out=str(path),
        )
        argv = [sys.executable, "-m", "helix_bench.micro.redistribute"]
        if eh is None:
            procs.append(subprocess.Popen([*argv, json.dumps(args)]))
        else:
            host = names[rank * len(names) // servers]
            args.update(bind=eh.address(host), store_host=eh.address(names[0]))
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")  # gloo: the host's own interface, not its hostname
            procs.append(eh.popen(host, [*argv, json.dumps(args)], env=env))
        files.append(path)
    try:
        codes = [p.wait(timeout=3600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise RuntimeError(f"redistribution members exited with {codes}")
    return files


if __name__ == "__main__":
    import os

    member_args = json.loads(sys.argv[1])
    result = _member(member_args)
    Path(member_args["out"]).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # group, server and channels are closed; interpreter teardown of gRPC's and gloo's threads
    # still aborted ~half the runs here ("terminate called without an active exception", no
    # Python frame left), as with the services (launch/process.py): leave without it
    os._exit(0)
