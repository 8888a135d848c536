"""Every argument of a dataset reaches the DataServer workers, or the loader refuses up front:
a JSON spec carries transforms (by import path), profile tables and absolute paths; what JSON
cannot carry travels by cloudpickle, and is refused by name where a cluster takes no pickle
(ClusterConfig(allow_pickle=False); an --insecure cluster beyond loopback, tests/launch/test_hosts.py)."""

import dataclasses
import json
import os

import pytest
import torch
from dataplane import CFG

import helix_core as hx
from helix_core.data.specs import make_spec
from helix_core.testing.datasets import flip_video

CFG_NO_PICKLE = dataclasses.replace(CFG, allow_pickle=False)  # a cluster that takes JSON specs only

DS = {"model": "videomae", "num_frames": 2, "size": 32}


def _videos(loader) -> dict[int, torch.Tensor]:
    return {int(i): v.clone() for b in loader for i, v in zip(b["index"], b["video"])}


@pytest.fixture(scope="module")
def open_cluster():
    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=CFG_NO_PICKLE) as c:  # JSON specs only
        yield c


def test_a_module_level_transform_travels_as_json_and_its_batches_are_transformed(kmix, open_cluster):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", transform=flip_video, **DS)
    spec = json.loads(make_spec(ds, None, pickle_allowed=False)[1])
    assert spec["dataset"]["kwargs"]["transform"] == "helix_core.testing.datasets:flip_video"
    plain = hx.VideoClipDataset(kmix / "manifest.jsonl", **DS)
    with hx.DistributedDataLoader(
        ds, batch_size=2, rank=0, world_size=1, coordinator=open_cluster.address, config=CFG
    ) as ld:
        got = _videos(ld)
    assert sorted(got) == list(range(len(ds)))
    for i, v in got.items():
        assert torch.equal(v, plain[i]["video"].flip(-1)) and torch.equal(v, ds[i]["video"])  # as torch would yield


def test_a_lambda_transform_is_refused_by_name_where_pickle_is_not_taken_and_travels_elsewhere(kmix, open_cluster):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", transform=lambda s, g: {**s, "video": s["video"].flip(-2)}, **DS)
    with pytest.raises(ValueError, match=r"transform=.*lambda.*module-level function.*cloudpickle"):
        hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, coordinator=open_cluster.address, config=CFG)
    with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, num_workers=1, config=CFG) as ld:
        got = _videos(ld)  # an embedded cluster takes cloudpickle
    for i, v in got.items():
        assert torch.equal(v, ds[i]["video"])


def test_a_subclass_without_its_own_helix_spec_is_not_rebuilt_as_its_base(kmix, open_cluster):
    class _Subclass(hx.VideoClipDataset):  # a training script's: adds state, no helix_spec of its own
        def __init__(self, *a, offset: int = 7, **kw):
            super().__init__(*a, **kw)
            self.offset = offset

        def __getitem__(self, i):
            s = super().__getitem__(i)
            s["label"] = s["label"] + self.offset
            return s

    ds = _Subclass(kmix / "manifest.jsonl", offset=1000, **DS)
    with pytest.raises(ValueError, match=r"fields of subclass _Subclass.*helix_spec"):
        hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, coordinator=open_cluster.address, config=CFG)
    assert make_spec(ds, None, pickle_allowed=True)[2] == "cloudpickle"
    with hx.DistributedDataLoader(ds, batch_size=3, rank=0, world_size=1, num_workers=1, config=CFG) as ld:
        labels = [int(x) for b in ld for x in b["label"]]
    assert labels == [ds[i]["label"] for i in range(len(ds))] and min(labels) >= 1000 - 1


def test_paths_travel_absolute_and_profiles_travel(kmix, monkeypatch):
    monkeypatch.chdir(kmix.parent)
    ds = hx.VideoClipDataset(os.path.join(kmix.name, "manifest.jsonl"), profiles=False, **DS)
    kwargs = json.loads(make_spec(ds, None, pickle_allowed=False)[1])["dataset"]["kwargs"]
    assert kwargs["manifest"] == str(kmix / "manifest.jsonl") and kwargs["profiles"] is False
    ds = hx.VideoClipDataset(
        os.path.join(kmix.name, "manifest.jsonl"), profiles=os.path.join(kmix.name, "profiles.jsonl"), **DS
    )
    kwargs = json.loads(make_spec(ds, None, pickle_allowed=False)[1])["dataset"]["kwargs"]
    assert kwargs["profiles"] == str(kmix / "profiles.jsonl")


def test_a_tokenizer_object_is_refused_by_name_where_pickle_is_not_taken(kmix):
    class Tokenizer:  # a Hugging Face-like tokenizer object
        def __call__(self, text, **kwargs):
            return {"input_ids": [1, 2]}

    ds = hx.VideoTextDataset(kmix / "manifest.jsonl", tokenizer=Tokenizer(), **DS)
    with pytest.raises(ValueError, match=r"tokenizer \(an object\).*local folder"):
        make_spec(ds, None, pickle_allowed=False)
    assert make_spec(ds, None, pickle_allowed=True)[2] == "cloudpickle"
