"""The layers the README promises, read from the source: the runtime knows no Lightning or
Accelerate, policy code knows no gRPC, gRPC stays in the transport and the services, and
``helix_lightning`` uses only the public ``helix_core`` surface. No file outgrows ~300 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 800  # past ~800 lines look for the second idea (STYLE): the generated protobuf stubs are exempt


def _imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative ones resolved against its package)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def _files(*parts: str) -> list[Path]:
    return sorted(p for p in ROOT.joinpath(*parts).rglob("*.py") if "_pb2" not in p.name)


def _uses(names: set[str], top: str) -> bool:
    return any(n == top or n.startswith(top + ".") for n in names)


@pytest.mark.parametrize("forbidden", ["lightning", "pytorch_lightning", "accelerate", "helix_lightning"])
def test_the_runtime_imports_no_lightning_or_accelerate(forbidden):
    assert [str(p.relative_to(ROOT)) for p in _files("helix_core") if _uses(_imports(p), forbidden)] == []


def test_grpc_lives_only_in_the_transport_and_the_services():
    allowed = {"helix_core/loader/requests.py"}
    users = {str(p.relative_to(ROOT)) for p in _files("helix_core") if _uses(_imports(p), "grpc")}
    stray = {
        u
        for u in users
        if not (u.startswith("helix_core/runtime/") or u in allowed or u.startswith("helix_core/client/transport"))
    }
    assert stray == set()
    assert not any(u.startswith("helix_core/planning/") for u in users)  # policy code knows no gRPC


def test_policy_code_knows_no_runtime_and_the_coordinator_no_tensor():
    for p in _files("helix_core", "planning"):
        names = _imports(p)
        assert not _uses(names, "helix_core.runtime") and not _uses(names, "helix_core.client"), p
    assert not _uses(_imports(ROOT / "helix_core/coordinator/service.py"), "torch")


def test_helix_lightning_uses_only_the_public_surface():
    import helix_core

    public = set(helix_core.__all__)
    for p in _files("helix_lightning"):
        for name in _imports(p):
            if name.startswith("helix_core."):
                assert name.split(".", 1)[1] in public, f"{p.name} imports {name}: not in helix_core.__all__"


def test_no_file_outgrows_the_house_size():
    big = {
        str(p.relative_to(ROOT)): n
        for folder in ("helix_core", "helix_bench", "helix_lightning", "recipes")
        for p in _files(folder)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}
