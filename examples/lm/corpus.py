"""The example's two texts, written as JSONL files graphforge train reads: English prose the
machine already has (the docstrings of the running interpreter's standard library, read with
``ast``) to pretrain on, and the shipped fables (data/text/fables.jsonl) split into a
fine-tuning part and a held-out part. Nothing is downloaded."""

from __future__ import annotations

import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FABLES = REPO / "data" / "text" / "fables.jsonl"
#: every HELD_OUT_EVERY-th fable (from the first) is held out of fine-tuning: 8 of the 32
HELD_OUT_EVERY = 4
#: the standard library's folders left out: tests, demos and vendored code say little in prose
SKIPPED = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip", "__pycache__"}
#: a docstring shorter than this (characters) is a label, not prose
MIN_DOCSTRING = 80


def stdlib_docstrings(max_chars: int, root: Path | None = None) -> list[str]:
    """The docstrings of the standard library's modules, classes and functions (``root``: the
    running interpreter's ``Lib/``), in a fixed order (files by path, then as written), each
    once, those with doctest examples left out, until ``max_chars`` characters."""
    texts, seen, total = [], set(), 0
    for path in _sources(Path(root or sysconfig.get_paths()["stdlib"])):
        for text in _docstrings(path):
            if text in seen:
                continue
            seen.add(text)
            texts.append(text)
            total += len(text)
            if total >= max_chars:
                return texts
    return texts


def _sources(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        if not SKIPPED.intersection(path.relative_to(root).parts[:-1]):
            yield path


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return  # a file the running interpreter does not parse (a test fixture, another version's)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)
            if text and len(text) >= MIN_DOCSTRING and ">>>" not in text and text.isascii():
                yield text


def fables(path: Path = FABLES) -> tuple[list[str], list[str]]:
    """The fables to fine-tune on and those held out (every HELD_OUT_EVERY-th, from the first)."""
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    held_out = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY == 0]
    tuned = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY != 0]
    return tuned, held_out


def write_jsonl(path: Path, texts: list[str]) -> Path:
    """``texts`` as a JSONL file of ``{"text": ...}`` lines (graphforge train's text format)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path
