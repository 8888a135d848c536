"""Profile tables of clips in an object store: a manifest at a URL, clips at URLs, probed by
header range reads, saved locally, keyed by URL, and taken by the dataset that reads them."""

import json

import numpy as np
import pytest

import helix_core as hx
from helix_core.data.manifest import Manifest
from helix_core.data.media.synth import make_dataset
from helix_core.data.profiles import PROBE_BLOCK_BYTES, _probe_storage, profile_dataset
from helix_core.data.storage.config import RemoteConfig, Storage
from helix_core.errors import SampleError
from helix_core.launch.cli import main
from helix_core.testing.objectstore import S3_TEST_ENV, S3Server

GEOMETRY = ("bytes", "frames", "width", "height", "fps", "duration_s", "codec", "frames_source", "bucket")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Six synthetic clips, their manifest and a manifest naming one more clip that is not there,
    in moto's S3; and the local folder they came from."""
    root = make_dataset(tmp_path_factory.mktemp("s3-clips"), "kinetics-mixed", num_clips=6, scale=0.25)
    rows = (root / "manifest.jsonl").read_text().splitlines()
    gone = json.dumps({**json.loads(rows[0]), "path": "clip_gone.mp4"})
    (root / "with-missing.jsonl").write_text("\n".join([*rows[:2], gone, *rows[2:]]) + "\n")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in S3_TEST_ENV.items():
            mp.setenv(k, v)
        with S3Server() as s3:
            yield root, s3, s3.put_tree(root, "clips", "kmix")


def test_a_profile_of_clips_at_urls_matches_the_local_one_and_is_keyed_by_url(store, tmp_path):
    root, s3, url = store
    remote = profile_dataset(f"{url}/manifest.jsonl", tmp_path / "remote.jsonl", calibrate_per_bucket=0, **_opts(s3))
    local = profile_dataset(root / "manifest.jsonl", tmp_path / "local.jsonl", calibrate_per_bucket=0)
    assert len(remote) == len(local) == 6 and remote.ok().all()
    for col in GEOMETRY:
        assert list(remote.columns[col]) == list(local.columns[col]), col
    urls = list(Manifest(f"{url}/manifest.jsonl", storage=Storage.of(s3.options)).paths)
    assert list(remote.path) == urls and all(u.startswith(f"{url}/clip_") for u in urls)
    saved = hx.ProfileTable.load(tmp_path / "remote.jsonl")  # saved locally, read back the same
    assert list(saved.path) == urls


def test_the_dataset_reading_the_urls_takes_the_table(store, tmp_path):
    """``VideoClipDataset(url manifest, profiles=local table)`` uses it: every estimate equals the
    local dataset's with the local table, without probing a clip."""
    root, s3, url = store
    profile_dataset(f"{url}/manifest.jsonl", tmp_path / "remote.jsonl", calibrate_per_bucket=0, **_opts(s3))
    profile_dataset(root / "manifest.jsonl", tmp_path / "local.jsonl", calibrate_per_bucket=0)
    remote = hx.VideoClipDataset(
        f"{url}/manifest.jsonl", profiles=tmp_path / "remote.jsonl", storage_options=s3.options, num_frames=8, size=64
    )
    local = hx.VideoClipDataset(root / "manifest.jsonl", profiles=tmp_path / "local.jsonl", num_frames=8, size=64)
    assert remote.table is not None and remote.cost_arrays() is not None
    for i in range(len(local)):
        assert remote.estimate_cost(i) == local.estimate_cost(i)
    assert not remote._probed  # costed from the table, not by probing the store
    with pytest.raises(ValueError, match="does not match manifest"):  # a local table is not the URLs'
        hx.VideoClipDataset(f"{url}/manifest.jsonl", profiles=tmp_path / "local.jsonl", storage_options=s3.options)


def test_a_missing_object_gets_an_error_row_not_a_crash(store, tmp_path):
    root, s3, url = store
    table = profile_dataset(f"{url}/with-missing.jsonl", tmp_path / "p.jsonl", calibrate_per_bucket=0, **_opts(s3))
    assert len(table) == 7 and list(table.ok()) == [True, True, False, True, True, True, True]
    assert table.path[2] == f"{url}/clip_gone.mp4" and "not found" in table.error[2]
    ds = hx.VideoClipDataset(f"{url}/with-missing.jsonl", profiles=tmp_path / "p.jsonl", storage_options=s3.options)
    with pytest.raises(SampleError, match="clip_gone"):
        ds.estimate_cost(2)
    third = json.loads((root / "manifest.jsonl").read_text().splitlines()[2])["path"]  # row 3, after the gone one
    assert ds.estimate_cost(3).io_bytes == (root / third).stat().st_size


def test_calibration_decodes_clips_at_urls(store, tmp_path):
    _, s3, url = store
    table = profile_dataset(f"{url}/manifest.jsonl", tmp_path / "p.jsonl", calibrate_per_bucket=1, **_opts(s3))
    assert table.fit.points >= 3 and len(table.calibration) == table.fit.points
    assert np.isfinite(table.cost_scale).all() and (table.cost_scale > 0).all()
    assert all(p["cpu_s"] > 0 for p in table.calibration)


def test_a_manifest_at_a_url_needs_out_and_options_never_carry_credentials(store, tmp_path):
    _, s3, url = store
    with pytest.raises(ValueError, match="out="):
        profile_dataset(f"{url}/manifest.jsonl", storage_options=s3.options)
    with pytest.raises(ValueError, match="credential"):
        profile_dataset(f"{url}/manifest.jsonl", tmp_path / "p.jsonl", storage_options={**s3.options, "secret": "x"})
    assert not (tmp_path / "p.jsonl").exists()


def test_probes_in_flight_keep_the_manifests_order(store, tmp_path):
    root, _, _ = store
    rows = (root / "manifest.jsonl").read_text().splitlines()
    rows = [json.dumps({**json.loads(r), "path": str(root / json.loads(r)["path"])}) for r in rows] * 4
    (tmp_path / "m.jsonl").write_text("\n".join(rows) + "\n")
    many = profile_dataset(tmp_path / "m.jsonl", tmp_path / "a.jsonl", calibrate_per_bucket=0, workers=2)
    one = profile_dataset(tmp_path / "m.jsonl", tmp_path / "b.jsonl", calibrate_per_bucket=0, workers=1)
    assert list(many.index) == list(range(24)) and list(many.path) == list(one.path)
    assert list(many.frames) == list(one.frames)
    with pytest.raises(ValueError, match="workers"):
        profile_dataset(tmp_path / "m.jsonl", tmp_path / "c.jsonl", workers=0)


def test_probes_read_headers_in_small_blocks_and_skip_the_cache(tmp_path):
    storage = Storage.of({"endpoint_url": "http://h:1"}, RemoteConfig(cache_dir=str(tmp_path), cache_bytes=1 << 30))
    probing = _probe_storage(storage)
    assert probing.remote.block_bytes == PROBE_BLOCK_BYTES > storage.remote.block_bytes
    assert probing.remote.cache_bytes == 0 and probing.options == storage.options
    large = Storage.of(None, RemoteConfig(block_bytes=1 << 20))
    assert _probe_storage(large).remote.block_bytes == 1 << 20  # already larger: kept


def test_the_command_profiles_a_manifest_at_a_url(store, tmp_path, capsys):
    _, s3, url = store
    out = tmp_path / "profiles.jsonl"
    endpoint = f"endpoint_url={s3.endpoint}"
    assert (
        main(["profile", f"{url}/manifest.jsonl", "--storage-option", endpoint, "--out", str(out), "--calibrate", "0"])
        == 0
    )
    assert hx.ProfileTable.load(out).ok().all() and "saved" in capsys.readouterr().out
    assert main(["profile", f"{url}/manifest.jsonl", "--storage-option", endpoint]) == 2
    assert "--out" in capsys.readouterr().out
    assert main(["profile", f"{url}/manifest.jsonl", "--storage-option", "key=abc", "--out", str(out)]) == 2
    assert "credential" in capsys.readouterr().out


def _opts(s3) -> dict:
    return {"storage_options": s3.options}
