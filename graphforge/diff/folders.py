"""Diffs of ``compile --dump-dir`` folders: two folders pass by pass, or one folder step by step."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphforge.diff.result import SCHEMA_VERSION, ModelDiff
from graphforge.errors import ModelLoadError

#: ``000_input.onnx``, ``003_cse.onnx``, ``004_dce.failed-input.onnx``
DUMP_FILE = re.compile(r"^(\d+)_(.+)\.onnx$")
FOLDER_SCHEMA = "graphforge.diff.folders"


@dataclass
class DumpFile:
    number: int
    name: str  # the pass name (with a .failed-input / .invalid-output suffix where there is one)
    path: Path

    def to_json(self) -> dict[str, Any]:
        return {"number": self.number, "name": self.name, "path": str(self.path)}


@dataclass
class Step:
    """One pair of dumps and their diff (None where a file has no counterpart)."""

    a: DumpFile | None
    b: DumpFile | None
    diff: ModelDiff | None = None

    @property
    def title(self) -> str:
        a = self.a.path.name if self.a is not None else "(none)"
        b = self.b.path.name if self.b is not None else "(none)"
        return f"{a} → {b}"

    @property
    def identical(self) -> bool:
        return self.diff is not None and self.diff.identical

    def to_json(self) -> dict[str, Any]:
        return {
            "a": None if self.a is None else self.a.to_json(),
            "b": None if self.b is None else self.b.to_json(),
            "identical": None if self.diff is None else self.diff.identical,
            "diff": None if self.diff is None else self.diff.to_json(),
        }


def dump_files(folder: Path) -> list[DumpFile]:
    """The numbered models in a dump folder, by number then name."""
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such folder")
    try:
        entries = sorted(folder.iterdir())
    except OSError as exc:
        raise ModelLoadError(f"{folder}: cannot list the folder ({exc.strerror or exc})") from None
    found = []
    for path in entries:
        match = DUMP_FILE.match(path.name)
        if match and path.is_file():
            found.append(DumpFile(int(match.group(1)), match.group(2), path))
    if not found:
        raise ModelLoadError(f"{folder}: no numbered dump files (NNN_<pass>.onnx, as compile --dump-dir writes)")
    found.sort(key=lambda f: (f.number, f.name))
    return found


def pair_folders(a: Path, b: Path) -> list[Step]:
    """Files of two dump folders paired by number and name, then by number alone."""
    files_a, files_b = dump_files(a), dump_files(b)
    by_key = {(f.number, f.name): f for f in files_b}
    pairs: dict[int, DumpFile] = {}
    taken: set[int] = set()
    for k, f in enumerate(files_a):
        other = by_key.get((f.number, f.name))
        if other is not None:
            pairs[k] = other
            taken.add(id(other))
    by_number: dict[int, list[DumpFile]] = {}
    for f in files_b:
        if id(f) not in taken:
            by_number.setdefault(f.number, []).append(f)
    for k, f in enumerate(files_a):
        if k not in pairs and by_number.get(f.number):
            other = by_number[f.number].pop(0)
            pairs[k] = other
            taken.add(id(other))
    steps = [Step(f, pairs.get(k)) for k, f in enumerate(files_a)]
    steps += [Step(None, f) for f in files_b if id(f) not in taken]
    steps.sort(key=lambda s: ((s.a or s.b).number, 0 if s.a is not None else 1))  # type: ignore[union-attr]
    return steps


def consecutive(folder: Path) -> list[Step]:
    """Each dump against the one before it: what every pass did."""
    files = dump_files(folder)
    if len(files) < 2:
        raise ModelLoadError(f"{folder}: only one dump file ({files[0].path.name}); nothing to compare it with")
    return [Step(before, after) for before, after in itertools.pairwise(files)]


def folders_json(mode: str, a: Path, b: Path | None, steps: list[Step]) -> dict[str, Any]:
    return {
        "schema": FOLDER_SCHEMA,
        "version": SCHEMA_VERSION,
        "mode": mode,
        "a": str(a),
        "b": None if b is None else str(b),
        "identical": all(s.identical for s in steps),
        "steps": [s.to_json() for s in steps],
    }
