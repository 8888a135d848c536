"""``helix bench --overhead``: Helix's own CPU and latency, with near-free samples.

(a) idle: CPU of a cluster as a loader would embed it (2 local DataServers, one worker each, a
    token) doing nothing, as % of one core, by process role;
(b) per batch: CPU-seconds spent outside the decode call, by role, while one loader pulls batches
    of near-free samples at a fixed rate — the client's threads (sender: Route + Execute; fetcher:
    waiting + materialize; the consumer's ``next()``; gRPC's own threads), the Coordinator, the
    DataServers (Execute handlers, heartbeats, supervisor) and the workers (collate, slab writes,
    pipes); the idle rate of (a) is reported beside it, so what heartbeats cost is seen;
(c) wake-up: from a reply landing (its done-callback) to ``next()`` returning it, while the rank
    waits for it (p50 / p99).
"""

from __future__ import annotations

import threading
import time

import psutil

__all__ = ["measure_idle", "measure_per_batch", "measure_wakeup", "run_overhead"]


def _cluster_processes(cluster) -> dict[str, list[psutil.Process]]:
    coord = psutil.Process(cluster.coordinator_pid)
    servers = [psutil.Process(s.pid) for s in cluster.servers]
    workers = [c for s in servers for c in s.children(recursive=True)]
    return {"coordinator": [coord], "dataservers": servers, "workers": workers}


def _cpu(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _run_ns(procs) -> dict[tuple[int, int], int] | None:
    """Nanoseconds each thread of ``procs`` has run (the scheduler's own count,
    ``/proc/PID/task/TID/schedstat``), by (pid, tid): an idle process uses a few clock ticks in
    30 s, so the 10 ms ticks ``cpu_times`` counts in would round it by as much as it measures.
    None when a read failed (a thread ended while it was read)."""
    import os

    out = {}
    for p in procs:
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            return None
        for tid in tids:
            try:
                with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                    out[(p.pid, int(tid))] = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                return None  # a thread ended while it was read: this count is incomplete
    return out


def _idle_cpu_s(procs, before: dict | None, before_ticks: float) -> float:
    """CPU-seconds since ``before``: by the scheduler's nanoseconds where both counts are complete
    and no thread came or went (an idle window starts and ends none), else by ``cpu_times``
    (exited threads too)."""
    after = _run_ns(procs)
    if before and after is not None and set(before) == set(after):
        return sum(after[k] - before[k] for k in after) / 1e9
    return _cpu(procs) - before_ticks


def settle(procs, quiet: float = 0.02, window_s: float = 0.5, limit_s: float = 60.0) -> float:
    """Wait until ``procs`` together use under ``quiet`` of one core over ``window_s``: start-up
    work (a worker still importing torch, registration) is neither idle time nor a batch's cost.
    Seconds waited; gives up after ``limit_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        before, ticks = _run_ns(procs), _cpu(procs)
        time.sleep(window_s)
        if _idle_cpu_s(procs, before, ticks) < quiet * window_s:
            break
    return time.monotonic() - t0


def measure_idle(seconds: float = 30.0) -> dict:
    """(a): % of one core used by an idle cluster with 2 local servers (by role), over ``seconds``."""
    from helix_core.launch.cluster import LocalCluster

    with LocalCluster(local_servers=2, workers_per_server=1, token=True) as cluster:
        roles = _cluster_processes(cluster)
        settle([p for ps in roles.values() for p in ps])
        before = {r: (_run_ns(ps), _cpu(ps)) for r, ps in roles.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        by_role = {r: 100.0 * _idle_cpu_s(ps, *before[r]) / elapsed for r, ps in roles.items()}
    return {
        "idle_pct_of_core": sum(by_role.values()),
        "idle_pct_by_role": by_role,
        "seconds": elapsed,
        "processes": sum(len(ps) for ps in roles.values()),
    }


def _thread_cpu(names: dict[int, str]) -> dict[str, float]:
    """CPU-seconds of this process's threads, by role: Helix's named threads, the consumer (the
    main thread) and gRPC's (every other native thread)."""
    out: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "client-grpc")
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


def _names() -> dict[int, str]:
    roles = {
        "helix-sender": "client-sender (Route, Execute)",
        "helix-fetcher": "client-fetcher (wait, materialize)",
        "helix-link-reader": "client-link (Execute replies)",
        "MainThread": "client-consumer (next)",
    }
    return {t.native_id: roles.get(t.name, "client-other") for t in threading.enumerate() if t.native_id}


def measure_per_batch(batches: int = 400, rate_hz: float = 50.0, batch_size: int = 2, prefetch: int = 4) -> dict:
    """(b): CPU-seconds per batch by role outside the decode call (samples are near-free), at a
    fixed rate of ``rate_hz`` batches/s."""
    import helix_core as hx
    from helix_core.launch.cluster import LocalCluster
    from helix_core.testing.datasets import IndexDataset

    ds = IndexDataset((batches + 10 + 4 * prefetch) * batch_size, shape=(64,))  # threads live through the window
    with LocalCluster(local_servers=2, workers_per_server=1, token=True) as cluster:
        roles = _cluster_processes(cluster)
        settle([p for ps in roles.values() for p in ps])  # every worker up, not 1 of 2
        loader = hx.DistributedDataLoader(
            ds,
            batch_size,
            rank=0,
            world_size=1,
            coordinator=cluster.address,
            token=cluster.token,
            prefetch_depth=prefetch,
        )
        with loader:
            per_batch, n, elapsed = _per_batch(loader, roles, batches, rate_hz)
    return {
        "per_batch_cpu_s": per_batch,
        "batches": n,
        "rate_hz": n / elapsed,
        "total_cpu_s_per_batch": sum(per_batch.values()),
    }


def _per_batch(loader, roles: dict, batches: int, rate_hz: float) -> tuple[dict, int, float]:
    """CPU-seconds per batch by role (``roles``: the cluster's processes) over ``batches`` batches
    taken at ``rate_hz``, after 10 warm-up batches (channels, spec, slabs); also the count and the
    seconds it took."""
    it = iter(loader)
    for _ in range(10):
        next(it)
    names = _names()
    before = {r: _cpu(ps) for r, ps in roles.items()}
    threads_before = _thread_cpu(names)
    t0, n = time.perf_counter(), 0
    for _ in it:
        n += 1
        if n == batches:
            break
        pause = t0 + n / rate_hz - time.perf_counter()
        if pause > 0:
            time.sleep(pause)  # the emulated GPU step: the loader must keep up, not race
    elapsed = time.perf_counter() - t0
    per_batch = {r: (_cpu(ps) - before[r]) / n for r, ps in roles.items()}
    for name, cpu in _thread_cpu(names).items():
        per_batch[name] = (cpu - threads_before.get(name, 0.0)) / n
    return per_batch, n, elapsed


def measure_wakeup(batches: int = 300, sample_s: float = 0.004) -> dict:
    """(c): reply landed -> ``next()`` returned, seconds, while the rank waits (prefetch 1, samples
    that take ``sample_s`` each, so every ``next()`` waits for its reply)."""
    import helix_core as hx
    from helix_core.launch.cluster import LocalCluster
    from helix_core.testing.datasets import IndexDataset

    ds = IndexDataset(batches * 2, shape=(1 << 12,), delays={i: sample_s for i in range(batches * 2)})
    with (
        LocalCluster(local_servers=1, workers_per_server=1, token=True) as cluster,
        hx.DistributedDataLoader(
            ds, 2, rank=0, world_size=1, coordinator=cluster.address, token=cluster.token, prefetch_depth=1
        ) as loader,
    ):
        for _ in loader:
            pass
        st = loader.stats()
    return {
        "wakeup_p50_s": st["wakeup_p50_s"],
        "wakeup_p99_s": st["wakeup_p99_s"],
        "input_wait_p50_s": st["input_wait_p50_s"],
        "batches": st["batches"],
    }


def run_overhead(out=None, console=None, idle_s: float = 30.0, batches: int = 400) -> dict:
    """All three, printed as tables (and saved as JSON to ``out``), with (b)'s yardstick
    (``rpcfloor.py``: a bare call's CPU at the same rate, by gRPC and by the local link)."""
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from helix_bench.micro.rpcfloor import measure_rpc_floor

    console = console or Console()
    with console.status("(a) idle cluster"):
        idle = measure_idle(idle_s)
    with console.status("(b) CPU per batch"):
        per = measure_per_batch(batches)
    with console.status("(c) wake-up latency"):
        wake = measure_wakeup()
    with console.status("(b) yardstick: a bare call (gRPC, the local link)"):
        floor = measure_rpc_floor(rate_hz=per["rate_hz"])
    t = Table(title=f"(a) idle cluster (2 local DataServers, 1 worker each), {idle['seconds']:.0f} s")
    t.add_column("role")
    t.add_column("% of one core", justify="right")
    for role, pct in idle["idle_pct_by_role"].items():
        t.add_row(role, f"{pct:.2f}")
    t.add_row("[bold]all", f"[bold]{idle['idle_pct_of_core']:.2f}")
    console.print(t)
    t = Table(
        title=f"(b) CPU per batch outside the decode call, {per['batches']} batches at {per['rate_hz']:.0f}/s "
        "(near-free samples)"
    )
    t.add_column("role")
    t.add_column("CPU µs / batch", justify="right")
    for role, cpu in sorted(per["per_batch_cpu_s"].items(), key=lambda kv: -kv[1]):
        t.add_row(role, f"{cpu * 1e6:.0f}")
    hb = idle["idle_pct_of_core"] / 100.0 / per["rate_hz"]
    t.add_row("(of which idle work: heartbeats, sweeps)", f"{hb * 1e6:.0f}")
    t.add_row("[bold]all", f"[bold]{per['total_cpu_s_per_batch'] * 1e6:.0f}")
    console.print(t)
    console.print(
        "(b) yardstick, one bare call at the same rate (a batch takes two, Route to the Coordinator and "
        "Execute to a local server, both by the local link on one host; gRPC to other hosts and sidecars): "
        + ", ".join(
            f"{'gRPC ' + kind if kind != 'link' else 'local link'} server {f['server_cpu_s'] * 1e6:.0f} µs + caller {f['client_cpu_s'] * 1e6:.0f} µs"
            for kind, f in floor.items()
        )
    )
    console.print(
        f"(c) wake-up, reply landed -> next() returned: p50 {wake['wakeup_p50_s'] * 1e3:.3f} ms, "
        f"p99 {wake['wakeup_p99_s'] * 1e3:.3f} ms over {wake['batches']} batches"
    )
    result = {"idle": idle, "per_batch": per, "wakeup": wake, "rpc_floor": floor}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
        console.print(f"saved {out}")
    return result


if __name__ == "__main__":
    run_overhead()
