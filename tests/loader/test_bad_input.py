"""Bad input: a clear error naming the sample (index, path, cause) or the manifest line; no hang."""

import json

import numpy as np
import pytest
from conftest import write_manifest

import helix_core as hx
from helix_core.data.media import synth


@pytest.fixture(scope="module")
def bad_set(tmp_path_factory):
    """A manifest mixing two good clips with every kind of bad file."""
    root = tmp_path_factory.mktemp("bad")
    spec = synth.plan_workload("kinetics-small", 1, scale=0.2)[0]
    good = synth.write_clip(root / "good.mp4", spec)
    fast = synth.write_clip(root / "fast.mp4", spec, options={"movflags": "+faststart"})
    data = good.read_bytes()
    (root / "empty.mp4").write_bytes(b"")
    (root / "truncated.mp4").write_bytes(data[: len(data) // 2])  # index (moov) lost
    (root / "truncated_fast.mp4").write_bytes(fast.read_bytes()[: len(data) // 2])  # index kept, frames lost
    (root / "notes.mp4").write_text("these are not the frames you are looking for\n" * 50)
    fb = fast.read_bytes()
    i = fb.find(b"mdat") + 4
    garbage = np.random.default_rng(0).integers(0, 256, len(fb) - i, dtype=np.uint8).tobytes()
    (root / "undecodable.mp4").write_bytes(fb[:i] + garbage)
    names = [
        "good.mp4",
        "missing.mp4",
        "empty.mp4",
        "truncated.mp4",
        "truncated_fast.mp4",
        "notes.mp4",
        "undecodable.mp4",
        "good.mp4",
    ]
    write_manifest(root, [{"path": n, "caption": n} for n in names])
    return root


CAUSES = {
    1: "not found",
    2: "empty",
    3: "container",
    4: "decode failed|truncated",
    5: "container",
    6: "decode failed|no decodable",
}


def test_building_never_fails_and_fetching_names_the_sample(bad_set):
    ds = hx.VideoClipDataset(bad_set / "manifest.jsonl", num_frames=4, size=32)  # no decode, no probe
    assert len(ds) == 8
    assert ds[0]["video"].shape == (4, 3, 32, 32) and ds[7]["video"].shape == (4, 3, 32, 32)
    for i, cause in CAUSES.items():
        with pytest.raises(hx.SampleError, match=cause) as err:
            ds[i]
        assert err.value.index == i and err.value.path == str(bad_set / ds.manifest.records[i]["path"])
        assert f"sample {i} (" in str(err.value)


def test_profiling_records_bad_rows_and_costing_names_them(bad_set, tmp_path):
    out = tmp_path / "profiles.jsonl"
    table = hx.profile_dataset(bad_set / "manifest.jsonl", out, calibrate_per_bucket=1)
    assert table.ok().tolist() == [True, False, False, False, True, False, True, True]
    ds = hx.VideoClipDataset(bad_set / "manifest.jsonl", num_frames=4, size=32, profiles=out)
    assert ds.estimate_cost(0).tokens > 0
    for i in (1, 2, 3, 5):
        with pytest.raises(hx.SampleError, match=CAUSES[i]) as err:
            ds.estimate_cost(i)
        assert err.value.index == i
    summary = {r["bucket"]: r["clips"] for r in table.summary()}
    assert summary["(failed)"] == 4


def test_costing_without_table_probes_and_names(bad_set):
    ds = hx.VideoClipDataset(bad_set / "manifest.jsonl", profiles=False)
    with pytest.raises(hx.SampleError, match="not found"):
        ds.estimate_cost(1)
    assert ds.estimate_cost(7).cpu_s > 0


@pytest.mark.parametrize(
    "line,cause",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "JSON object"),
        ('{"caption": "no path"}', "'path'"),
        ('{"path": "x.mp4", "label": "cat"}', "'label'"),
    ],
)
def test_malformed_manifest_line_names_its_number(tmp_path, line, cause):
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"path": "a.mp4"}) + "\n\n" + line + "\n")
    with pytest.raises(hx.ManifestError, match=cause) as err:
        hx.VideoClipDataset(tmp_path / "manifest.jsonl")
    assert err.value.line == 3 and "line 3" in str(err.value)


def test_missing_manifest_and_stale_profiles(tmp_path, kmix):
    with pytest.raises(FileNotFoundError, match="manifest"):
        hx.VideoClipDataset(tmp_path / "nope.jsonl")
    write_manifest(tmp_path, [{"path": str(kmix / "clip_000000.mp4")}])
    with pytest.raises(ValueError, match="re-run `helix profile`"):
        hx.VideoClipDataset(tmp_path / "manifest.jsonl", profiles=kmix / "profiles.jsonl")


def test_unknown_manifest_keys_are_kept(tmp_path, kmix):
    write_manifest(tmp_path, [{"path": str(kmix / "clip_000000.mp4"), "source": "yt", "extra": {"a": 1}}])
    ds = hx.VideoClipDataset(tmp_path / "manifest.jsonl")
    assert ds.manifest.records[0]["extra"] == {"a": 1} and ds.manifest.records[0]["source"] == "yt"
