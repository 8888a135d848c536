"""`helix bench --hosts`: the sidecar sweep on emulated hosts — a tiny run writes the sweep into
results.json, the report and the figure; bad input is named by its flag before anything starts."""

import json
import subprocess
import sys

import pytest

from helix_bench.hosts.config import HostBenchConfig
from helix_core.testing.emulated_hosts import EmulatedHosts


def test_bad_host_bench_input_is_named_by_its_flag():
    with pytest.raises(ValueError, match="--sidecar-cpus .* more than this machine"):
        HostBenchConfig(hosts=2, host_cpus=0.5, sidecars=(0, 4), sidecar_cpus=64.0)
    with pytest.raises(ValueError, match="--host-cpus"):
        HostBenchConfig(host_cpus=0.0)
    with pytest.raises(ValueError, match="--sidecars"):
        HostBenchConfig(sidecars=())
    with pytest.raises(ValueError, match="--systems"):
        HostBenchConfig(systems=("ray",))
    assert HostBenchConfig(systems=("helix", "helix-grpc")).systems == ("helix", "helix-grpc")  # the receive-path A/B
    with pytest.raises(ValueError, match="--estimate-noise"):
        HostBenchConfig(estimate_noise=-1.0)
    assert HostBenchConfig(systems=("native", "helix-tier2"), estimate_noise=1.5).estimate_noise == 1.5


def test_a_tier2_point_reports_what_its_rounds_moved_and_what_crossed_hosts(tmp_path):
    """The host sweep's helix-tier2 row: its ranks' round counters, summed, in a table of their own."""
    from helix_bench.hosts.report import write_report

    cfg = {
        "hosts": 2,
        "ranks_per_host": 2,
        "host_cpus": 0.5,
        "sidecar_cpus": 0.5,
        "link_mbps": None,
        "workload": "kinetics-mixed",
        "batch_size": 2,
        "repeats": 1,
        "estimate_noise": 1.5,
    }
    point = {
        "sidecars": 2,
        "cpus": 2.0,
        "throughput_sps": 4.0,
        "bound_sps": 5.0,
        "bound_fraction": 0.8,
        "limited_by": "gpu",
        "vs_native": 2.0,
        "miss_rate": 0.1,
        "cross_ds_bytes": 0,
        "link_utilisation": None,
        "input_wait_mean_s": 0.01,
    }
    tier2 = {
        "asked": 64,
        "kept": 40,
        "moved": 24,
        "moved_in": 30,
        "moved_bytes": 12e6,
        "crossed_collective": 9,
        "crossed_bytes": 5e6,
    }
    write_report(
        {
            "config": cfg,
            "steps": 32,
            "warmup": 8,
            "decode_s": 10.0,
            "gpu_s": 9.0,
            "points": [{**point, "system": "helix"}, {**point, "system": "helix-tier2", "tier2": tier2}],
        },
        tmp_path,
    )
    report = (tmp_path / "report.md").read_text()
    assert "sigma 1.5" in report
    assert (
        "| 2 | 64 | 24 / 40 | 30 | 12.0 | 9 | 5.0 |" in report
    )  # batches sent, moved / kept, rows moved, MB, takes across hosts, MB across
    assert (tmp_path / "fig_sidecars.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(EmulatedHosts.unavailable() is not None, reason=str(EmulatedHosts.unavailable()))
def test_a_tiny_sidecar_sweep_writes_results_report_and_figure(tmp_path):
    out = tmp_path / "hosts"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "helix_core.launch.cli",
            "bench",
            "--hosts",
            "2",
            "--ranks-per-host",
            "1",
            "--host-cpus",
            "0.75",
            "--sidecars",
            "0,1",
            "--sidecar-cpus",
            "0.5",
            "--warmup",
            "4",
            "--steps",
            "4",
            "--clips",
            "12",
            "--scale",
            "0.25",
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads((out / "results.json").read_text())
    points = {(p["system"], p["sidecars"]): p for p in got["points"]}
    assert set(points) == {("native", 0), ("helix", 0), ("helix", 1)}
    assert points[("helix", 1)]["cpus"] == 2.0 and points[("native", 0)]["cpus"] == 1.5  # the CPU each may use
    assert points[("helix", 1)]["cross_ds_bytes"] > 0 and points[("helix", 0)]["cross_ds_bytes"] == 0
    assert all(p["throughput_sps"] > 0 and 0 < p["bound_fraction"] and 0 <= p["miss_rate"] <= 1 for p in got["points"])
    report = (out / "report.md").read_text()
    assert "| helix | 1 | 2 |" in report and (out / "fig_sidecars.png").stat().st_size > 0


def test_rounds_are_summarised_by_their_median_and_paired_ratios_to_native():
    from helix_bench.hosts.sweep import _medians

    runs = [
        {"system": s, "sidecars": k, "round": r, "throughput_sps": v}
        for r, (n, h) in enumerate([(8.0, 20.0), (10.0, 18.0), (6.0, 30.0)])
        for s, k, v in (("native", 0, n), ("helix", 1, h))
    ]
    points = {p["system"]: p for p in _medians(runs)}
    assert points["helix"]["throughput_sps"] == 20.0 and points["helix"]["rounds_sps"] == [18.0, 20.0, 30.0]
    assert points["helix"]["vs_native"] == 2.5  # median of 2.5, 1.8, 5.0: each round against its own native
    assert points["native"]["vs_native"] == 1.0
    with pytest.raises(ValueError, match="--repeats"):
        HostBenchConfig(repeats=0)


@pytest.mark.slow
@pytest.mark.skipif(EmulatedHosts.unavailable() is not None, reason=str(EmulatedHosts.unavailable()))
def test_sigterm_to_the_host_bench_stops_its_hosts_and_services(tmp_path):
    """A scheduler's or the user's SIGTERM unwinds like Ctrl-C: no service, rank or namespace is left."""
    import signal
    import time

    from helix_core.testing.emulated_hosts import leftovers

    before = leftovers("")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "helix_core.launch.cli",
            "bench",
            "--hosts",
            "1",
            "--ranks-per-host",
            "1",
            "--host-cpus",
            "0.5",
            "--sidecars",
            "1",
            "--sidecar-cpus",
            "0.5",
            "--systems",
            "helix",
            "--warmup",
            "8",
            "--steps",
            "400",
            "--clips",
            "12",
            "--scale",
            "0.25",
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(tmp_path / "out"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in proc.stdout:
            if "sidecar(s)" in line:
                break
        time.sleep(15)  # services and ranks running
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert leftovers("") == before
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps and "helix_bench.hosts.rank" not in ps
    assert not (tmp_path / "out" / "results.json").exists()  # no half-written report


def test_the_cpu_of_the_measured_steps_is_read_between_samples_and_added_up_by_kind_of_host(tmp_path):
    """hostcpu.py: counters interpolated at the measured steps' ends; the report's table says
    what each kind of host's quota allowed, used, spent per role and how long it was held back."""
    from helix_bench.hosts.cpu import HostCpuSampler, summarize
    from helix_bench.hosts.report import _cpu_table

    sampler = HostCpuSampler(hosts=None, roles={}, quotas={"h0": 0.5, "h1": 0.5, "s0": 0.5})

    def row(used, throttled, decode):
        return {
            "used_s": used,
            "throttled_s": throttled,
            "periods": 10 * used,
            "throttled_periods": throttled,
            "roles": {"decode": decode, "ranks": used / 10},
        }

    sampler.samples = [
        (10.0, {h: row(0.0, 0.0, 0.0) for h in ("h0", "h1", "s0")}),
        (20.0, {h: row(5.0, 4.0, 4.0) for h in ("h0", "h1", "s0")}),
        (30.0, {**{h: row(10.0, 8.0, 8.0) for h in ("h0", "h1")}, "s0": row(6.0, 4.0, 4.5)}),
    ]
    got = sampler.window(15.0, 25.0)  # halfway into the first interval, halfway into the second
    assert got["h0"] == {
        "window_s": 10.0,
        "quota_s": 5.0,
        "used_s": 5.0,
        "throttled_s": 4.0,
        "periods": 50.0,
        "throttled_periods": 4.0,
        "roles": {"decode": 4.0, "ranks": 0.5},
        "other_s": 0.5,
    }
    assert got["s0"]["used_s"] == 0.5 * 5.0 + 0.5 * 1.0  # 2.5 -> 5.5: the sidecar slowed down
    gpu = summarize(got, "h")
    assert gpu["hosts"] == 2 and gpu["quota_s"] == 10.0 and gpu["used_s"] == 10.0 and gpu["roles"]["decode"] == 8.0
    assert summarize(got, "s")["hosts"] == 1 and summarize(got, "x") is None
    # 1.5 CPUs at the yardstick's 0.1 CPU-s per sample: 15 samples/s; the run's 9 took 15 CPU-s of 13 used
    point = {
        "system": "helix",
        "sidecars": 1,
        "cpus": 1.5,
        "host_cpu": got,
        "cpu_bound_sps": 15.0,
        "throughput_sps": 9.0,
    }
    table = "\n".join(_cpu_table([point]))
    assert "| helix | 1 | GPU hosts (2) | 10.0 | 10.0 (100 %) | 8.0 | 0.0 | 1.0 | 0.0 | 1.0 | 8 |" in table
    assert "| helix | 1 | sidecars (1) | 5.0 | 3.0 (60 %) |" in table
    # the three shares whose product is the throughput against the CPU bound: 13 of 15 CPU-s used, 10.25 of
    # them decoding, at 90 samples / 10.25 CPU-s against the yardstick's 10 per CPU-s
    assert "| helix | 1 | 15.00 | 87 | 79 | 88 | 60 |" in table
    assert _cpu_table([{"system": "helix", "sidecars": 0, "cpus": 1.0}]) == []  # no counters: no table
