"""The docs match the code: docs/architecture.md names every module of the packages, and no
README or docs page (nor a module docstring) names a file the repository does not hold."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("helix_core", "helix_bench", "helix_lightning")
PATH = re.compile(
    r"(?<![\w/.-])((?:helix_core|helix_bench|helix_lightning|tests|recipes|docs|deploy|configs)/[\w/.-]*\w)"
)


def _modules() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py" and "_pb2" not in p.name
    )


def test_the_architecture_page_places_every_module():
    """Every module of the packages is in the page's tree: its folder and its file name in the
    tree's block (or its path anywhere on the page)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    tree = page.split("## The tree", 1)[1].split("```")[1]
    words = set(re.findall(r"[\w.]+/?", tree))

    def placed(module: str) -> bool:
        parts = module.split("/")
        return module.split("/", 1)[1] in page or (parts[-1] in words and all(f"{d}/" in words for d in parts[:-1]))

    assert [m for m in _modules() if not placed(m)] == []


def test_no_page_names_a_file_the_repo_does_not_hold():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pages += [ROOT / m for m in _modules()]  # their docstrings and comments
    stale = {
        f"{page.relative_to(ROOT)}: {ref}"
        for page in pages
        for ref in PATH.findall(page.read_text())
        if not any((base / ref.rstrip(".")).exists() for base in (ROOT, page.parent)) and "*" not in ref
    }
    assert stale == set()


def test_the_architecture_page_names_only_files_that_exist():
    """The page's short paths (``loader/plan.py``) name files of helix_core (or helix_bench) as
    they are now; only "What moved" names old ones."""
    page = (ROOT / "docs" / "architecture.md").read_text().split("## What moved", 1)[0]
    folders = {p.name for pkg in ("helix_core", "helix_bench") for p in (ROOT / pkg).rglob("*") if p.is_dir()}
    short = re.compile(r"(?<![\w/.-])((?:" + "|".join(sorted(folders)) + r")/[\w/]+\.py)")
    missing = {
        ref
        for ref in short.findall(page)
        if not any((ROOT / pkg / ref).exists() for pkg in ("helix_core", "helix_bench", "helix_core/data"))
    }
    assert missing == set()
