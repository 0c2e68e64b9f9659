"""The documentation a reader follows (README.md and the site's pages under docs/) and the
fenced blocks in it, for the tests that run those blocks as written.

A test takes a block with ``page_block(page, language, *needles)``, its arguments written as
literals: tests/test_docs.py reads those calls (without running them) to check that every
```python and ```sh block of every page is run by some test, or is marked illustrative by the
line ``<!-- illustrative: why -->`` right above it (a block that cannot run here: two machines,
a GPU, a server that runs until Ctrl-C).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the marker line above a block that no test runs, on purpose
ILLUSTRATIVE = re.compile(r"^<!-- illustrative: (.+) -->$")
#: a fenced block at the start of a line: its language (possibly empty) and its text
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Block:
    page: str
    language: str
    text: str
    line: int  # of the opening fence, from 1
    illustrative: str | None  # why no test runs it, when marked so

    def __str__(self) -> str:
        return f"{self.page}:{self.line} (```{self.language})"


def pages() -> list[str]:
    """README.md, then every page under docs/, as paths from the repository's root."""
    return ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md"))]


def page_text(page: str) -> str:
    return (REPO / page).read_text()


def blocks(page: str, language: str | None = None) -> list[Block]:
    """The fenced blocks of ``page`` (of ``language`` only, when given; "" is a bare fence)."""
    text = page_text(page)
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        above = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marked = ILLUSTRATIVE.match(above)
        block = Block(page, match.group(1), match.group(2), line, marked.group(1) if marked else None)
        if language is None or block.language == language:
            found.append(block)
    return found


def page_block(page: str, language: str, *needles: str) -> str:
    """The one ```language block of ``page`` that contains every needle."""
    matching = [b for b in blocks(page, language) if all(n in b.text for n in needles)]
    if len(matching) != 1:
        where = ", ".join(str(b) for b in matching) or "none"
        raise LookupError(f"{page}: {len(matching)} ```{language} blocks contain {needles} (want 1): {where}")
    return matching[0].text


def run_block(page: str, *blocks: str, namespace: dict | None = None) -> dict:
    """Run a page's Python blocks in turn in one namespace (their warnings silenced), as a reader
    pasting them into one session would; the namespace they leave."""
    namespace = {} if namespace is None else namespace
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in blocks:
            exec(compile(block, page, "exec", dont_inherit=True), namespace)
    return namespace
