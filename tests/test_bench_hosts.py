"""`helix bench --hosts`: the sidecar sweep on emulated hosts — a tiny run writes the sweep into
results.json, the report and the figure; bad input is named by its flag before anything starts."""
import json
import subprocess
import sys

import pytest

from helix_bench.hosts import HostBenchConfig
from helix_core.emulated_hosts import EmulatedHosts


def test_bad_host_bench_input_is_named_by_its_flag():
    with pytest.raises(ValueError, match="--sidecar-cpus .* more than this machine"):
        HostBenchConfig(hosts=2, host_cpus=0.5, sidecars=(0, 4), sidecar_cpus=64.0)
    with pytest.raises(ValueError, match="--host-cpus"):
        HostBenchConfig(host_cpus=0.0)
    with pytest.raises(ValueError, match="--sidecars"):
        HostBenchConfig(sidecars=())
    with pytest.raises(ValueError, match="--systems"):
        HostBenchConfig(systems=("ray",))


@pytest.mark.slow
@pytest.mark.skipif(EmulatedHosts.unavailable() is not None, reason=str(EmulatedHosts.unavailable()))
def test_a_tiny_sidecar_sweep_writes_results_report_and_figure(tmp_path):
    out = tmp_path / "hosts"
    done = subprocess.run([sys.executable, "-m", "helix_core.cli", "bench", "--hosts", "2", "--ranks-per-host", "1",
                           "--host-cpus", "0.5", "--sidecars", "0,1", "--sidecar-cpus", "0.5", "--warmup", "8",
                           "--steps", "8", "--clips", "12", "--scale", "0.25", "--data", str(tmp_path / "data"),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads((out / "results.json").read_text())
    points = {(p["system"], p["sidecars"]): p for p in got["points"]}
    assert set(points) == {("native", 0), ("helix", 0), ("helix", 1)}
    assert points[("helix", 1)]["cpus"] == 1.5 and points[("native", 0)]["cpus"] == 1.0  # the CPU each may use
    assert points[("helix", 1)]["cross_ds_bytes"] > 0 and points[("helix", 0)]["cross_ds_bytes"] == 0
    assert all(p["throughput_sps"] > 0 and 0 < p["bound_fraction"] for p in got["points"])
    report = (out / "report.md").read_text()
    assert "| helix | 1 | 1.5 |" in report and (out / "fig_sidecars.png").stat().st_size > 0
