"""Synthetic workloads: real H.264, deterministic per seed, the manifest format of docs/guide/data-plane.md."""

import hashlib
import json

import av
import pytest
import torch

import helix_core as hx
from helix_core.data.media import synth


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.mp4"))}


def test_deterministic_per_seed(tmp_path):
    a = hx.synth.make_dataset(tmp_path / "a", "kinetics-mixed", 3, seed=7, scale=0.2)
    b = hx.synth.make_dataset(tmp_path / "b", "kinetics-mixed", 3, seed=7, scale=0.2)
    c = hx.synth.make_dataset(tmp_path / "c", "kinetics-mixed", 3, seed=8, scale=0.2)
    assert _digest(a) == _digest(b)
    assert (a / "manifest.jsonl").read_text() == (b / "manifest.jsonl").read_text()
    assert _digest(a) != _digest(c)


def test_clips_are_h264_yuv420p_with_captions(kmix):
    recs = [json.loads(line) for line in (kmix / "manifest.jsonl").read_text().splitlines()]
    assert len(recs) == 6
    for r in recs:
        assert r["caption"] and isinstance(r["label"], int)
        with av.open(str(kmix / r["path"])) as c:
            s = c.streams.video[0]
            assert s.codec_context.name == "h264" and s.codec_context.pix_fmt == "yuv420p"
            assert s.frames > r["num_frames"]  # the source is longer than what is sampled
            assert abs(float(s.average_rate) - 30.0) < 1e-6


def test_kinetics_mixed_alternates_profiles():
    specs = synth.plan_workload("kinetics-mixed", 6, seed=0)
    assert [s.profile for s in specs] == ["S", "M", "L", "S", "M", "L"]
    assert [(s.num_frames, s.height) for s in specs[:3]] == [(16, 224), (32, 336), (64, 448)]
    assert all(s.width > s.height for s in specs)


def test_openvid_mixed_shapes_and_durations():
    specs = synth.plan_workload("openvid-mixed", 200, seed=3)
    ratios = {round(max(s.width, s.height) / min(s.width, s.height), 1) for s in specs}
    assert {1.0, 1.3, 1.8} <= ratios
    assert any(s.height > s.width for s in specs) and any(s.width > s.height for s in specs)
    secs = [s.frames / s.fps for s in specs]
    assert 2.0 <= min(secs) and max(secs) <= 16.5
    assert len({min(s.width, s.height) for s in specs}) >= 3


def test_scale_shrinks_and_bad_arguments_are_named():
    big, small = synth.plan_workload("kinetics-large", 1)[0], synth.plan_workload("kinetics-large", 1, scale=0.25)[0]
    assert small.height < big.height and small.frames < big.frames and small.frames >= small.num_frames
    with pytest.raises(ValueError, match="kinetics-mixed"):
        synth.plan_workload("kinetics-huge", 1)
    with pytest.raises(ValueError, match="num_clips"):
        synth.plan_workload("kinetics-small", 0)


def test_second_call_reuses_clips(tmp_path):
    root = hx.synth.make_dataset(tmp_path, "kinetics-small", 2, seed=0, scale=0.2)
    before = {p.name: p.stat().st_mtime_ns for p in root.glob("*.mp4")}
    hx.synth.make_dataset(tmp_path, "kinetics-small", 2, seed=0, scale=0.2)
    assert {p.name: p.stat().st_mtime_ns for p in root.glob("*.mp4")} == before
    assert not list(root.glob(".*part"))


def test_csv_and_parquet_manifests_give_the_samples_json_lines_give(tmp_path):
    root = hx.synth.make_dataset(tmp_path, "openvid-mixed", 3, seed=2, scale=0.15)
    clips = {p.name: p.stat().st_mtime_ns for p in root.glob("clip_*")}
    for fmt in ("csv", "parquet"):  # the clips of the JSON-lines manifest are kept, not encoded again
        assert hx.synth.make_dataset(tmp_path, "openvid-mixed", 3, seed=2, scale=0.15, manifest_format=fmt) == root
    assert {p.name: p.stat().st_mtime_ns for p in root.glob("clip_*")} == clips
    assert synth._old_specs(root / "manifest.csv") == synth._old_specs(root / "manifest.jsonl")
    assert synth._old_specs(root / "manifest.parquet") == synth._old_specs(root / "manifest.jsonl")
    ref = hx.VideoClipDataset(root / "manifest.jsonl", model="wan", profiles=False)
    for fmt in ("csv", "parquet"):
        ds = hx.VideoClipDataset(root / f"manifest.{fmt}", model="wan", profiles=False)
        assert not ds.manifest.describes_sources  # spec.width / spec.height are not the source geometry columns
        assert ds.manifest.records[1]["spec.frames"] == ref.manifest.records[1]["spec"]["frames"]
        for i in range(len(ref)):
            assert ds.estimate_cost(i) == ref.estimate_cost(i)  # the num_frames / size hints hold
            a, b = ds[i], ref[i]
            assert torch.equal(a["video"], b["video"]) and a["label"] == b["label"]
    with pytest.raises(ValueError, match="valid: jsonl, csv, parquet"):
        hx.synth.make_dataset(tmp_path, "openvid-mixed", 3, manifest_format="tsv")


def test_synth_packs_its_workload_as_shards_that_give_the_same_samples(tmp_path):
    root = hx.synth.make_dataset(tmp_path, "kinetics-mixed", 4, seed=3, scale=0.2, manifest_format="parquet", shards=3)
    tars = sorted((root / "shards").glob("train-*.tar"))
    assert [p.name for p in tars] == ["train-000000.tar", "train-000001.tar"]
    ref = hx.VideoClipDataset(root / "manifest.parquet", model="videomae", profiles=False)
    ds = hx.WebDatasetClips(str(root / "shards" / "train-{000000..000001}.tar"), model="videomae")
    assert len(ds) == len(ref) == 4
    for i in (0, 3):
        a, b = ds[i], ref[i]
        assert torch.equal(a["video"], b["video"]) and a["label"] == b["label"]
