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


def test_the_architecture_page_names_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [m for m in _modules() if m not in page and m.split("/", 1)[1] not in page]
    assert missing == [], "docs/architecture.md does not place these modules"


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
