"""One point of ``helix bench --hosts`` (``sweep.py``): one system at one sidecar count on the
emulated hosts — its services (a Coordinator and the DataServers, for helix), its ranks, their
records and the Coordinator's telemetry."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

from helix_bench.hosts.config import HostBenchConfig


def _start_service(hosts, host: str, args: list[str], env: dict) -> tuple[subprocess.Popen, dict]:
    from helix_core.launch.cluster import wait_ready

    proc = hosts.popen(host, [sys.executable, "-m", "helix_core.launch.cli", *args], env=env, stdout=subprocess.PIPE)
    try:
        return proc, wait_ready(proc, f"helix {args[0]} on host {host}", 120)
    except BaseException:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise


_TELEMETRY = """
import json, sys
from helix_core.config import ClusterConfig
from helix_core.security.auth import call_metadata
from helix_core.security.tokenfiles import load_token
from helix_core.wire.proto import helix_pb2 as pb, helix_pb2_grpc as pbg
from helix_core.wire.rpc import connect
from helix_core.security.tls import Tls
stub = pbg.CoordinatorStub(connect(sys.argv[1], ClusterConfig(), Tls.from_env()))
t = json.loads(stub.Telemetry(pb.TelemetryRequest(last_decisions=10000), timeout=10,
                              metadata=call_metadata(load_token(coordinator=sys.argv[1]))).json)
kind = {s["server_id"]: s["kind"] for s in t["servers"]}
print(json.dumps({"routed": t["routed"], "routed_remote": sum(kind.get(d["server"]) == "remote" for d in t["decisions"]),
                  "server_cross_ds_bytes": {s["server_id"]: s["cross_ds_bytes"] for s in t["servers"]},
                  "bulk_bytes": sum(s.get("bulk_bytes", 0) for s in t["servers"])}))
"""


def _cpu_s(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _routed(hosts, coordinator: str, env: dict) -> dict:
    """The Coordinator's count of requests routed, and to sidecars; each server's streamed bytes."""
    done = hosts.run("h0", [sys.executable, "-c", _TELEMETRY, coordinator], env=env, timeout=60)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"telemetry_error": done.stderr[-500:]}


def run_point(cfg: HostBenchConfig, hosts, system: str, k: int, plan, tmp: Path, env: dict) -> dict:
    """One system at one sidecar count: services (helix), the ranks; their records and stats."""
    from helix_bench.hosts.cpu import HostCpuSampler

    services = []
    roles: dict[str, dict[str, list[int]]] = {}  # host -> role -> pids (cpu.py)

    def role(host: str, name: str, pid: int) -> None:
        roles.setdefault(host, {}).setdefault(name, []).append(pid)

    try:
        helix = system != "native"
        if helix:
            # helix-grpc: remote batches by gRPC's Deliver stream instead of the bulk path (the A/B of the receive path)
            extra = ["--config-json", json.dumps({"bulk_delivery": False})] if system == "helix-grpc" else []
            coord, info = _start_service(
                hosts, "h0", ["coordinator", "--host", hosts.address("h0"), "--port", str(7100 + k)], env
            )
            services.append(coord)
            role("h0", "coordinator", info["pid"])
            workers = max(1, math.ceil(cfg.host_cpus))
            for h in range(cfg.hosts):
                proc, sinfo = _start_service(
                    hosts,
                    f"h{h}",
                    [
                        "dataserver",
                        "--coordinator",
                        info["address"],
                        "--local-rank",
                        "0",
                        "--workers",
                        str(workers),
                        "--host",
                        hosts.address(f"h{h}"),
                        *extra,
                    ],
                    env,
                )
                services.append(proc)
                role(f"h{h}", "dataserver", sinfo["pid"])
            for s in range(k):
                proc, sinfo = _start_service(
                    hosts,
                    f"s{s}",
                    [
                        "dataserver",
                        "--coordinator",
                        info["address"],
                        "--remote",
                        "--workers",
                        str(max(1, math.ceil(cfg.sidecar_cpus))),
                        "--host",
                        hosts.address(f"s{s}"),
                        *extra,
                    ],
                    env,
                )
                services.append(proc)
                role(f"s{s}", "dataserver", sinfo["pid"])
            plan = replace(plan, coordinator=info["address"])
        plan = replace(plan, system="helix" if system == "helix-grpc" else system, port=29700 + 10 * k + helix)
        ranks = []
        for r in range(cfg.ranks):
            out = tmp / f"{system}-{k}-rank{r}.json"
            argv = [sys.executable, "-m", "helix_bench.hosts.rank", json.dumps(asdict(plan)), str(r), str(out)]
            ranks.append(
                (
                    hosts.popen(
                        f"h{r // cfg.ranks_per_host}", argv, env={**env, "LOCAL_RANK": str(r % cfg.ranks_per_host)}
                    ),
                    out,
                )
            )
            role(f"h{r // cfg.ranks_per_host}", "ranks", ranks[-1][0].pid)  # sh execs nsenter execs python: one pid
        results = []
        quotas = {h: (cfg.host_cpus if h.startswith("h") else cfg.sidecar_cpus) for h in roles}
        # the decode workers are the DataServers' children (helix) or the ranks' (native's DataLoader workers)
        with HostCpuSampler(hosts, roles, quotas, children_as={"dataserver": "decode", "ranks": "decode"}) as cpu:
            for proc, out in ranks:
                proc.wait(timeout=1800)
                results.append(
                    json.loads(out.read_text()) if out.exists() else {"kind": "error", "payload": "no result"}
                )
        failed = [(r, g) for r, g in enumerate(results) if g["kind"] != "ok"]
        if failed:  # the rank that failed first, not those whose collective lost it as a peer
            rank, got = next(((r, g) for r, g in failed if "closed by peer" not in str(g["payload"])), failed[0])
            raise RuntimeError(
                f"{system} with {k} sidecars: ranks {[r for r, _ in failed]} failed; rank {rank}: {got['payload']}"
            )
        routed = _routed(hosts, plan.coordinator, env) if helix else {}
        local = [
            pid for host, by_role in roles.items() if host.startswith("h") for pid in by_role.get("dataserver", ())
        ]
        if local:  # the GPU hosts' DataServer processes themselves (serving, receiving streams), not their workers
            routed["local_dataserver_cpu_s"] = sum(_cpu_s(pid) for pid in local)
        reasons: dict[str, int] = {}
        for g in results:
            for why, n in (g["extra"].get("stats", {}).get("placement_reasons") or {}).items():
                reasons[why] = reasons.get(why, 0) + int(n)
        stats = [g["extra"].get("stats", {}) for g in results]
        for key in ("deadline_p50_s", "window_s_per_unit"):  # medians over the ranks: what placement aimed at
            values = sorted(float(s[key]) for s in stats if s.get(key) is not None)
            routed[key] = values[len(values) // 2] if values else None
        tier2: dict[str, float] = {}  # helix-tier2: the ranks' round counters, summed
        for st in stats:
            for key, n in (st.get("rebalance") or {}).items():
                if isinstance(n, (int, float)):
                    tier2[key] = tier2.get(key, 0) + n
        if tier2:
            routed["tier2"] = tier2
        spans = [
            g["extra"]["measured_monotonic"] for g in results if (g["extra"].get("measured_monotonic") or [0.0])[0] > 0
        ]  # a rank with measured steps
        if spans:  # the measured steps, from the first rank's start to the last rank's end
            routed["host_cpu"] = cpu.window(min(a for a, _ in spans), max(b for _, b in spans))
        return {
            "records": [rec for g in results for rec in g["payload"]],
            "placement_reasons": reasons,
            **routed,
            "cross_ds_bytes": sum(int(g["extra"].get("stats", {}).get("cross_ds_bytes", 0) or 0) for g in results),
        }
    finally:
        for proc in reversed(services):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in services:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            proc.stdout.close()
