"""Clips by URL through the data plane (real DataServers on loopback): S3 objects and HTTP ranges
give the batches local files give, as a torch DataLoader's workers do; a bad object fails its batch
naming its URL (or is skipped) while the others are served; a slow object fails at its per-sample
timeout while the rest of the epoch is decoded; a YAML config names a manifest URL and its options.

The dataset side alone (formats, each fault, bytes fetched, the cache) is tests/data/test_remote_clips.py."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from dataplane import CFG, assert_same_batches, torch_batches

import helix_core as hx
from helix_core.data.media import synth

KW = dict(model="videomae", num_frames=4, size=32, profiles=False)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """Six clips with their manifest as JSON lines, CSV and Parquet (``m.*``), and ``bad.jsonl``:
    the clips with a missing object, a clip cut in half, a text file, a clip that answers 503 and
    one (a copy of clip 5) that answers 503 twice, then its bytes."""
    root = synth.make_dataset(tmp_path_factory.mktemp("remote"), "kinetics-mixed", num_clips=6, seed=3, scale=0.25)
    rows = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines() if line.strip()]
    rows = [{k: r[k] for k in ("path", "caption", "label", "num_frames", "size")} for r in rows]
    (root / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pacsv.write_csv(pa.Table.from_pylist(rows), root / "m.csv")
    pq.write_table(pa.Table.from_pylist(rows), root / "m.parquet")
    data = (root / "clip_000001.mp4").read_bytes()
    (root / "cut.mp4").write_bytes(data[: len(data) // 2])
    (root / "notes.mp4").write_text("not the frames you are looking for\n" * 40)
    (root / "unavailable.mp4").write_bytes(data)
    (root / "flaky.mp4").write_bytes((root / "clip_000005.mp4").read_bytes())
    bad = ["clip_000000.mp4", "missing.mp4", "flaky.mp4", "cut.mp4", "clip_000003.mp4", "notes.mp4"]
    bad += ["clip_000004.mp4", "unavailable.mp4"]
    (root / "bad.jsonl").write_text("".join(json.dumps({"path": p}) + "\n" for p in bad))
    return root


@pytest.fixture(scope="module")
def cluster(s3_env):
    with hx.LocalCluster(local_servers=1, workers_per_server=2, config=CFG) as c:
        yield c


@pytest.fixture(scope="module")
def local(clips):
    return hx.VideoClipDataset(clips / "m.jsonl", **KW)


def loader(ds, cluster, **kw):
    kw.setdefault("config", CFG)
    return hx.DistributedDataLoader(ds, coordinator=cluster.address, rank=0, world_size=1, **kw)


def test_s3_and_http_clips_give_the_local_batches_through_dataservers_and_torch_workers(cluster, s3, http, local):
    want = torch_batches(local, 2, 0, 1)
    for url, options in (
        (s3.url("clips", "m.jsonl"), s3.options),
        (s3.url("clips", "m.csv"), s3.options),
        (http.url("m.parquet"), {}),
    ):
        ds = hx.VideoClipDataset(url, storage_options=options, **KW)
        with loader(ds, cluster, batch_size=2, prefetch_depth=3) as ld:
            assert_same_batches(list(ld), want)
    # the same dataset object in a torch DataLoader's workers (both stores: tests/data/test_remote_clips.py)
    assert_same_batches(list(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2)), want)
    want = torch_batches(local, 2, 1, 2, shuffle=True, seed=5)  # one rank of two, shuffled
    ds = hx.VideoClipDataset(s3.url("clips", "m.parquet"), storage_options=s3.options, **KW)
    with hx.DistributedDataLoader(
        ds, 2, rank=1, world_size=2, shuffle=True, seed=5, coordinator=cluster.address, config=CFG
    ) as ld:
        assert_same_batches(list(ld), want)


def test_a_bad_object_fails_its_batch_naming_the_url_and_the_loader_serves_the_rest(cluster, http, local):
    http.fail("unavailable.mp4", 503, 10**6)
    http.fail("flaky.mp4", 503, 2)  # whichever process meets them (the loader costing it, a worker), it is retried
    ds = hx.VideoClipDataset(http.url("bad.jsonl"), remote={"retries": 2, "backoff_s": 0.01}, **KW)
    causes = {
        1: "object not found",
        3: "not a readable video container",
        5: "not a readable video container",
        7: r"503.*still failing after 2 retries",
    }
    with loader(ds, cluster, batch_size=1, prefetch_depth=4) as ld:
        it, got = iter(ld), []
        for i in range(len(ds)):
            if i in causes:
                with pytest.raises(hx.SampleError, match=causes[i]) as err:
                    next(it)
                assert (err.value.index, err.value.path) == (i, http.url(ds.manifest.records[i]["path"]))
            else:
                got.append(next(it))
        with pytest.raises(StopIteration):
            next(it)
    assert [int(b["index"]) for b in got] == [0, 2, 4, 6]
    for b, j in zip(got, (0, 5, 3, 4)):  # the good rows are clips 0, 5 (flaky), 3 and 4 of the local manifest
        assert torch.equal(b["video"][0], local[j]["video"])
    with loader(ds, cluster, batch_size=2, on_error="skip") as ld:
        batches = list(ld)
        assert ld.stats()["skipped"] >= len(causes)  # (a substitute drawn from the shard may be bad too)
    assert [len(b["index"]) for b in batches] == [2, 2, 2, 2]  # each bad row replaced from the shard
    assert not {int(i) for b in batches for i in b["index"]} & set(causes)


def test_a_slow_object_fails_at_its_timeout_while_the_dataservers_serve_the_others(cluster, http):
    """Clip 0 answers after 30 s and the sample timeout is 2 s: its batch fails once the worker
    gave up on it, naming the URL, and every other clip was served before then (by the other
    worker); with ``on_error="skip"`` the epoch ends without it, long before the object answers.
    (The worker tries the sample twice, straight into the slab and then the generic way: 2 x 2 s.)"""
    ds = hx.VideoClipDataset(http.url("m.jsonl"), remote={"timeout_s": 2.0}, **KW)
    for i in range(len(ds)):  # the loader costs each sample (a probe, without a profile table) once,
        ds.estimate_cost(i)  # here before the store turned slow, as after a first epoch
    http.slow("clip_000000.mp4", 30)
    others = [f"/clip_00000{i}.mp4" for i in range(1, 6)]
    with loader(ds, cluster, batch_size=1, prefetch_depth=6) as ld:
        t0 = time.monotonic()
        it = iter(ld)
        with pytest.raises(hx.SampleError, match="timed out after 2 s") as err:
            next(it)
        t_failed = time.monotonic()
        assert [int(b["index"]) for b in it] == [1, 2, 3, 4, 5]
    assert (err.value.index, err.value.path) == (0, http.url("clip_000000.mp4"))
    assert 2.0 <= t_failed - t0 < 20 and max(http.answered[p] for p in others) < t_failed
    t0 = time.monotonic()
    with loader(ds, cluster, batch_size=2, prefetch_depth=3, on_error="skip") as ld:
        batches = list(ld)
        assert ld.stats()["skipped"] == 1
    assert time.monotonic() - t0 < 20 and [len(b["index"]) for b in batches] == [2, 2, 2]
    assert 0 not in {int(i) for b in batches for i in b["index"]}


def _module_from_yaml(dataset: str, cluster) -> dict:
    """A HelixDataModule's arguments from YAML: ``dataset`` (its lines), batches of 2 from ``cluster``."""
    config = yaml.safe_load(f"""
        dataset:
{textwrap.indent(textwrap.dedent(dataset).strip(), " " * 10)}
          model: videomae
          num_frames: 4
          size: 32
        batch_size: 2
        coordinator: "{cluster.address}"
        loader_options: {{shuffle: false}}
    """)
    config["loader_options"]["config"] = CFG
    return config


def _assert_gives_the_local_batches(config: dict, local) -> None:
    from helix_lightning import HelixDataModule

    dm = HelixDataModule(**config)
    dm.setup("fit")
    try:
        assert_same_batches(list(dm.train_dataloader()), torch_batches(local, 2, 0, 1, collate_fn=hx.pad_collate))
    finally:
        dm.teardown("fit")


def test_a_yaml_config_names_a_manifest_url_with_its_storage_options(cluster, s3, local):
    from helix_lightning import HelixDataModule

    config = _module_from_yaml(
        f"""
        manifest: {s3.url("clips", "m.parquet")}
        storage_options: {{endpoint_url: "{s3.endpoint}"}}
        remote: {{timeout_s: 30, block_bytes: 65536}}
        """,
        cluster,
    )
    _assert_gives_the_local_batches(config, local)
    secret = {**config["dataset"], "storage_options": {"key": "AKIAEXAMPLE", "secret": "hunter2-secret"}}
    with pytest.raises(ValueError, match=r"dataset.storage_options\['key'\] is a credential.*AWS_ACCESS_KEY_ID"):
        HelixDataModule(dataset=secret, batch_size=2)
    with pytest.raises(ValueError, match=r"dataset.remote: unknown fields \['timeout'\]"):
        HelixDataModule(dataset={**config["dataset"], "remote": {"timeout": 3}}, batch_size=2)


def test_a_yaml_config_names_webdataset_shards_on_s3(cluster, s3, local, clips, tmp_path):
    from helix_lightning import HelixDataModule

    tars = hx.write_shards(clips / "m.jsonl", tmp_path / "train-%06d.tar", samples_per_shard=4)
    s3.put_tree(tmp_path, "clips", "shards")  # the shards and the index write_shards made beside them
    config = _module_from_yaml(
        f"""
        shards: "{s3.url("clips", f"shards/train-{{000000..{len(tars) - 1:06d}}}.tar")}"
        storage_options: {{endpoint_url: "{s3.endpoint}"}}
        """,
        cluster,
    )
    _assert_gives_the_local_batches(config, local)
    with pytest.raises(ValueError, match="exactly one of 'manifest'.*'shards'"):
        HelixDataModule(dataset={**config["dataset"], "manifest": "x.jsonl"}, batch_size=2)
