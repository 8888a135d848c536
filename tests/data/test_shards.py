"""WebDataset tar shards as a dataset: the same samples as the clips as files (local, S3, HTTP),
the index built once and read back, bad members named by shard and key, the spec, torch workers."""

import io
import json
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

import helix_core as hx
from helix_core.data.shards.names import shard_urls, split_member
from helix_core.data.shards.tar import TarFormatError, members
from helix_core.data.specs import load_spec, make_spec
from helix_core.testing.objectstore import S3_TEST_ENV, RangeHTTPServer, S3Server


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HELIX_CACHE", str(tmp_path / "cache"))  # indexes that cannot sit beside their shards


@pytest.fixture
def packed(kmix, tmp_path):
    """kmix's six clips in two shards (4 + 2 samples) with their index; the brace pattern."""
    paths = hx.write_shards(kmix / "manifest.jsonl", tmp_path / "shards" / "train-%06d.tar", 4)
    assert [p.name for p in paths] == ["train-000000.tar", "train-000001.tar"]
    return tmp_path / "shards", str(tmp_path / "shards" / "train-{000000..000001}.tar")


def _index_files(folder):
    return sorted(folder.glob("*.idx.json"))


def _same_samples(a, b, indices):
    for i in indices:
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        assert torch.equal(x["video"], y["video"]), i
        assert all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x), i


def _tar(path, entries):
    """A tar of ``(name, bytes)`` entries, in order."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


# ---- the samples --------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["videomae", "qwen2-vl"])
def test_shards_give_the_samples_and_costs_of_the_clips_as_files(kmix, packed, model):
    _, pattern = packed
    files = hx.VideoClipDataset(kmix / "manifest.jsonl", model=model, random_flip=0.5, seed=3)
    shards = hx.WebDatasetClips(pattern, model=model, random_flip=0.5, seed=3)
    assert len(shards) == len(files) == 6 and shards.index.scanned == []  # write_shards left the index
    _same_samples(shards, files, [0, 2, 4, 5])
    shards.set_epoch(1)
    files.set_epoch(1)
    _same_samples(shards, files, [1, 3])
    for i in range(6):
        a, b = shards.estimate_cost(i), files.estimate_cost(i)
        assert (a.tokens, a.out_bytes, a.profile, a.io_bytes) == (b.tokens, b.out_bytes, b.profile, b.io_bytes)
        assert shards.video_shape(i) == files.video_shape(i)
        d, e = shards.descriptor(i), files.descriptor(i)
        assert (d.frames, d.width, d.height, d.fps, d.codec, d.bytes) == (
            e.frames,
            e.width,
            e.height,
            e.fps,
            e.codec,
            e.bytes,
        )
    costs = shards.cost_arrays()
    assert costs["ok"].all() and costs["tokens"].tolist() == files.cost_arrays()["tokens"].tolist()
    assert shards.manifest.records[1]["caption"] == files.manifest.records[1]["caption"]
    assert shards.sample_path(5).endswith("train-000001.tar#clip_000005.mp4")
    out = np.empty(shards.video_shape(2), dtype=np.uint8)
    sample, r = shards.fetch(2, out=out)
    assert sample["video"].data_ptr() == out.ctypes.data and r.frames_decoded > 0 and r.read_bytes == 0


def test_text_clips_carry_the_caption_and_its_tokens(kmix, packed):
    _, pattern = packed
    files = hx.VideoTextDataset(kmix / "manifest.jsonl", num_frames=4, max_text_len=16)
    shards = hx.WebDatasetTextClips(pattern, num_frames=4, max_text_len=16)
    assert shards.spec.model == "qwen2-vl"
    _same_samples(shards, files, [0, 3])
    assert shards[3]["caption"] == files.manifest.records[3]["caption"] and shards[3]["input_ids"].dtype == torch.int64


def test_txt_and_cls_members_are_the_caption_and_label(kmix, tmp_path):
    clip = (kmix / "clip_000000.mp4").read_bytes()
    entries = [("x1.mp4", clip), ("x1.txt", b"a red ball"), ("x1.cls", b"7\n")]
    shard = _tar(tmp_path / "a.tar", entries + [("x2.mp4", clip), ("x2.json", b'{"label": null}')])
    ds = hx.WebDatasetTextClips(str(shard), num_frames=4)
    assert ds.manifest.records[0]["caption"] == "a red ball" and ds[0]["caption"] == "a red ball"
    assert ds[0]["label"] == 7 and ds[1]["label"] == -1 and ds[1]["caption"] == ""


def test_patterns_expand_as_webdataset_expands_them(tmp_path):
    assert [os.path.basename(u) for u in shard_urls(str(tmp_path / "s-{000..002}.tar"))] == [
        "s-000.tar",
        "s-001.tar",
        "s-002.tar",
    ]
    urls = shard_urls("s3://b/x/{a,b}-{0..1}.tar::https://h/y-{8..9}.tar")
    assert urls == ["s3://b/x/a-0.tar", "s3://b/x/a-1.tar", "s3://b/x/b-0.tar", "s3://b/x/b-1.tar"] + [
        "https://h/y-8.tar",
        "https://h/y-9.tar",
    ]
    assert shard_urls(["rel/a.tar", "s3://b/c.tar"]) == [os.path.abspath("rel/a.tar"), "s3://b/c.tar"]
    assert split_member("dir/clip_07.seg.MP4") == ("dir/clip_07", "seg.mp4")
    assert split_member("__meta__") is None and split_member("README") is None


def test_the_tar_walk_reads_what_tarfile_reads():
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buf = io.BytesIO()
        long = "d/" * 60 + "k.json" if fmt != tarfile.GNU_FORMAT else "d/" + "long" * 40 + ".json"
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
            for name, data in [("a.mp4", b"x" * 1000), (long, b"{}"), ("b.cls", b"")]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            folder = tarfile.TarInfo("dir")
            folder.type = tarfile.DIRTYPE
            t.addfile(folder)
        raw = buf.getvalue()
        want = [(m.name, m.offset_data, m.size) for m in tarfile.open(fileobj=io.BytesIO(raw)) if m.isreg()]
        assert [tuple(m) for m in members(lambda o, n: raw[o : o + n], len(raw))] == want
    bad = bytearray(raw)
    bad[want[1][1] + 512 + 3] ^= 0xFF  # the third header's name: its checksum no longer holds
    with pytest.raises(TarFormatError, match="checksum") as e:
        list(members(lambda o, n: bytes(bad[o : o + n]), len(bad)))
    assert e.value.offset == want[1][1] + 512


# ---- the index ------------------------------------------------------------------------------------
def test_the_index_is_built_once_then_read_and_a_changed_shard_rescanned(packed):
    folder, pattern = packed
    for f in _index_files(folder):
        f.unlink()
    first = hx.WebDatasetClips(pattern)
    assert [os.path.basename(u) for u in first.index.scanned] == ["train-000000.tar", "train-000001.tar"]
    (index,) = _index_files(folder)
    assert first.index.location == str(index)
    stamp = index.stat().st_mtime_ns
    again = hx.WebDatasetClips(pattern)
    assert again.index.scanned == [] and index.stat().st_mtime_ns == stamp
    assert again.cost_arrays()["tokens"].tolist() == first.cost_arrays()["tokens"].tolist()
    with open(folder / "train-000001.tar", "ab") as f:
        f.write(bytes(10240))  # more end-of-archive padding: another size, the same samples
    third = hx.WebDatasetClips(pattern)
    assert [os.path.basename(u) for u in third.index.scanned] == ["train-000001.tar"] and len(third) == 6
    head, *rows = index.read_text().splitlines()  # JSON lines: the shards, then one line per sample
    assert [s["name"] for s in json.loads(head)["shards"]] == ["train-000000.tar", "train-000001.tar"]  # movable
    assert [s["samples"] for s in json.loads(head)["shards"]] == [4, 2] and len(rows) == 6
    assert json.loads(json.loads(rows[0])["text"])["json"]["caption"] == first.manifest.records[0]["caption"]


def test_webdataset_reads_the_written_shards_as_samples(packed):
    wds = pytest.importorskip("webdataset")
    folder, pattern = packed
    ds = hx.WebDatasetClips(pattern)
    got = [
        (s["__key__"], sorted(k for k in s if not k.startswith("__")))
        for s in wds.WebDataset(pattern, shardshuffle=False)
    ]
    assert got == [(ds.index.key[i], sorted(ds.index.members_of(i))) for i in range(len(ds))]
    first = next(iter(wds.WebDataset(pattern, shardshuffle=False)))
    assert json.loads(first["json"])["label"] == ds[0]["label"]


def test_written_shards_are_the_same_bytes_every_time(kmix, tmp_path):
    a = hx.write_shards(kmix / "manifest.jsonl", tmp_path / "a" / "s-%03d.tar", 3)
    b = hx.write_shards(kmix / "manifest.jsonl", tmp_path / "b" / "s-%03d.tar", 3)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    with pytest.raises(ValueError, match="printf field"):
        hx.write_shards(kmix / "manifest.jsonl", tmp_path / "c.tar", 3)


# ---- object stores --------------------------------------------------------------------------------
def test_shards_on_s3_index_beside_them_and_read_as_the_clips(kmix, tmp_path, monkeypatch):
    for k, v in S3_TEST_ENV.items():
        monkeypatch.setenv(k, v)
    paths = hx.write_shards(kmix / "manifest.jsonl", tmp_path / "six" / "train-%06d.tar", 1)  # a sample each
    files = hx.VideoClipDataset(kmix / "manifest.jsonl")
    with S3Server() as s3:
        for p in paths:
            s3.put("data", f"shards/{p.name}", p.read_bytes())
        url = "s3://data/shards/train-{000000..000005}.tar"
        remote = hx.WebDatasetClips(url, storage_options=s3.options)
        assert len(remote.index.scanned) == 6 and remote.index.location.startswith("s3://data/shards/")
        keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket="data")["Contents"]]
        assert any(k.endswith(".idx.json") for k in keys)  # written beside the shards
        again = hx.WebDatasetClips(url, storage_options=s3.options)
        assert again.index.scanned == []  # the shards' sizes from one listing of their folder
        _same_samples(again, files, [0, 5])
        assert again.fetch(1)[1].read_bytes == again.descriptor(1).bytes  # one read of the member
        assert again.sample_path(1) == "s3://data/shards/train-000001.tar#clip_000001.mp4"
        s3.put("data", "shards/train-000003.tar", paths[3].read_bytes() + bytes(10240))  # rewritten: another size
        third = hx.WebDatasetClips(url, storage_options=s3.options)
        assert third.index.scanned == ["s3://data/shards/train-000003.tar"]
        _same_samples(third, files, [3])


def test_shards_over_http_index_in_the_cache_and_read_as_the_local_ones(packed, tmp_path):
    folder, pattern = packed
    local = hx.WebDatasetClips(pattern)
    for f in _index_files(folder):
        f.unlink()
    with RangeHTTPServer(folder) as http:
        url = http.url("train-{000000..000001}.tar")
        remote = hx.WebDatasetClips(url)
        assert len(remote.index.scanned) == 2 and remote.index.location.startswith(str(tmp_path / "cache"))
        served = sum(http.served.values())
        again = hx.WebDatasetClips(url)
        assert again.index.scanned == [] and sum(http.served.values()) == served  # no byte read to build it
        _same_samples(again, local, [1, 4])
        before = sum(http.served.values())
        again[4]
        assert sum(http.served.values()) - before == again.descriptor(4).bytes


# ---- bad input ------------------------------------------------------------------------------------
@pytest.fixture
def bad_shards(kmix, tmp_path):
    """Shard 0: good, a text file as .mp4, a sample with no video, good. Shard 1: good, then cut
    in the middle of its second video."""
    clip = (kmix / "clip_000000.mp4").read_bytes()
    meta = json.dumps({"caption": "ok", "label": 1}).encode()
    _tar(
        tmp_path / "bad-0.tar",
        [
            ("a.mp4", clip),
            ("a.json", meta),
            ("b.mp4", b"these are not the frames you are looking for\n" * 40),
            ("b.json", meta),
            ("c.json", meta),
            ("d.mp4", clip),
        ],
    )
    s1 = _tar(tmp_path / "bad-1.tar", [("e.mp4", clip), ("f.mp4", clip), ("f.json", meta)])
    raw = s1.read_bytes()
    cut = raw.index(clip, 1024) + len(clip) // 2
    s1.write_bytes(raw[:cut])
    return str(tmp_path / "bad-{0..1}.tar")


def test_bad_members_name_their_shard_and_key(bad_shards):
    ds = hx.WebDatasetClips(bad_shards, num_frames=4, size=32)  # building never fails on one sample
    assert [ds.index.key[i] for i in range(len(ds))] == ["a", "b", "c", "d", "e", "f"]
    assert ds.cost_arrays()["ok"].tolist() == [True, False, False, True, True, False]
    causes = {1: ("bad-0.tar#b.mp4", "not a readable video"), 2: ("bad-0.tar#c", "no video member")}
    causes[5] = ("bad-1.tar#f.mp4", "truncated shard")
    for i, (where, cause) in causes.items():
        for call in (ds.__getitem__, ds.estimate_cost):
            with pytest.raises(hx.SampleError, match=cause) as e:
                call(i)
            assert e.value.index == i and e.value.path.endswith(where) and f"sample {i} (" in str(e.value)
    assert ds[0]["video"].shape == (4, 3, 32, 32) and ds[3]["label"] == -1 and ds[0]["label"] == 1


def test_a_shard_gone_after_indexing_fails_its_samples_and_a_new_one_fails_the_build(packed):
    folder, pattern = packed
    os.unlink(folder / "train-000001.tar")
    with pytest.warns(UserWarning, match="train-000001.tar is missing: its 2 samples"):
        ds = hx.WebDatasetClips(pattern)
    assert ds[0]["index"] == 0
    with pytest.raises(hx.SampleError, match="shard not found") as e:
        ds[4]
    assert e.value.path.endswith("train-000001.tar#clip_000004.mp4")
    with pytest.raises(FileNotFoundError, match="train-000002.tar does not exist"):
        hx.WebDatasetClips([folder / "train-000000.tar", folder / "train-000002.tar"])  # another set


def test_a_corrupt_header_keeps_the_samples_before_it(kmix, tmp_path):
    clip = (kmix / "clip_000000.mp4").read_bytes()
    shard = _tar(tmp_path / "c.tar", [("a.mp4", clip), ("b.mp4", clip)])
    raw = bytearray(shard.read_bytes())
    second = raw.index(b"b.mp4")
    raw[second + 120] ^= 0x55
    shard.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match=r"c.tar: not a readable tar from byte \d+ on \(not a tar header \(checksum"):
        ds = hx.WebDatasetClips(str(shard))
    assert len(ds) == 1 and "checksum" in ds.index.shard_errors[str(shard)]
    gz = tmp_path / "z.tar"
    gz.write_bytes(b"\x1f\x8b" + bytes(1022))
    with pytest.warns(UserWarning, match="compressed"), pytest.raises(ValueError, match="no samples"):
        hx.WebDatasetClips(str(gz))


def test_the_loader_skips_a_bad_member(bad_shards):
    ds = hx.WebDatasetClips(bad_shards, num_frames=4, size=32)
    good = [0, 3, 4]
    with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, on_error="skip", num_workers=1) as ld:
        batches = list(ld)  # the DataServer rebuilt the dataset from its JSON spec
        assert ld.stats()["skipped"] >= 3 and sum(len(b["index"]) for b in batches) == 6
        assert set(torch.cat([b["index"] for b in batches]).tolist()) <= set(good)


# ---- the spec and torch's workers -----------------------------------------------------------------
def test_the_spec_rebuilds_an_equal_dataset(packed):
    _, pattern = packed
    ds = hx.WebDatasetTextClips(pattern, model="videomae", num_frames=8, size=32, caption_key="caption", seed=5)
    _, payload, fmt = make_spec(ds, None, pickle_allowed=False)
    assert fmt == "json"
    again, _, _ = load_spec(payload, fmt, allow_pickle=False)
    assert type(again) is hx.WebDatasetTextClips and again.index.scanned == []
    assert again.helix_spec() == ds.helix_spec() and ds.helix_spec()["kwargs"]["shards"] == pattern
    assert len(again) == len(ds) and list(again.manifest.paths) == list(ds.manifest.paths)
    assert again.cost_arrays()["cpu_s"].tolist() == ds.cost_arrays()["cpu_s"].tolist()
    _same_samples(again, ds, [2])
    _same_samples(pickle.loads(pickle.dumps(ds)), ds, [4])  # by value too (cloudpickle, spawned workers)


def test_a_torch_dataloader_with_two_workers(packed):
    _, pattern = packed
    ds = hx.WebDatasetClips(pattern, num_frames=4, size=32)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2)
    batches = list(loader)
    assert [b["index"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]
    assert torch.equal(batches[1]["video"][2], ds[5]["video"])
