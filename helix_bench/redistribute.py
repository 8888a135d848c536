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
    import threading

    import grpc
    import torch

    import helix_core as hx
    from helix_core.config import ClusterConfig
    from helix_core.runtime.auth import call_metadata
    from helix_core.runtime.collective import ExchangeGroup, pack, unpack
    from helix_core.runtime.rpc import connect, create_server

    rank, world, config = a["rank"], a["world"], ClusterConfig()
    ds = hx.VideoClipDataset(a["manifest"], model=a["model"])
    mine = [ds[i] for i in range(rank, a["clips"], world)]
    received, lock, done = [], threading.Lock(), threading.Event()

    def push(chunks, context):  # one clip: its packed bytes in chunks
        buf = bytearray()
        for c in chunks:
            buf += c
        out = unpack(torch.frombuffer(buf, dtype=torch.uint8))
        with lock:
            received.extend(out)
        return b""

    server, port = create_server("127.0.0.1", 0, a["token"], config, threads=8)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("helix.bench.Redistribute", {
        "Push": grpc.stream_unary_rpc_method_handler(push)})])
    server.start()
    group = ExchangeGroup(rank, world, "127.0.0.1", a["store_port"], timeout_s=120)
    try:
        peers = group.all_gather_json(f"127.0.0.1:{port}")
        channels = [connect(p, config) for p in peers]
        calls = [ch.stream_unary(_METHOD, request_serializer=None, response_deserializer=None) for ch in channels]
        dest = [(rank + k) % world for k in range(len(mine))]
        outgoing = [[s for s, d in zip(mine, dest) if d == r] if r != rank else [] for r in range(world)]  # keeps stay
        packed = [pack([s]) for s in mine]
        moved = sum(p.numel() for p, d in zip(packed, dest) if d != rank)
        handles = [{"segment": f"helix-bench-{rank}-{k}", "generation": k, "nbytes": int(p.numel())}
                   for k, p in enumerate(packed)]
        rows = []
        chunk = config.stream_chunk_bytes
        for _ in range(a["repeats"]):
            group.all_gather_json(0)  # barrier
            t0 = time.perf_counter()
            incoming = group.exchange(outgoing)
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
                calls[d](iter([bytes(mv[i:i + chunk]) for i in range(0, len(mv), chunk)]), timeout=300,
                         metadata=call_metadata(a["token"]))
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


def run_redistribute(servers: int = 4, clips: int = 64, repeats: int = 5, scale: float = 1.0, model: str = "videomae",
                     out: Path | None = None, console=None) -> dict:
    """Run the benchmark (``servers`` member processes); print and return the figures."""
    import socket

    from helix_core.config import cache_dir
    from helix_core.media.synth import make_dataset
    from helix_core.runtime.auth import new_token

    if servers < 2 or clips < servers or repeats < 1:
        raise ValueError(f"--redistribute needs servers >= 2, clips >= servers, repeats >= 1 "
                         f"(got {servers}, {clips}, {repeats})")
    say = console.print if console is not None else print
    root = cache_dir() / "bench-data" / f"redistribute-kinetics-mixed-{clips}-s{scale}"
    if not (root / "manifest.jsonl").exists():
        say(f"synthesizing {clips} kinetics-mixed clips (scale {scale}) in {root} ...")
        make_dataset(root, "kinetics-mixed", clips, seed=0, scale=scale)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store_port = s.getsockname()[1]
    token, files = new_token(), []
    procs = []
    say(f"{servers} member processes decode {clips} clips, then {repeats} interleaved rounds ...")
    for rank in range(servers):
        path = Path(out or ".") / f".redistribute-{rank}.json" if out else Path(f"/tmp/helix-redistribute-{rank}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        args = dict(rank=rank, world=servers, store_port=store_port, manifest=str(root / "manifest.jsonl"), clips=clips,
                    repeats=repeats, model=model, token=token, out=str(path))
        procs.append(subprocess.Popen([sys.executable, "-m", "helix_bench.redistribute", json.dumps(args)]))
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
    members = [json.loads(f.read_text()) for f in files]
    for f in files:
        f.unlink()
    moved = sum(m["moved_bytes"] for m in members)
    figures = {"servers": servers, "clips": clips, "repeats": repeats, "scale": scale, "model": model,
               "moved_bytes": moved, "moved_clips": len(_dests(servers, clips))}
    for key in ("all_to_all_s", "grpc_s", "handles_s"):
        per_round = [max(m["rows"][i][key] for m in members) for i in range(repeats)]
        figures[key] = statistics.median(per_round)
        figures[key.replace("_s", "_gbps")] = moved / figures[key] / 1e9 if key != "handles_s" else None
    figures["grpc_over_all_to_all"] = figures["grpc_s"] / figures["all_to_all_s"]
    say(f"{figures['moved_clips']} clips ({moved / 1e6:.0f} MB) moved among {servers} processes on one host, "
        f"medians of {repeats}:")
    say(f"  all_to_all (gloo)      {figures['all_to_all_s']:.3f} s  {figures['all_to_all_gbps']:.2f} GB/s")
    say(f"  gRPC, one call a clip  {figures['grpc_s']:.3f} s  {figures['grpc_gbps']:.2f} GB/s  "
        f"({figures['grpc_over_all_to_all']:.2f}x the all_to_all's time)")
    say(f"  handle exchange        {figures['handles_s'] * 1e6:.0f} µs (control round only; 0 bytes copied)")
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "redistribute.json").write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    member_args = json.loads(sys.argv[1])
    result = _member(member_args)
    Path(member_args["out"]).write_text(json.dumps(result))
