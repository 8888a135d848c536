"""Cost model and profile table (pure parts plus a real calibration)."""

import json

import numpy as np
import pytest

import helix_core as hx
from helix_core.data.costs import profile_bucket
from helix_core.data.profiles import ProfileTable


def _desc(frames=120, w=320, h=180, index=0):
    return hx.SampleDescriptor(
        index=index,
        path=f"/x/{index}.mp4",
        bytes=1000,
        duration_s=frames / 30,
        fps=30.0,
        frames=frames,
        width=w,
        height=h,
        codec="h264",
    )


def test_profile_bucket():
    assert profile_bucket(130, 398, 224) == "128f@224p"
    assert profile_bucket(np.array([16, 300]), np.array([1280, 360]), np.array([720, 640])).tolist() == [
        "16f@720p",
        "256f@352p",
    ]


def test_cost_model_update_converges_to_measurements():
    model = hx.CostModel(hx.CostFit(0.0, 1e-9, 0.0), work_fn=lambda d: (d.frames * d.width * d.height, 0.0))
    d = _desc()
    base = model.predict(d)
    assert base == pytest.approx(120 * 320 * 180 * 1e-9)
    for _ in range(40):
        model.update(d, 2 * base)
    assert model.predict(d) == pytest.approx(2 * base, rel=0.01)
    other = _desc(frames=16, w=1280, h=720)  # another bucket keeps its own correction
    assert model.predict(other) == pytest.approx(16 * 1280 * 720 * 1e-9)
    with pytest.raises(ValueError):
        model.update(d, float("nan"))


def test_cost_fit_validates():
    with pytest.raises(ValueError, match="s_per_decoded_px"):
        hx.CostFit(s_per_decoded_px=-1.0)


def test_calibration_fits_real_decodes(kmix):
    table = ProfileTable.load(kmix / "profiles.jsonl")
    descs = [table.descriptor(i) for i in range(len(table))]
    fit, scale, points = hx.calibrate(descs, per_bucket=1)
    assert fit.points == len(points) == 2 * len(scale) and len(scale) >= 2
    assert fit.s_per_decoded_px > 0 or fit.s_per_output_px > 0
    for p in points:  # the fit explains the measurements within a factor 3 (noisy shared machine)
        assert p["cpu_s"] / 3 < fit.predict(p["decoded_px"], p["output_px"]) < p["cpu_s"] * 3 + 0.02


def test_profile_table_roundtrip_and_header(kmix, tmp_path):
    table = ProfileTable.load(kmix / "profiles.jsonl")
    header = json.loads((kmix / "profiles.jsonl").read_text().splitlines()[0])
    assert header["helix_profiles"] == 1 and header["fit"]["points"] == table.fit.points
    copy = ProfileTable.load(table.save(tmp_path / "p.jsonl"))
    assert copy.descriptor(3) == table.descriptor(3)
    assert copy.fit == table.fit and list(copy.bucket) == list(table.bucket)


def test_large_table_loads_columnar(tmp_path):
    n = 20_000
    rows = [
        {
            "index": i,
            "path": f"c{i}.mp4",
            "bytes": 1000 + i,
            "duration_s": 5.0,
            "fps": 30.0,
            "frames": 150,
            "width": 398,
            "height": 224,
            "caption_len": 10,
            "cost_scale": 1.0,
            "codec": "h264",
            "locality": "local",
            "frames_source": "header",
            "duration_source": "header",
            "bucket": "128f@224p",
            "error": None,
        }
        for i in range(n)
    ]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"helix_profiles": 1, "fit": {}}) + "\n" + "".join(json.dumps(r) + "\n" for r in rows))
    t = ProfileTable.load(path)
    assert len(t) == n and t.bytes.dtype == np.int64 and t.bytes[-1] == 1000 + n - 1
    assert t.ok().all() and t.descriptor(7).path == "c7.mp4"


def test_bad_table_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("{}\n")
    with pytest.raises(ValueError, match="line 1"):
        ProfileTable.load(path)
    path.write_text(json.dumps({"helix_profiles": 1, "fit": {}}) + '\n{"index": "x"}\n')
    with pytest.raises(ValueError, match="helix profile"):
        ProfileTable.load(path)
