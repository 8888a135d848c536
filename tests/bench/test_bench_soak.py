"""`helix soak` in miniature: loaders run epochs through every kind of fault, the rows come out, and
no sample is lost or repeated (the exit status says so)."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_short_soak_cycles_every_fault_and_loses_nothing():
    from helix_bench.micro.soak import FAULTS

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "helix_core.launch.cli",
            "soak",
            "--minutes",
            "3",
            "--fault-every",
            "4",
            "--faults",
            str(len(FAULTS)),
            "--report-every",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "helix soak" in out and "faults" in out and "repeated" in out
    last = [line for line in out.splitlines() if line.startswith("minute")][-1]
    assert " lost 0 " in last + " " and "repeated 0" in last
    # each kind of fault once, then it ended: without --faults, 3 minutes at one every 4 s would be ~45
    assert int(last.split("faults")[1].split()[0]) == len(FAULTS)


def test_bad_soak_input_is_refused_naming_the_flag():
    from helix_bench.micro.soak import SoakConfig

    with pytest.raises(ValueError, match="--minutes"):
        SoakConfig(minutes=0)
    with pytest.raises(ValueError, match="--clients"):
        SoakConfig(clients=0)
    with pytest.raises(ValueError, match="--faults"):
        SoakConfig(faults=-1)
