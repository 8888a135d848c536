"""User code reaches every DataServer the way it reaches torch's workers: a transform imported from
a module beside the training script, a Tier-2 policy from a module registered with
``cloudpickle.register_pickle_by_value``, and a function of ``__main__`` travel by value where the
cluster takes pickles; where it takes none, the loader refuses at construction naming the
argument, the module and the fix; servers the loader starts get its ``sys.path`` and working
directory; a spec a server cannot rebuild names the part that failed."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import uuid

import cloudpickle
import pytest
import torch
from dataplane import CFG, busy_segments, torch_batches, wait_for
from tier2run import run_ranks, skewed

import helix_core as hx
from helix_core.data.specs import load_spec, make_spec
from helix_core.data.usercode import installed, why_local
from helix_core.testing.datasets import flip_video

DS = {"model": "videomae", "num_frames": 2, "size": 32}

TRAIN = """
import sys

import torch
from torch.utils.data import DataLoader

import helix_core as hx
from mytransforms import flip_all  # a module beside this script, as users write them

ds = hx.VideoClipDataset(sys.argv[1], model="videomae", num_frames=2, size=32, transform=flip_all)
want = list(DataLoader(ds, batch_size=2, num_workers=1))
with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1) as loader:  # the embedded cluster
    got = list(loader)
assert len(got) == len(want), (len(got), len(want))
for g, w in zip(got, want):
    assert torch.equal(g["video"], w["video"]) and torch.equal(g["index"], w["index"])
print("SAME", len(got))
"""

TRANSFORMS = """
def flip_all(sample, generator):
    sample["video"] = sample["video"].flip(-1)
    return sample
"""


def _module_from(folder, source: str):
    """A module imported from ``folder`` by file path, as a test file or a notebook's helper is:
    in ``sys.modules``, but on no path a server searches."""
    name = f"user_{uuid.uuid4().hex[:8]}"
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_transform_from_a_module_beside_the_script_gives_torchs_batches(kmix, tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "train.py").write_text(TRAIN)
    (scripts / "mytransforms.py").write_text(TRANSFORMS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "scripts/train.py", str(kmix / "manifest.jsonl")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0 and "SAME" in run.stdout, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "CancelledError" not in run.stderr, run.stderr[-3000:]


def test_what_a_server_can_import_goes_by_name_and_the_rest_by_value(tmp_path):
    beside = _module_from(tmp_path, "def f(sample, generator):\n    return sample\n")
    assert installed("torch") and installed("helix_core.testing.datasets") and installed("json")
    assert why_local(flip_video) is None  # an installed package's function: by import path
    assert "is not installed where the DataServers run" in why_local(beside.f)
    assert why_local(lambda s, g: s) == "a lambda"
    main_fn = type(flip_video)(flip_video.__code__, {}, "main_fn")
    main_fn.__module__ = "__main__"
    assert "__main__" in why_local(main_fn)
    cloudpickle.register_pickle_by_value(sys.modules["helix_core.testing.datasets"])
    try:
        assert "register_pickle_by_value" in why_local(flip_video)  # the user asked for the value
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules["helix_core.testing.datasets"])


def test_a_module_servers_cannot_import_travels_by_value_where_pickles_are_taken(kmix, tmp_path):
    beside = _module_from(tmp_path, TRANSFORMS)
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", transform=beside.flip_all, **DS)
    _, payload, fmt = make_spec(ds, None, pickle_allowed=True)
    assert fmt == "cloudpickle"
    # a fresh interpreter that cannot import the module rebuilds the dataset and its transform
    code = (
        "import sys; from helix_core.data.specs import load_spec; "
        "ds, _, _ = load_spec(sys.stdin.buffer.read(), 'cloudpickle', True); print(ds[0]['video'].shape[-1])"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        input=payload,
        capture_output=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        cwd="/",
    )
    assert run.returncode == 0, run.stderr.decode()[-2000:]


def test_a_cluster_that_takes_no_pickle_refuses_at_construction_naming_argument_module_and_fix(kmix, tmp_path):
    beside = _module_from(tmp_path, TRANSFORMS)
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", transform=beside.flip_all, **DS)
    with hx.LocalCluster(
        local_servers=1, workers_per_server=1, config=dataclasses.replace(CFG, allow_pickle=False)
    ) as cluster:
        with pytest.raises(ValueError) as err:
            hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, coordinator=cluster.address, config=CFG)
    text = str(err.value)
    assert "transform=" in text and beside.__name__ in text and "not installed where the DataServers run" in text
    assert "PYTHONPATH" in text and "cloudpickle" in text


def test_a_spec_a_server_cannot_rebuild_names_the_part(kmix):
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", transform=flip_video, **DS)
    spec = json.loads(make_spec(ds, None, pickle_allowed=False)[1])
    spec["dataset"]["kwargs"]["transform"] = "no_such_module_here:flip"
    with pytest.raises(ValueError, match=r"cannot rebuild the transform \(no_such_module_here:flip\).*No module named"):
        load_spec(json.dumps(spec).encode(), "json", allow_pickle=False)
    spec = json.loads(make_spec(ds, None, pickle_allowed=False)[1])
    spec["collate_fn"] = "no_such_module_here:collate"
    with pytest.raises(ValueError, match=r"cannot rebuild the collate_fn \(no_such_module_here:collate\)"):
        load_spec(json.dumps(spec).encode(), "json", allow_pickle=False)


def test_servers_a_cluster_starts_get_the_clients_sys_path_and_working_directory(tmp_path, monkeypatch):
    extra = tmp_path / "on_path"
    extra.mkdir()
    monkeypatch.syspath_prepend(str(extra))
    monkeypatch.chdir(tmp_path)
    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=CFG) as cluster:
        pid = cluster.servers[0].pid
        environ = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        assert str(extra) in environ["PYTHONPATH"].split(os.pathsep)
        assert os.readlink(f"/proc/{pid}/cwd") == str(tmp_path)


POLICY = """
def heavy(sample):
    return {"heavy": int(sample["tokens"]) > 100}


def swap_all(features, args):  # every sample to the other rank of its step
    return [1 - f["rank"] for f in features]
"""


def test_a_tier2_policy_from_a_module_registered_by_value_decides_the_round(tmp_path):
    policy = _module_from(tmp_path, POLICY)
    cloudpickle.register_pickle_by_value(policy)
    try:
        with hx.LocalCluster(local_servers=2, workers_per_server=1, config=CFG, token=True) as cluster:
            ds = skewed(8)
            got, stats = run_ranks(cluster, ds, 2, {"feature_fn": policy.heavy, "sort_fn": policy.swap_all})
            for r in range(2):
                want = torch_batches(ds, 2, 1 - r, 2)
                assert [sorted(b["index"].tolist()) for _, b in got[r]] == [sorted(b["index"].tolist()) for b in want]
                assert not stats[r]["rebalance_errors"], stats[r]["rebalance_errors"]
            wait_for(lambda: not busy_segments(cluster), what="every slab released")
    finally:
        cloudpickle.unregister_pickle_by_value(policy)


def test_a_function_of_main_is_sent_by_value_and_batches_are_transformed(kmix):
    """What ``python train.py`` does with a transform defined in the script."""
    fn = type(flip_video)(flip_video.__code__, {"__builtins__": __builtins__}, "flip_in_main")
    fn.__module__ = "__main__"
    ds = hx.VideoClipDataset(kmix / "manifest.jsonl", transform=fn, **DS)
    assert make_spec(ds, None, pickle_allowed=True)[2] == "cloudpickle"
    with hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, num_workers=1, config=CFG) as ld:
        for b in ld:
            for i, v in zip(b["index"].tolist(), b["video"]):
                assert torch.equal(v, ds[i]["video"])
    assert torch.equal(ds[0]["video"], hx.VideoClipDataset(kmix / "manifest.jsonl", **DS)[0]["video"].flip(-1))
