"""Clips and manifests by URL, as a user meets them: the same samples from local files, from
``s3://`` objects (moto's S3 server) and from ``http://`` ranges, whatever the manifest's format;
bad objects and bad manifests as errors naming the URL, the row or the column; credentials refused
as arguments and refused by the store without showing them; a slow object held to the per-sample
timeout while the others are read; a sampled decode that fetches a fraction of a long clip, and a
block cache that serves it again without the store and keeps to its bound.

The data plane's side (DataServers, ``on_error="skip"``) is tests/loader/test_remote_loading.py."""

from __future__ import annotations

import json
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

import helix_core as hx
from helix_core.data.media import synth
from helix_core.data.media.decode import decode_frames, uniform_indices
from helix_core.data.specs import resolve
from helix_core.data.storage.config import Storage
from helix_core.data.storage.reader import RangeFile, StorageError, read_range
from helix_core.testing.objectstore import RangeHTTPServer, S3Server

KW = dict(model="videomae", num_frames=4, size=32, profiles=False)
FAST = {"backoff_s": 0.01}  # retries without the default backoff's quarter second
BAD = ["clip_000000.mp4", "missing.mp4", "cut.mp4", "cut_fast.mp4", "notes.mp4", "clip_000001.mp4"]


def flat_rows(root: Path) -> list[dict]:
    """The synthesized manifest's rows with the columns CSV can hold."""
    rows = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines() if line.strip()]
    return [{k: r[k] for k in ("path", "caption", "label", "num_frames", "size")} for r in rows]


def write_manifests(folder: Path, rows: list[dict], name: str = "m") -> None:
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.Table.from_pylist(rows)
    pacsv.write_csv(table, folder / f"{name}.csv")
    pq.write_table(table, folder / f"{name}.parquet")


def long_clip(path: Path, repeats: int = 8) -> Path:
    """1040 frames of 320x240 H.264 at 5 fps, a keyframe every 10, made in a second: one segment
    written by ``synth.write_clip``, muxed ``repeats`` times over with shifted timestamps."""
    spec = synth.ClipSpec("segment", 320, 240, 130, 5.0, 7, "L", 16, 224, "", 0)
    segment = synth.write_clip(path.with_name("segment.mp4"), spec)
    with av.open(str(path), "w", format="mp4") as out:
        stream = None
        for k in range(repeats):
            with av.open(str(segment)) as src:
                s = src.streams.video[0]
                stream = stream or out.add_stream_from_template(s)
                for p in src.demux(s):
                    if p.dts is not None:
                        p.pts, p.dts, p.stream = p.pts + k * s.duration, p.dts + k * s.duration, stream
                        out.mux(p)
    segment.unlink()
    return path


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """Four clips with their manifest as JSON lines, CSV and Parquet (``m.*``), and a manifest
    (``bad.*``) mixing two of them with a missing object, a clip cut in half (index at its end:
    lost; index first: frames lost), and a text file named .mp4."""
    root = synth.make_dataset(tmp_path_factory.mktemp("remote"), "kinetics-mixed", num_clips=4, seed=0, scale=0.25)
    rows = flat_rows(root)
    write_manifests(root, rows)
    data = (root / "clip_000002.mp4").read_bytes()
    (root / "cut.mp4").write_bytes(data[: len(data) // 2])
    spec = synth.plan_workload("kinetics-small", 1, scale=0.2)[0]
    fast = synth.write_clip(root / "fast.mp4", spec, options={"movflags": "+faststart"}).read_bytes()
    (root / "cut_fast.mp4").write_bytes(fast[: len(fast) // 2])
    (root / "notes.mp4").write_text("not the frames you are looking for\n" * 40)
    write_manifests(root, [{"path": n} for n in BAD], "bad")
    return root


@pytest.fixture(scope="module")
def local(clips):
    ds = hx.VideoClipDataset(clips / "m.jsonl", **KW)
    return ds, [ds[i] for i in range(len(ds))]


def at(store, s3, http, name: str) -> tuple[str, dict]:
    """``name``'s URL on ``store`` and the storage_options that reach it."""
    if store == "s3":
        return s3.url("clips", name), s3.options
    return http.url(name), {}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


# ---- the same samples --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
@pytest.mark.parametrize("store", ["s3", "http"])
def test_a_manifest_at_a_url_gives_the_local_samples_bit_for_bit(store, fmt, s3, http, local):
    url, options = at(store, s3, http, f"m.{fmt}")
    ds = hx.VideoClipDataset(url, storage_options=options, **KW)
    ref, want = local
    assert len(ds) == len(ref) == 4
    assert ds.manifest.paths[2] == url.rsplit("/", 1)[0] + "/clip_000002.mp4"  # relative to the manifest's folder
    for i in range(len(ds)):
        assert_same(ds[i], want[i])
        assert ds.estimate_cost(i) == ref.estimate_cost(i)
    spec = ds.helix_spec()  # what a DataServer rebuilds: the URL, its options and the remote knobs travel
    assert spec["kwargs"]["manifest"] == url and spec["kwargs"].get("storage_options") == (options or None)
    assert_same(resolve(spec["target"])(**spec["kwargs"])[3], want[3])


@pytest.mark.parametrize("store", ["s3", "http"])
def test_a_torch_dataloader_with_workers_reads_the_same_dataset_object(store, s3, http, local):
    url, options = at(store, s3, http, "m.parquet")
    ds = hx.VideoClipDataset(url, storage_options=options, remote={"block_bytes": 8192}, **KW)
    ds[0]  # the parent reads first: its fsspec event loop and sessions must not be what the forked workers use
    got = list(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2))
    want = list(torch.utils.data.DataLoader(local[0], batch_size=2))
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert_same(a, b)


# ---- bad objects ---------------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["s3", "http"])
def test_bad_objects_are_sample_errors_naming_the_url_and_the_others_still_read(store, s3, http, clips, local):
    url, options = at(store, s3, http, "bad.csv")
    ds = hx.VideoClipDataset(url, storage_options=options, remote=FAST, **KW)  # reads no clip
    causes = {
        1: r"object not found \(404 or no such key\)",
        2: r"not a readable video container.*cut short",  # its index was at the end
        3: r"decode failed|truncated",  # its index says more frames than it holds: as a local file
        4: r"not a readable video container",
    }
    for i, cause in causes.items():
        with pytest.raises(hx.SampleError, match=cause) as err:
            ds[i]
        assert err.value.index == i and err.value.path == url.rsplit("/", 1)[0] + "/" + BAD[i]
    assert torch.equal(ds[5]["video"], local[1][1]["video"]) and torch.equal(ds[0]["video"], local[1][0]["video"])


def test_a_503_that_recovers_is_retried_and_gives_the_same_bytes(http, local):
    ds = hx.VideoClipDataset(http.url("m.jsonl"), remote=FAST, **KW)
    ds[1]
    clean = http.requests["/clip_000001.mp4"]
    ds = hx.VideoClipDataset(http.url("m.jsonl"), remote=FAST, **KW)
    http.fail("clip_000001.mp4", 503, 2)
    assert_same(ds[1], local[1][1])
    assert http.requests["/clip_000001.mp4"] == 2 * clean + 2  # the two 503s, each tried again


def test_a_503_that_persists_is_a_sample_error_after_its_retries(http, local):
    ds = hx.VideoClipDataset(http.url("m.jsonl"), remote={"retries": 2, "backoff_s": 0.01}, **KW)
    http.fail("clip_000001.mp4", 503, 1000)
    t0 = time.monotonic()
    with pytest.raises(hx.SampleError, match=r"503.*still failing after 2 retries") as err:
        ds[1]
    assert err.value.path == http.url("clip_000001.mp4") and time.monotonic() - t0 < 5
    assert 3 <= http.requests["/clip_000001.mp4"] <= 6  # 3 tries (fsspec's stat asks HEAD, then GET), no more
    assert_same(ds[2], local[1][2])


@pytest.mark.parametrize("where", ["open", "decode"])
def test_a_read_that_fails_inside_pyav_comes_out_with_the_storage_cause(http, tmp_path, where):
    """PyAV reads the object through a Python file object; when a read raises inside ``av.open``
    or inside decoding, the sample's error is that read's cause (the URL, the 503), not FFmpeg's."""
    clip = long_clip(tmp_path / "long.mp4", repeats=2)
    with RangeHTTPServer(tmp_path) as server:
        url, storage = server.url("long.mp4"), Storage.of(None, {"block_bytes": 16384, "backoff_s": 0.01})
        idx = uniform_indices(260, 8)
        want = decode_frames(str(clip), idx, (32, 32))
        assert np.array_equal(decode_frames(url, idx, (32, 32), storage=storage).video, want.video)
        clean = server.requests["/long.mp4"]
        server.fail("long.mp4", 503, 1000, after=1 if where == "open" else clean - 2)  # 1: the stat's HEAD
        with pytest.raises(hx.SampleError) as err:
            decode_frames(url, idx, (32, 32), storage=storage, index=7)
    assert (err.value.index, err.value.path) == (7, url)
    assert err.value.cause.startswith("read: 503") and "after 3 retries" in err.value.cause, err.value.cause


def test_an_object_shorter_than_its_size_is_truncated_not_padded(http, clips):
    size = (clips / "clip_000003.mp4").stat().st_size
    f = RangeFile(http.url("clip_000003.mp4"), remote=Storage.of(None, FAST).remote, size=size + 5000)
    f.seek(size - 100)
    with pytest.raises(StorageError, match=r"truncated: bytes .* gave"):
        f.read(1000)


# ---- bad manifests -------------------------------------------------------------------------------
def test_bad_manifests_at_a_url_name_the_url_the_line_and_the_column(s3):
    s3.put("clips", "nopath.parquet", _parquet({"clip": ["a.mp4"], "label": [1]}))
    url = s3.url("clips", "nopath.parquet")
    with pytest.raises(hx.ManifestError, match=r"no column 'path'.*\['clip', 'label'\]") as err:
        hx.VideoClipDataset(url, storage_options=s3.options, **KW)
    assert err.value.manifest == url
    url = s3.put("clips", "broken.csv", b"path,label\na.mp4,1\nb.mp4,2\nc.mp4,3,4\nd.mp4,5\n")
    with pytest.raises(hx.ManifestError, match=r"Expected 2 columns, got 3") as err:
        hx.VideoClipDataset(url, storage_options=s3.options, **KW)
    assert (err.value.manifest, err.value.line) == (url, 4) and f"{url}, line 4:" in str(err.value)
    url = s3.put("clips", "broken.jsonl", b'{"path": "a.mp4"}\n{"path": "b.mp4",\n')
    with pytest.raises(hx.ManifestError, match="not valid JSON") as err:
        hx.VideoClipDataset(url, storage_options=s3.options, **KW)
    assert (err.value.manifest, err.value.line) == (url, 2)
    with pytest.raises(FileNotFoundError, match=r"s3://clips/nowhere\.jsonl.*not found"):
        hx.VideoClipDataset(s3.url("clips", "nowhere.jsonl"), storage_options=s3.options, **KW)


def _parquet(columns: dict) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue().to_pybytes()


# ---- credentials ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,name",
    [
        ({"key": "AKIAEXAMPLE", "secret": "hunter2-secret"}, "storage_options['key']"),
        ({"client_kwargs": {"aws_secret_access_key": "hunter2-secret"}}, "['aws_secret_access_key']"),
        ({"headers": {"Authorization": "Bearer hunter2-secret"}}, "storage_options['headers']"),
    ],
)
def test_credentials_as_storage_options_are_refused_saying_where_they_go(http, options, name):
    with pytest.raises(ValueError, match="is a credential") as err:
        hx.VideoClipDataset(http.url("m.jsonl"), storage_options=options, **KW)
    msg = str(err.value)
    assert name in msg and "AWS_SECRET_ACCESS_KEY" in msg and "~/.aws/credentials" in msg
    assert "hunter2" not in msg
    with pytest.raises(ValueError, match=r"remote: unknown fields \['timeout'\]; valid: .*timeout_s"):
        hx.VideoClipDataset(http.url("m.jsonl"), remote={"timeout": 3}, **KW)


def _require_auth(s3: S3Server, actions: str) -> None:
    """moto checks credentials after ``actions`` more requests (``"inf"``: never again)."""
    req = urllib.request.Request(
        s3.endpoint + "/moto-api/reset-auth",
        data=actions.encode(),
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    urllib.request.urlopen(req, timeout=10).read()


def test_refused_credentials_say_access_was_refused_without_showing_the_secret(s3, http, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-secret")
    options = {**s3.options, "config_kwargs": {"connect_timeout": 5}}  # other options: a filesystem that reads it
    ds = hx.VideoClipDataset(s3.url("clips", "m.jsonl"), storage_options=options, **KW)
    _require_auth(s3, "0")  # from now on the store checks the key: moto's IAM has none
    try:
        with pytest.raises(PermissionError, match=r"manifest s3://clips/m\.jsonl: .*access refused \(403") as err:
            hx.VideoClipDataset(s3.url("clips", "m.jsonl"), storage_options=options, **KW)
        with pytest.raises(hx.SampleError, match=r"access refused \(403: check the credentials") as sample:
            ds[2]
    finally:
        _require_auth(s3, "inf")
    for e in (err.value, sample.value):
        assert "hunter2" not in "".join(traceback.format_exception(e))
    assert sample.value.path == s3.url("clips", "clip_000002.mp4")
    http.fail("clip_000001.mp4", 403, 1000)  # an HTTP store that refuses the request
    with pytest.raises(hx.SampleError, match=r"access refused \(403") as err:
        hx.VideoClipDataset(http.url("m.jsonl"), **KW)[1]
    assert err.value.path == http.url("clip_000001.mp4")
    assert http.requests["/clip_000001.mp4"] <= 2  # one try (fsspec's stat asks HEAD, then GET): never retried


# ---- a slow object -------------------------------------------------------------------------------
def test_a_slow_object_times_out_while_the_other_samples_are_read(http):
    """One object answers after 30 s: its sample fails at its 3 s timeout, naming the URL, and the
    others — from the same server, through the same process's fsspec event loop — are read meanwhile."""
    ds = hx.VideoClipDataset(http.url("m.jsonl"), remote={"timeout_s": 3.0}, **KW)
    http.slow("clip_000000.mp4", 30)
    failed: list = []

    def slow_sample():
        try:
            ds[0]
        except hx.SampleError as e:
            failed.append((time.monotonic(), e))

    t0 = time.monotonic()
    thread = threading.Thread(target=slow_sample, daemon=True)
    thread.start()
    for i in (1, 2, 3):
        assert ds[i]["video"].shape == (4, 3, 32, 32)
    others_done = time.monotonic()
    thread.join(20)
    assert failed, "the slow sample neither failed nor finished within 20 s"
    t_failed, err = failed[0]
    assert others_done < t_failed and 3.0 <= t_failed - t0 < 15, (others_done - t0, t_failed - t0)
    assert err.path == http.url("clip_000000.mp4") and "timed out after 3 s" in err.cause


@pytest.mark.parametrize("retries", [0, 3])
def test_a_read_cut_at_its_timeout_says_timed_out_whatever_the_retries(http, retries):
    http.slow("clip_000002.mp4", 10)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"^http://.*/clip_000002\.mp4: read: timed out after 0\.5 s$"):
        read_range(
            http.url("clip_000002.mp4"), 0, 100, remote=Storage.of(None, {"timeout_s": 0.5, "retries": retries}).remote
        )
    assert time.monotonic() - t0 < 5


# ---- bytes fetched and the block cache -----------------------------------------------------------
@pytest.fixture(scope="module")
def long_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    long_clip(root / "long.mp4")
    (root / "long.jsonl").write_text(json.dumps({"path": "long.mp4"}) + "\n")
    with RangeHTTPServer(root) as server:
        yield root, server


def test_a_sampled_decode_fetches_a_fraction_of_a_long_clip(long_store):
    root, server = long_store
    size = (root / "long.mp4").stat().st_size
    kw = dict(model="videomae", num_frames=16, size=64, profiles=False)
    ds = hx.VideoClipDataset(server.url("long.jsonl"), remote={"block_bytes": 32768}, **kw)
    ds.descriptor(0)  # the probe: the container's header
    probed = server.served["/long.mp4"]
    sample, r = ds.fetch(0)
    assert r.strategy == "seek" and r.frames_decoded < 200  # 16 frames 69 apart, a keyframe every 10
    assert server.served["/long.mp4"] - probed == r.read_bytes  # Decoded counts what the store sent
    ratio, total = r.read_bytes / size, server.served["/long.mp4"] / size
    assert ratio < 0.6 and total < 0.6, f"the decode fetched {ratio:.0%} of the clip, with the probe {total:.0%}"
    assert torch.equal(sample["video"], hx.VideoClipDataset(root / "long.jsonl", **kw)[0]["video"])


def test_the_block_cache_serves_a_second_decode_without_the_store_and_keeps_its_bound(long_store, tmp_path):
    root, server = long_store
    kw = dict(model="videomae", num_frames=16, size=64, profiles=False)
    cache = {"block_bytes": 32768, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 8 << 20}
    ds = hx.VideoClipDataset(server.url("long.jsonl"), remote=cache, **kw)
    first, r1 = ds.fetch(0)
    assert r1.read_bytes > 0
    served = server.served["/long.mp4"]
    again = hx.VideoClipDataset(server.url("long.jsonl"), remote=cache, **kw)  # a new dataset, as another worker
    second, r2 = again.fetch(0)
    assert r2.read_bytes == 0 and server.served["/long.mp4"] == served  # not one byte more from the store
    assert torch.equal(first["video"], second["video"])

    bound = 96 * 1024  # far less than a decode fetches
    small = {**cache, "cache_dir": str(tmp_path / "small"), "cache_bytes": bound}
    for num_frames in (16, 12, 8, 16):
        hx.VideoClipDataset(server.url("long.jsonl"), remote=small, **{**kw, "num_frames": num_frames}).fetch(0)
        held = sum(p.stat().st_size for p in (tmp_path / "small").rglob("*") if p.is_file())
        assert 0 < held <= bound


def test_remote_config_is_checked_when_the_dataset_is_built(http):
    for remote, match in (
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"block_bytes": 100}, "block_bytes must be an int >= 4096"),
        ({"cache_bytes": 1 << 20}, "cache_bytes needs a cache_dir"),
    ):
        with pytest.raises(ValueError, match=match):
            hx.VideoClipDataset(http.url("m.jsonl"), remote=remote, **KW)


def test_readers_of_other_block_sizes_share_a_cache_folder_without_mixing_blocks(long_store, tmp_path):
    root, server = long_store
    want = (root / "long.mp4").read_bytes()
    for block in (32 << 10, 48 << 10, 32 << 10):  # the third is served from the cache the first filled
        remote = hx.RemoteConfig(block_bytes=block, cache_dir=str(tmp_path), cache_bytes=64 << 20)
        f = RangeFile(server.url("long.mp4"), None, remote)
        assert f.read() == want
    assert f.fetched_bytes == 0
