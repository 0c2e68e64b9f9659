"""Diffs of ``compile --dump-dir`` folders: two folders pass by pass, or one folder step by step."""

from __future__ import annotations

import difflib
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
    """Files of two dump folders paired by pass: the two sequences of pass names aligned
    (difflib, as diff(1) aligns lines), so a pass only one pipeline runs is a step of its own
    and the passes after it still meet their counterparts; where the names disagree (a pass
    replaced by another), files pair by number, and what is left is only in one folder."""
    files_a, files_b = dump_files(a), dump_files(b)
    matcher = difflib.SequenceMatcher(None, [f.name for f in files_a], [f.name for f in files_b], autojunk=False)
    steps: list[Step] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            steps += [Step(fa, fb) for fa, fb in zip(files_a[i1:i2], files_b[j1:j2], strict=True)]
        else:
            steps += _pair_by_number(files_a[i1:i2], files_b[j1:j2])
    return steps


def _pair_by_number(files_a: list[DumpFile], files_b: list[DumpFile]) -> list[Step]:
    """Two runs of files whose pass names disagree: equal numbers pair, the rest stand alone,
    in number order (A's before B's at one number)."""
    by_number = {f.number: f for f in files_b}
    steps = []
    taken: set[int] = set()
    for f in files_a:
        other = by_number.get(f.number)
        if other is not None and f.number not in taken:
            taken.add(f.number)
            steps.append(Step(f, other))
        else:
            steps.append(Step(f, None))
    steps += [Step(None, f) for f in files_b if f.number not in taken]
    steps.sort(key=lambda s: ((s.a or s.b).number, 0 if s.a is not None else 1))  # type: ignore[union-attr]
    return steps


def only_in(steps: list[Step], side: str) -> list[str]:
    """File names of the steps with a file on ``side`` ("a" or "b") alone."""
    if side == "a":
        return [s.a.path.name for s in steps if s.a is not None and s.b is None]
    return [s.b.path.name for s in steps if s.b is not None and s.a is None]


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
        "only_a": only_in(steps, "a"),
        "only_b": only_in(steps, "b"),
        "steps": [s.to_json() for s in steps],
    }
