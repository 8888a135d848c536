"""The committed gRPC stubs are what the pinned grpcio-tools generates from helix.proto."""

from pathlib import Path

import pytest

from helix_core.wire.proto import generate


def test_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    for fresh in generate.generate(tmp_path):
        committed = Path(generate.HERE) / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run python -m helix_core.wire.proto.generate"
        )
