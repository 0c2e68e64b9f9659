"""The documents a reader follows stay true to the tree: every path that README.md and the
site's pages (docs/) name exists, the architecture page names every module of graphforge/
and passes/ (a module added without a word there fails here), and every ```python and ```sh
block of every page is run by a test or marked illustrative (tests/_pages.py)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest
from _pages import ILLUSTRATIVE, REPO, blocks, page_block, pages

#: a path into the repository as the documents write it: a known top folder, then a path
PATH = re.compile(r"(?<![\w./-])((?:graphforge|passes|tests|docs|examples|golden_models|benchmarks|data)/[\w./<>*-]*)")
#: the languages of the blocks the tests run; a block that looks like one of them but is spelled
#: otherwise would slip past the check, so those spellings are refused
RUN = ("python", "sh")
SPELLED_OTHERWISE = {"py": "python", "python3": "python", "pycon": "python", "bash": "sh", "shell": "sh",
                     "console": "sh", "zsh": "sh"}  # fmt: skip


def _paths(text: str) -> set[str]:
    found = set()
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".,:;)")
        if any(c in path for c in "<>*") or path.endswith("/."):
            continue  # a pattern (rules/<family>.py), not a path
        found.add(path)
    return found


@pytest.mark.parametrize("page", pages())
def test_every_path_a_page_names_exists(page):
    missing = sorted(p for p in _paths((REPO / page).read_text()) if not (REPO / p).exists())
    assert not missing, f"{page} names paths that do not exist: {missing}"


def test_the_path_reader_finds_the_paths_the_pages_name():
    """The test above reads paths the way the pages write them (else it would pass on nothing)."""
    assert {"docs/getting-started/setup.md", "docs/on-device/training.md"} <= _paths((REPO / "README.md").read_text())
    assert "graphforge/roles.py" in _paths((REPO / "docs/architecture.md").read_text())
    assert "examples/digits/train.toml" in _paths((REPO / "docs/getting-started/training.md").read_text())


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


def test_every_page_is_in_the_sites_navigation():
    """mkdocs --strict fails on a page left out of the nav too; this says which, without building."""
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), flags=re.MULTILINE))
    on_disk = {p.removeprefix("docs/") for p in pages() if p.startswith("docs/")}
    assert on_disk - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - on_disk == set(), "mkdocs.yml's nav names pages that do not exist"


# --------------------------------------------------------------------------- the pages' blocks


def _selections() -> list[tuple[str, str, tuple[str, ...], str]]:
    """Every ``page_block(page, language, *needles)`` call in tests/ (page, language, needles,
    where), read from the source: the blocks the tests run."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name != "page_block" or path.name == "_pages.py":
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            args = [_literal(a, where) for a in node.args]
            assert not node.keywords and len(args) >= 2, f"{where}: write page_block(page, language, *needles)"
            found.append((args[0], args[1], tuple(args[2:]), where))
    return found


def _literal(node: ast.expr, where: str) -> str:
    """A page_block argument: a string literal, or a module-level name bound to one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        for statement in ast.parse((REPO / where.split(":")[0]).read_text()).body:
            if isinstance(statement, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == node.id for t in statement.targets
            ):
                return _literal(statement.value, where)
    raise AssertionError(f"{where}: page_block's arguments must be literals or module-level names bound to one")


def test_each_block_a_test_takes_is_one_block_of_its_page():
    selections = _selections()
    assert len(selections) > 20, "the tests' page_block calls were not found: this test reads them wrong"
    for page, language, needles, where in selections:
        matching = [str(b) for b in blocks(page, language) if all(n in b.text for n in needles)]
        assert len(matching) == 1, f"{where} takes {needles} from {page}, which has {len(matching)}: {matching}"


def test_every_command_block_is_run_by_a_test_or_marked_illustrative():
    """Command blocks in the pages stay tested (the design's words): a new ```python or ```sh
    block needs a test that takes it (page_block) or the line <!-- illustrative: why --> right
    above it."""
    selections = _selections()
    untested, contradicted = [], []
    for page in pages():
        for block in blocks(page):
            if block.language not in RUN:
                continue
            taken = [w for p, lang, needles, w in selections
                     if (p, lang) == (page, block.language) and all(n in block.text for n in needles)]  # fmt: skip
            if block.illustrative is None and not taken:
                untested.append(str(block))
            if block.illustrative is not None and taken:
                contradicted.append(f"{block} is marked illustrative, yet {taken[0]} runs it")
    assert not untested, f"blocks that no test runs (run them with page_block, or mark them illustrative): {untested}"
    assert not contradicted, contradicted


@pytest.mark.parametrize("page", pages())
def test_no_command_block_escapes_the_check(page):
    """A shell or Python block spelled as ```bash (say), or indented into a list, would not be
    counted above: write it as ```sh or ```python, at the start of its line."""
    text = (REPO / page).read_text()
    spelled = [
        f"line {text.count(chr(10), 0, m.start()) + 1}: ```{m.group(2)} (write ```{SPELLED_OTHERWISE[m.group(2)]})"
        for m in re.finditer(r"^(\s*)```(\w+)", text, flags=re.MULTILINE)
        if m.group(2) in SPELLED_OTHERWISE
    ]
    indented = [
        f"line {text.count(chr(10), 0, m.start()) + 1}: an indented ```{m.group(1)} block"
        for m in re.finditer(r"^[ \t]+```(python|sh)\b", text, flags=re.MULTILINE)
    ]
    stray = [
        line for line in text.splitlines() if line.startswith("<!-- illustrative") and not ILLUSTRATIVE.match(line)
    ]
    assert not spelled + indented + stray, f"{page}: {spelled + indented + stray}"
    marked_elsewhere = [
        b for b in blocks(page) if b.illustrative is not None and b.language not in RUN
    ]  # a marker above a block the check does not count says nothing
    assert not marked_elsewhere, f"{page}: illustrative markers above blocks that are not ```python/```sh"


# --------------------------------------------------------------------------- blocks run here


def test_the_on_device_pages_import_lines_import_the_on_device_api(tmp_path):
    """The lines a script written for onnxruntime.training changes, run in a fresh interpreter."""
    block = page_block("docs/on-device/training.md", "python", "from graphforge import artifacts")
    check = "\nprint(artifacts.generate_artifacts.__module__, Module.__module__, LinearLRScheduler.__name__)"
    done = subprocess.run([sys.executable, "-c", block + check], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["graphforge.ondevice.artifacts", "graphforge.ondevice.api", "LinearLRScheduler"]
