"""``helix bench --overhead`` measures a quiet cluster: ``settle`` waits out start-up work."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil

from helix_bench.micro.overhead import settle


def test_settle_returns_only_after_a_busy_process_went_quiet(tmp_path):
    done = tmp_path / "busy-phase-over"
    code = textwrap.dedent(f"""
        import pathlib, time
        t = time.monotonic()
        while time.monotonic() - t < 1.5:  # start-up work: a worker importing torch, say
            pass
        pathlib.Path({str(done)!r}).touch()
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        settle([psutil.Process(child.pid)], limit_s=30.0)
        assert done.exists()  # it did not start measuring while the child still burned CPU
    finally:
        child.kill()
        child.wait(10)


def test_settle_gives_up_after_its_limit_on_a_process_that_never_goes_quiet():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        waited = settle([psutil.Process(child.pid)], limit_s=1.0)
        assert 1.0 <= waited < 10.0
    finally:
        child.kill()
        child.wait(10)


def test_the_rpc_yardstick_measures_both_servers_and_the_local_link_and_leaves_no_process():
    from helix_bench.micro.rpcfloor import measure_rpc_floor

    floor = measure_rpc_floor(calls=200, rate_hz=200.0)  # the link: ~0.25 ms a call, 10 ms ticks
    assert set(floor) == {"sync", "aio", "link"}
    for kind, f in floor.items():
        assert 0.0 < f["server_cpu_s"] < 0.05 and 0.0 < f["client_cpu_s"] < 0.05, (kind, f)
    servers = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline())
    ]
    assert not servers, [p.cmdline() for p in servers]
