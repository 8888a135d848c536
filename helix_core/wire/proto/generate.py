"""Regenerate the committed gRPC stubs: ``python -m helix_core.wire.proto.generate``.

Needs grpcio-tools (the ``dev`` extra, pinned). Imports in the generated grpc module are made
package-relative so the stubs import as ``helix_core.wire.proto``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def generate(out_dir: Path = HERE) -> list[Path]:
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{HERE}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(HERE / "helix.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    grpc_file = out_dir / "helix_pb2_grpc.py"
    grpc_file.write_text(
        re.sub(r"^import helix_pb2 as", "from . import helix_pb2 as", grpc_file.read_text(), flags=re.M)
    )
    return [out_dir / "helix_pb2.py", out_dir / "helix_pb2.pyi", grpc_file]


if __name__ == "__main__":
    for p in generate():
        print(p)
    sys.exit(0)
