"""Telling a Python traceback in a command's output by what a traceback is, not by where the
checkout lives: a checkout folder named ``graphforge`` puts ``graphforge/`` into every path an
error line may rightly name (a config file, an output folder)."""

from __future__ import annotations

import re
from pathlib import Path

import graphforge.passes

import graphforge

HEADER = "Traceback (most recent call last)"
#: a frame line of a traceback: ``File "<path>", line <n>``
_FRAME = re.compile(r'File "([^"]+)", line \d+')
#: the folders of graphforge's own source files (passes/ sits beside the package)
SOURCE_FOLDERS = tuple({Path(graphforge.__file__).resolve().parent, Path(graphforge.passes.__file__).resolve().parent})


def our_frames(text: str) -> list[str]:
    """The files of the traceback frames in ``text`` that are graphforge's own source files."""
    found = []
    for path in _FRAME.findall(text):
        resolved = Path(path).resolve()
        if any(resolved.is_relative_to(folder) for folder in SOURCE_FOLDERS):
            found.append(path)
    return found


def assert_no_traceback(text: str, *, launcher: bool = False) -> None:
    """``text`` shows no traceback. With ``launcher``, the output of torchrun, which prints its
    own traceback when a process it started fails: then only none through graphforge's code."""
    frames = our_frames(text)
    assert not frames, f"a traceback through graphforge's code ({frames[-1]}):\n{text[-3000:]}"
    if not launcher:
        assert HEADER not in text, f"a traceback:\n{text[-3000:]}"
