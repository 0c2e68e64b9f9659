"""Atomic writes' temporaries: each is locked while its writer lives, so what a killed writer
left is told from what a live one is writing, by a real second process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from graphforge.tempfiles import remove_stale, temp_file_beside, temp_folder_beside, write_atomically

#: a writer that makes its temporary, says where, and holds it until killed
WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from graphforge.tempfiles import temp_file_beside, temp_folder_beside
    make = temp_folder_beside if sys.argv[2] == "folder" else temp_file_beside
    with make(Path(sys.argv[1])) as tmp:
        (tmp / "part" if tmp.is_dir() else tmp).write_bytes(b"half-written")
        print(tmp, flush=True)
        time.sleep(600)
    """
)


def _writer(target: Path, kind: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(target), kind], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    line = proc.stdout.readline().strip()
    assert line, "the writer did not start"
    return proc, Path(line)


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_live_writers_temporary_stays_and_a_killed_ones_goes(tmp_path, kind):
    proc, tmp = _writer(tmp_path / "model.onnx", kind)
    try:
        assert tmp.parent == tmp_path and tmp.name.startswith(".model.onnx.") and tmp.name.endswith(".tmp")
        assert remove_stale(tmp_path) == [] and tmp.exists()  # its writer holds it
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.stdout.close()
    assert tmp.exists()  # a crash leaves it
    assert remove_stale(tmp_path) == [tmp]
    assert list(tmp_path.iterdir()) == []


def test_only_temporaries_are_removed(tmp_path):
    names = ("model.onnx", ".hidden", "notes.tmp", ".notes.tmp", ".model.onnx.k3j_x8a2.tmp.bak")
    kept = [tmp_path / name for name in names]
    for path in kept:
        path.write_text("keep me")
    (tmp_path / ".folder.abcd1234.tmp").mkdir()
    stale = tmp_path / ".checkpoint-00000025.safetensors.k3j_x8a2.tmp"
    stale.write_text("half-written")
    assert remove_stale(tmp_path) == sorted([tmp_path / ".folder.abcd1234.tmp", stale])
    assert sorted(tmp_path.iterdir()) == sorted(kept)
    assert remove_stale(tmp_path / "missing") == []


def test_a_finished_write_leaves_only_its_target(tmp_path):
    target = tmp_path / "report.json"
    write_atomically(target, b"{}")
    assert target.read_bytes() == b"{}" and list(tmp_path.iterdir()) == [target]
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # as any new file, not mkstemp's 0600
    with pytest.raises(RuntimeError), temp_file_beside(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the write failed")
    with temp_folder_beside(target) as folder:
        (folder / "part").write_bytes(b"half")
    assert list(tmp_path.iterdir()) == [target]


def test_a_writer_whose_temporary_was_taken_before_its_lock_makes_another(tmp_path, monkeypatch):
    """The window between making a temporary and locking it: a remove_stale there takes it."""
    import graphforge.tempfiles as tempfiles

    real_lock = tempfiles._lock
    taken = []

    def lock_after_a_cleaner(fd):
        if not taken:
            taken.extend(remove_stale(tmp_path))
        real_lock(fd)

    monkeypatch.setattr(tempfiles, "_lock", lock_after_a_cleaner)
    started = time.monotonic()
    with temp_file_beside(tmp_path / "m.onnx") as tmp:
        assert tmp.exists() and len(taken) == 1 and tmp != taken[0]
        assert remove_stale(tmp_path) == []  # this one is locked
    assert time.monotonic() - started < 10
