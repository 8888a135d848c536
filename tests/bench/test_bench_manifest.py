"""`helix bench --manifest` at a small size: every format is built in its own process, costed from
the manifest's columns (its clips do not exist), and its figures are printed and saved."""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from helix_bench.micro.manifest import run_manifest_bench, write_manifest


def test_the_command_prints_and_saves_each_formats_figures(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "helix_core.launch.cli",
            "bench",
            "--manifest",
            "2000",
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(tmp_path / "out"),
            "--shard-members",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "2,000-row manifest" in done.stdout and all(f in done.stdout for f in ("parquet", "csv", "jsonl"))
    figures = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert figures["rows"] == 2000
    assert list(figures["formats"]) == ["parquet", "csv", "jsonl", "shards (scan)", "shards (index)"]
    shards = {k: figures["formats"].pop(k) for k in ("shards (scan)", "shards (index)")}
    for r in shards.values():  # 200 members: 100 samples, costed from the index the scan wrote
        assert r["rows"] == 100 and r["members"] == 200 and r["costed_from_manifest"] and r["build_s"] > 0
    for r in figures["formats"].values():
        assert r["rows"] == 2000 and r["costed_from_manifest"] and r["build_s"] > 0
        assert r["peak_rss_mb"] >= r["imports_rss_mb"] > 0 and r["estimate_cost_us"] > 0
    sums = {r["tokens_sum"] for r in figures["formats"].values()}
    assert len(sums) == 1  # the same rows whatever the format


def test_the_generated_manifest_states_the_geometry_of_clips_that_do_not_exist(tmp_path):
    path = write_manifest(tmp_path / "m.parquet", 100)
    table = pq.read_table(path)
    assert table.column_names == ["path", "caption", "label", "num_frames", "height", "width", "fps", "bytes"]
    assert table.column("path")[7].as_py() == "clips/0000007.mp4" and not (tmp_path / "clips").exists()
    assert write_manifest(tmp_path / "again.parquet", 100) and pq.read_table(tmp_path / "again.parquet").equals(table)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="formats among parquet, csv, jsonl"):
        run_manifest_bench(rows=10, formats=("tsv",), data_dir=tmp_path)
    assert not any(tmp_path.iterdir())
