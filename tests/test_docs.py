"""The documents a reader follows stay true to the tree: every path README.md and
docs/architecture.md name exists, and the architecture document names every module of
graphforge/ and passes/ (a module added without a word there fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "docs/architecture.md", "docs/benchmarks.md"]
#: a path into the repository as the documents write it: a known top folder, then a path
PATH = re.compile(r"(?<![\w./-])((?:graphforge|passes|tests|docs|examples|golden_models|benchmarks|data)/[\w./<>*-]*)")


def _paths(text: str) -> set[str]:
    found = set()
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".,:;)")
        if any(c in path for c in "<>*") or path.endswith("/."):
            continue  # a pattern (rules/<family>.py), not a path
        found.add(path)
    return found


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_path_a_document_names_exists(document):
    text = (REPO / document).read_text()
    paths = _paths(text)
    assert paths, f"{document} names no path: the test reads it wrong"
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"{document} names paths that do not exist: {missing}"


def test_the_architecture_names_every_module():
    text = (REPO / "docs/architecture.md").read_text()
    words = set(re.findall(r"[\w.]+", text))
    modules = [p for root in ("graphforge", "passes") for p in (REPO / root).iterdir() if not p.name.startswith("_")]
    unnamed = sorted(
        str(p.relative_to(REPO))
        for p in modules
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
        and p.stem not in words
        and p.name not in words
    )
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"


def test_the_readme_points_at_documents_in_the_repository():
    """A clone has no ../shared: the README's design pointer is the project's own document."""
    text = (REPO / "README.md").read_text()
    assert "../shared" not in text
    assert "docs/architecture.md" in text
