"""The layers, read from the source: the subpackages of ``helix_core`` import each other along one
DAG (written once, below), none takes another's private names, no module import cycle (not even one
hidden in a function), policy code (``planning/``, Tier 2's pure policy) knows no gRPC, protobuf,
torch or runtime, the runtime knows no Lightning or Accelerate, and ``helix_lightning`` uses only
the public ``helix_core`` surface. A file past ~800 lines is a warning (look for its second idea),
not a failure."""

import ast
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 800  # past this, look for the second idea (STYLE); split by role, never by line count

# What each subpackage of helix_core may import (besides itself and the package root). Lower layers
# first; the test below checks that this is a DAG and that the code keeps to it.
LAYERS = {
    "config": set(),
    "errors": set(),
    "telemetry": set(),
    "security": {"config", "errors"},
    "memory": {"config", "errors"},
    "data": {"config", "errors"},
    "wire": {"config", "errors", "memory", "security"},
    "planning": {"config", "errors", "data"},
    "tier2": {"config", "errors", "data", "planning", "memory", "security", "wire"},
    "coordinator": {"config", "errors", "telemetry", "planning", "security", "wire", "tier2"},
    "server": {"config", "errors", "telemetry", "data", "planning", "memory", "security", "wire", "tier2"},
    "launch": {"config", "errors", "data", "memory", "security", "wire", "coordinator", "server"},
    "loader": {
        "config", "errors", "telemetry", "data", "planning", "memory", "security", "wire", "tier2", "launch",
    },
    "testing": {"config", "errors", "data"},
}  # fmt: skip
PURE = [
    "helix_core/planning",
    "helix_core/tier2/rebalance.py",
    "helix_core/tier2/rounds.py",
    "helix_core/tier2/policy.py",
]
IMPURE = [
    "grpc",
    "helix_core.wire",
    "helix_core.memory",
    "helix_core.server",
    "helix_core.loader",
    "helix_core.tier2.leader",
]


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports too)."""
    return {name for name, _line in _import_lines(path)}


def _import_lines(path: Path) -> list[tuple[str, int]]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append((node.module, node.lineno))
            names += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return names


def _files(*parts: str) -> list[Path]:
    return sorted(p for p in ROOT.joinpath(*parts).rglob("*.py") if "_pb2" not in p.name)


def _uses(names: set[str], top: str) -> bool:
    return any(n == top or n.startswith(top + ".") for n in names)


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "helix_core" and len(parts) > 1 else None


def _module(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def test_the_layers_are_a_dag():
    seen, done = set(), []

    def visit(node, path):
        assert node not in path, f"the layers have a cycle: {' -> '.join([*path, node])}"
        if node not in seen:
            seen.add(node)
            for below in sorted(LAYERS[node]):
                visit(below, [*path, node])
            done.append(node)

    for node in LAYERS:
        visit(node, [])
    assert set(LAYERS) >= {
        p.name for p in ROOT.joinpath("helix_core").iterdir() if p.is_dir() and p.name != "__pycache__"
    } | {
        p.stem for p in ROOT.joinpath("helix_core").glob("*.py") if p.stem != "__init__"
    }  # every subpackage has its place


def violations(files, read=Path.read_text) -> list[str]:
    """Imports against the DAG, and private names taken across subpackages."""
    bad = []
    for p in files:
        me = _subpackage(_module(p))
        if me is None:
            continue
        tree = ast.parse(read(p), str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [(node.module, [a.name for a in node.names])]
            elif isinstance(node, ast.Import):
                targets = [(a.name, []) for a in node.names]
            else:
                continue
            for module, names in targets:
                other = _subpackage(module)
                if other is None or other == me:
                    continue
                where = f"{p.relative_to(ROOT)}:{node.lineno}"
                if other not in LAYERS[me]:
                    bad.append(f"{where}: {me} imports {module} ({other} is not below {me})")
                bad += [f"{where}: private {module}.{n} taken across subpackages" for n in names if n.startswith("_")]
    return bad


def test_subpackages_import_along_the_dag_and_take_no_private_names():
    assert violations(_files("helix_core")) == []


def test_the_dag_check_catches_an_upward_import_and_a_private_one():
    probe = ROOT / "helix_core" / "planning" / "probe.py"  # read, never written
    source = "from helix_core.loader.loader import DistributedDataLoader\nfrom helix_core.data.costs import _fit\n"
    found = violations([probe], read=lambda _p: source)
    assert found == [
        "helix_core/planning/probe.py:1: planning imports helix_core.loader.loader (loader is not below planning)",
        "helix_core/planning/probe.py:2: private helix_core.data.costs._fit taken across subpackages",
    ]


def test_no_module_import_cycle_not_even_in_a_function():
    modules = {_module(p): p for folder in ("helix_core", "helix_bench") for p in _files(folder)}
    graph = {
        m: {n for n in _imports(p) if n in modules and n != m and not m.startswith(n + ".")} for m, p in modules.items()
    }
    state: dict[str, int] = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(m) :], m]))
        if state.get(m) != 2:
            state[m] = 1
            for n in sorted(graph[m]):
                visit(n, [*path, m])
            state[m] = 2

    for m in sorted(graph):
        visit(m, [])


@pytest.mark.parametrize("forbidden", IMPURE)
def test_policy_code_is_pure(forbidden):
    files = [p for part in PURE for p in (_files(part) if not part.endswith(".py") else [ROOT / part])]
    assert [str(p.relative_to(ROOT)) for p in files if _uses(_imports(p), forbidden)] == []


@pytest.mark.parametrize("forbidden", ["lightning", "pytorch_lightning", "accelerate", "helix_lightning"])
def test_the_runtime_imports_no_lightning_or_accelerate(forbidden):
    assert [str(p.relative_to(ROOT)) for p in _files("helix_core") if _uses(_imports(p), forbidden)] == []


def test_grpc_lives_only_where_processes_meet():
    users = {str(p.relative_to(ROOT)) for p in _files("helix_core") if _uses(_imports(p), "grpc")}
    homes = ("wire", "security", "coordinator", "server", "launch", "loader", "tier2")
    assert {u for u in users if u.split("/")[1] not in homes} == set()


def test_the_coordinator_never_touches_a_tensor():
    for p in _files("helix_core", "coordinator"):
        names = _imports(p)
        assert not _uses(names, "torch") and not _uses(names, "helix_core.memory"), p


def test_helix_lightning_uses_only_the_public_surface():
    import helix_core

    public = set(helix_core.__all__)
    for p in _files("helix_lightning"):
        for name in _imports(p):
            if name.startswith("helix_core."):
                assert name.split(".", 1)[1] in public, f"{p.name} imports {name}: not in helix_core.__all__"


def test_a_file_past_the_house_size_is_a_warning():
    big = {
        str(p.relative_to(ROOT)): n
        for folder in ("helix_core", "helix_bench", "helix_lightning", "recipes")
        for p in _files(folder)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    if big:
        warnings.warn(f"past {MAX_LINES} lines, look for the second idea: {big}", stacklevel=1)


def test_the_public_surface_has_a_stub_with_the_same_names():
    import helix_core

    stub = ast.parse((ROOT / "helix_core" / "__init__.pyi").read_text())
    declared = {a.asname or a.name for node in stub.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert declared == set(helix_core.__all__)
    for name in helix_core.__all__:
        getattr(helix_core, name)  # every name loads
