"""A manifest that states its clips' geometry (Open-Sora's height, width, num_frames, fps; bytes)
costs every sample without opening a clip; equal geometry costs what a probe of the clip costs;
what is decoded is always the clip's own; a profile table still wins."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

import helix_core as hx
from helix_core.data.costs import profile_bucket
from helix_core.data.manifest import Manifest
from helix_core.data.media.probe import probe
from helix_core.data.video import ESTIMATED_BITS_PER_PIXEL
from helix_core.loader.costing import PlanCosts

KEYS = {"cpu_s", "out_bytes", "tokens", "t", "h", "w", "io_bytes", "bucket", "ok"}


def _write(path, rows: list[dict]):
    """``rows`` as a manifest in the format of ``path``'s suffix."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    keys = dict.fromkeys(k for r in rows for k in r)  # every row's columns, null where a row lacks one
    table = pa.table({k: [r.get(k) for r in rows] for k in keys})
    (pacsv.write_csv if path.suffix == ".csv" else pq.write_table)(table, path)
    return path


def _missing_clips(n: int) -> list[dict]:
    return [
        {"path": f"clips/{i:03d}.mp4", "num_frames": 90 + 30 * i, "height": 360, "width": 640, "fps": 30.0}
        | ({"bytes": 1000 * (i + 1)} if i % 2 == 0 else {})
        for i in range(n)
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_manifest_stating_geometry_is_costed_without_opening_a_clip(tmp_path, fmt, monkeypatch):
    import helix_core.data.video as video

    def no_probe(*args, **kwargs):
        raise AssertionError("a clip was probed")

    monkeypatch.setattr(video, "probe", no_probe)
    manifest = _write(tmp_path / f"m.{fmt}", _missing_clips(4))  # none of these clips exists
    ds = hx.VideoClipDataset(manifest, model="videomae", num_frames=16, size=224)
    arrays = ds.cost_arrays()
    assert arrays is not None and set(arrays) == KEYS and all(len(v) == 4 for v in arrays.values())
    assert arrays["ok"].all() and arrays["tokens"].tolist() == [1568] * 4  # 16 frames at 224²
    assert arrays["bucket"].tolist() == profile_bucket([90, 120, 150, 180], [640] * 4, [360] * 4).tolist()
    estimate = round(180 * 360 * 640 * ESTIMATED_BITS_PER_PIXEL / 8)  # no bytes column in row 3
    assert arrays["io_bytes"].tolist() == [1000, round(120 * 360 * 640 * ESTIMATED_BITS_PER_PIXEL / 8), 3000, estimate]
    c = ds.estimate_cost(3)
    assert (c.tokens, c.io_bytes, c.out_bytes, c.profile) == (1568, estimate, 16 * 3 * 224 * 224, "16x224x224")
    assert c.cpu_s == arrays["cpu_s"][3]
    ds.observe_cost(3, 2 * c.cpu_s)  # the measurement refines the row's bucket, still without a probe
    assert ds.cost_model.corrections[arrays["bucket"][3]] > 1.0 and ds.estimate_cost(3).cpu_s > c.cpu_s
    plan = PlanCosts(ds, lambda tokens: np.asarray(tokens, dtype=np.float64))
    assert plan._units is not None  # the Tier-1 planner costs every sample at once, as with a table
    monkeypatch.undo()
    with pytest.raises(hx.SampleError, match=r"clips/001\.mp4.*file not found") as err:
        ds.fetch(1)  # decoding opens the clip itself
    assert err.value.index == 1


def test_a_row_without_geometry_is_probed_when_costed_and_the_others_are_not(tmp_path):
    rows = _missing_clips(3)
    del rows[1]["height"]
    ds = hx.VideoClipDataset(_write(tmp_path / "m.parquet", rows), model="wan", num_frames=17, size=128)
    assert ds.cost_arrays() is None  # not every row states its geometry
    assert ds.estimate_cost(0).tokens == hx.tokens.wan(17, 128, 224)  # 360x640 to a 128 short side
    with pytest.raises(hx.SampleError, match="file not found"):
        ds.estimate_cost(1)  # probed, and its clip is missing


def test_frames_from_duration_fps_from_frames_and_qwen_needs_a_rate(tmp_path):
    rows = [
        {"path": "a.mp4", "height": 224, "width": 398, "duration": 5.0, "fps": 24.0},  # 120 frames
        {"path": "b.mp4", "height": 224, "width": 398, "num_frames": 150, "duration": 5.0},  # 30 fps
    ]
    m = Manifest(_write(tmp_path / "m.csv", rows))
    s = m.source_hints()
    assert s.frames.tolist() == [120.0, 150.0] and s.fps.tolist() == [24.0, 30.0]
    assert np.isnan(s.bytes).all() and m.output_hints() == (None, None)
    qwen = hx.VideoClipDataset(tmp_path / "m.csv", model="qwen2-vl")
    assert qwen.cost_arrays()["t"].tolist() == [10, 10]  # 2 fps of 5 s
    rows[1].pop("duration")  # no rate left for b.mp4: Qwen's 2-fps sampling cannot cost it
    _write(tmp_path / "n.csv", rows)
    assert hx.VideoClipDataset(tmp_path / "n.csv", model="qwen2-vl").cost_arrays() is None
    assert hx.VideoClipDataset(tmp_path / "n.csv", model="qwen2-vl", num_frames=8).cost_arrays() is not None
    assert hx.VideoClipDataset(tmp_path / "n.csv", model="videomae").cost_arrays() is not None


def test_num_frames_is_an_output_hint_only_without_height_and_width(tmp_path):
    synth_like = Manifest(_write(tmp_path / "a.parquet", [{"path": "a.mp4", "num_frames": 32, "size": 336}]))
    frames, size = synth_like.output_hints()
    assert frames.tolist() == [32.0] and size.tolist() == [336.0] and synth_like.source_hints() is None
    sized = [{"path": "a.mp4", "num_frames": 300, "height": 480, "width": 640, "size": 336}]
    opensora = Manifest(_write(tmp_path / "b.parquet", sized))
    frames, size = opensora.output_hints()
    assert frames is None and size.tolist() == [336.0] and opensora.source_hints().frames.tolist() == [300.0]
    c = hx.VideoClipDataset(tmp_path / "b.parquet", model="videomae").estimate_cost(0)
    assert c.profile == "16x336x336"  # the family's 16 frames, the row's size; 300 is the clip's length


def _probed_rows(root):
    """The openvid clips' manifest rows with the geometry their probes read (absolute paths)."""
    rows = []
    for line in (root / "manifest.jsonl").read_text().splitlines():
        r = json.loads(line)
        d = probe(root / r["path"])
        rows.append(
            {
                "path": str(root / r["path"]),
                "caption": r["caption"],
                "label": r["label"],
                "num_frames": d.frames,
                "height": d.height,
                "width": d.width,
                "fps": d.fps,
                "bytes": d.bytes,
            }
        )
    return rows


@pytest.mark.parametrize(
    "model,kw",
    [("videomae", {}), ("qwen2-vl", {}), ("wan", {"num_frames": 17, "size": 64}), ("qwen2-vl", {"size": 112})],
)
def test_equal_geometry_costs_what_a_probe_costs(openvid, tmp_path, model, kw):
    rows = _probed_rows(openvid)
    stated = hx.VideoClipDataset(_write(tmp_path / "geo.parquet", rows), model=model, **kw)
    bare = [{k: r[k] for k in ("path", "caption", "label")} for r in rows]
    probed = hx.VideoClipDataset(_write(tmp_path / "bare.jsonl", bare), model=model, **kw)
    assert probed.cost_arrays() is None and stated.cost_arrays() is not None
    for i in range(len(rows)):
        assert stated.estimate_cost(i) == probed.estimate_cost(i)
        assert stated.cost_arrays()["bucket"][i] == profile_bucket(
            rows[i]["num_frames"], rows[i]["width"], rows[i]["height"]
        )


def test_a_wrong_geometry_never_changes_what_is_decoded(openvid, tmp_path):
    rows = _probed_rows(openvid)
    wrong = [r | {"num_frames": 9999, "height": 1080, "width": 1920, "fps": 5.0} for r in rows]
    kw = dict(model="qwen2-vl", num_frames=4, size=112)
    lying = hx.VideoClipDataset(_write(tmp_path / "wrong.csv", wrong), **kw)
    truthful = hx.VideoClipDataset(_write(tmp_path / "right.csv", rows), **kw)
    assert lying.cost_arrays()["tokens"].tolist() != truthful.cost_arrays()["tokens"].tolist()  # planned as stated
    for i in range(len(rows)):
        assert lying.video_shape(i) == truthful.video_shape(i)
        a, b = lying[i], truthful[i]
        assert torch.equal(a["video"], b["video"]) and a["tokens"] == b["tokens"]
        assert a["video_grid_thw"].tolist() == b["video_grid_thw"].tolist()


def test_a_profile_table_wins_over_the_manifests_geometry(kmix, tmp_path):
    rows = [json.loads(line) for line in (kmix / "manifest.jsonl").read_text().splitlines()]
    wrong = [{"path": r["path"], "num_frames": 5000, "height": 1080, "width": 1920, "fps": 60.0} for r in rows]
    geo = _write(kmix / "geo-wrong.parquet", wrong)  # beside the clips: the same resolved paths
    try:
        kw = dict(model="wan", num_frames=17, size=64, profiles=kmix / "profiles.jsonl")
        with_table = hx.VideoClipDataset(geo, **kw).cost_arrays()
        reference = hx.VideoClipDataset(kmix / "manifest.jsonl", **kw).cost_arrays()
        for k in KEYS:
            assert np.asarray(with_table[k]).tolist() == np.asarray(reference[k]).tolist(), k
    finally:
        geo.unlink()
