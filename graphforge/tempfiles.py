"""Temporary files for atomic writes, and the ones a killed process left behind.

Every atomic write in graphforge (checkpoints, models, logs, reports) goes to a temporary file
or folder beside its target, ``.<target name>.<random>.tmp``, then renames it over the target. A
process killed in between leaves that temporary behind. The writer holds an exclusive ``flock``
on it for as long as it writes, and the kernel drops the lock when the process dies however it
dies, so a temporary whose lock another process can take has no live writer: that is what
:func:`remove_stale` removes. (No PID files: a PID is reused and means nothing on another
machine sharing the folder; NFS clients take flock as POSIX locks, which the server holds.)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, so no temporary is ever known to be stale
    fcntl = None  # type: ignore[assignment]

SUFFIX = ".tmp"
#: the names of the temporaries this module makes: mkstemp's and mkdtemp's 8 random characters
#: between the target's name and SUFFIX (a user's own ``.notes.tmp`` is not one)
_TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: read once, at import: reading it means setting it, which another thread's file would see
_UMASK = _read_umask()


def write_atomically(target: Path, data: bytes) -> None:
    """Replace ``target`` with ``data`` at once: readers see the old file or the new one."""
    with temp_file_beside(target) as tmp:
        tmp.write_bytes(data)
        move_into_place(tmp, target)


def move_into_place(temporary: Path, target: Path) -> None:
    """Rename ``temporary`` over ``target``, with the mode a new file gets under the umask:
    a writer that made the temporary afresh (safetensors does) left it 0600, as its folder's
    temporaries are."""
    os.chmod(temporary, 0o666 & ~_UMASK)
    os.replace(temporary, target)


@contextlib.contextmanager
def temp_file_beside(target: Path) -> Iterator[Path]:
    """A new empty file in ``target``'s folder, locked while the block runs and removed after
    it unless the block renamed it (over ``target``)."""

    def make() -> tuple[int, Path]:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=SUFFIX, dir=target.parent)
        os.fchmod(fd, 0o666 & ~_UMASK)  # as any new file gets, not mkstemp's 0600: the target takes it over
        return fd, Path(name)

    with _held(make) as path:
        yield path


@contextlib.contextmanager
def temp_folder_beside(target: Path) -> Iterator[Path]:
    """A new empty folder in ``target``'s folder, locked while the block runs and removed
    (with what it holds) after it."""

    def make() -> tuple[int, Path]:
        path = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=SUFFIX, dir=target.parent))
        return os.open(path, os.O_RDONLY), path

    with _held(make) as path:
        yield path


@contextlib.contextmanager
def _held(make) -> Iterator[Path]:
    while True:
        fd, path = make()
        _lock(fd)
        if _same(fd, path):
            break
        os.close(fd)  # a remove_stale took it between its making and its locking: make another
    try:
        yield path
    finally:
        try:
            _remove(path)
        finally:
            os.close(fd)  # after removing: the lock guards the removal too


def _same(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file ``fd`` has open."""
    try:
        return os.fstat(fd).st_ino == os.lstat(path).st_ino
    except OSError:
        return False


def _lock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale(folder: Path) -> list[Path]:
    """Remove the temporaries in ``folder`` (not below it) that no live process holds: those a
    process killed mid-write left. Returns what was removed; what cannot be read or removed
    (another user's) is left alone."""
    if fcntl is None or not folder.is_dir():
        return []
    removed = []
    for entry in sorted(folder.iterdir()):
        if _TEMPORARY.fullmatch(entry.name) is None:
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its writer is alive (or the file system takes no locks: then nothing is known)
            os.close(fd)
            continue
        try:
            if _same(fd, entry):  # not a new one made under the same name meanwhile
                _remove(entry)
                removed.append(entry)
        finally:
            os.close(fd)
    return removed
