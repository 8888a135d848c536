"""Manifests in CSV and Parquet beside JSON lines: the same clips give the same samples whatever
the format and whatever the columns are called; a bad manifest is an error naming the file, the
column and the row."""

import json

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

import helix_core as hx
from helix_core.data.manifest import Manifest
from helix_core.data.specs import resolve


def _rows(root):
    return [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines() if line.strip()]


def _renamed(rows):
    """The manifest's flat columns under a user's names (video, text), and an extra column."""
    return [
        {
            "video": r["path"],
            "text": r["caption"],
            "source": "yt",
            **{k: v for k, v in r.items() if k not in ("path", "caption") and not isinstance(v, dict)},
        }
        for r in rows
    ]


@pytest.fixture(scope="module")
def formats(openvid, tmp_path_factory):
    """The openvid clips as a JSON-lines, a CSV and a Parquet manifest, each with columns video / text."""
    out = tmp_path_factory.mktemp("formats")
    rows = _renamed(_rows(openvid))
    for r in rows:
        r["video"] = str(openvid / r["video"])
    (out / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.Table.from_pylist(rows)
    pacsv.write_csv(table, out / "m.csv")
    pq.write_table(table, out / "m.parquet")
    return out


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_csv_and_parquet_give_the_samples_json_lines_give(formats, fmt):
    kw = dict(model="videomae", num_frames=4, size=64, path_key="video", caption_key="text", profiles=False)
    ref = hx.VideoClipDataset(formats / "m.jsonl", **kw)
    ds = hx.VideoClipDataset(formats / f"m.{fmt}", **kw)
    assert len(ds) == len(ref) == 4
    assert list(ds.manifest.paths) == list(ref.manifest.paths)
    assert (
        ds.manifest.records[1]["caption"] == ref.manifest.records[1]["caption"]
        and ds.manifest.records[1]["source"] == "yt"
    )
    for i in range(len(ds)):
        a, b = ds[i], ref[i]
        assert torch.equal(a["video"], b["video"]) and a["tokens"] == b["tokens"]
        assert ds.estimate_cost(i) == ref.estimate_cost(i)
    spec = ds.helix_spec()  # what a DataServer worker rebuilds: the same columns
    rebuilt = resolve(spec["target"])(**spec["kwargs"])
    assert torch.equal(rebuilt[2]["video"], ds[2]["video"])


def test_a_columnar_manifest_keeps_hints_as_arrays(tmp_path):
    pq.write_table(pa.table({"path": ["a.mp4", "b.mp4"], "num_frames": [16, None]}), tmp_path / "m.parquet")
    m = Manifest(tmp_path / "m.parquet")
    assert m.hint("num_frames")[0] == 16.0 and str(m.hint("num_frames")[1]) == "nan"
    assert str(m.hint("size")[0]) == "nan" and m.paths[-1] == str(tmp_path / "b.mp4")
    assert m.records[0] == {"path": "a.mp4", "num_frames": 16}


def test_bad_columnar_manifests_name_file_column_and_row(tmp_path):
    pq.write_table(pa.table({"clip": ["a.mp4"]}), tmp_path / "nopath.parquet")
    with pytest.raises(hx.ManifestError, match=r"nopath\.parquet.*no column 'path'.*\['clip'\]"):
        Manifest(tmp_path / "nopath.parquet")
    (tmp_path / "empty.csv").write_text("path,label\na.mp4,1\n,2\n")
    with pytest.raises(hx.ManifestError, match=r"empty\.csv.*line 3.*'path'") as err:
        Manifest(tmp_path / "empty.csv")
    assert err.value.line == 3
    (tmp_path / "broken.csv").write_text("path,label\na.mp4,1\nb.mp4,2,3\n")
    with pytest.raises(hx.ManifestError, match=r"broken\.csv, line 3: cannot read it as csv") as err:
        Manifest(tmp_path / "broken.csv")  # the broken row's line, though pyarrow parses on threads
    assert err.value.line == 3
    (tmp_path / "label.csv").write_text("path,label\na.mp4,cat\n")
    with pytest.raises(hx.ManifestError, match=r"label\.csv.*column 'label' must hold integer"):
        Manifest(tmp_path / "label.csv")
