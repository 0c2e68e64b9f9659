"""The token cache: a JSONL file tokenized once, its samples kept on disk as memory-mapped
arrays, so a file of any size is never held in memory and a second run does not tokenize again.

An entry is a folder named for the file and a key, the sha256 of everything the tokens depend
on (the file's bytes, tokenizer.json, its tokenizer_config.json and chat template, the format,
this cache's version); a changed file or tokenizer makes a new key, so a stale entry is never
read. It holds::

    tokens.bin      every sample's token ids, one sample after another (uint16 or uint32)
    learned.bin     for completions and chat: 1 where a token is one the model learns, else 0
    starts.npy      int64 [samples + 1]: where each sample starts in tokens.bin, then the end
    targets.npy     int32 [samples]: how many of a sample's tokens after its first are learned
    meta.json       written last: counts, the dtype, the largest id, what the key was made of

It is written in a temporary folder beside it (graphforge/tempfiles.py) and moved into place
file by file, meta.json last, while the process holds a lock on the data file: processes of one
run (or two runs) tokenizing the same file wait for the first, then read what it wrote. A
failure leaves no entry, and no cache folder the run made.
"""

from __future__ import annotations

import contextlib
import json
import os
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphforge.digests import sha256_bytes
from graphforge.errors import ConfigError, one_line
from graphforge.tempfiles import move_into_place, remove_stale, temp_folder_beside
from graphforge.train.config import shown
from graphforge.train.text.lines import Sample

try:
    import fcntl
except ImportError:  # Windows: no lock; processes tokenizing the same file at once each write it
    fcntl = None  # type: ignore[assignment]

VERSION = 1
#: the folder beside the data that holds the entries, unless data.cache names another
ROOT = ".graphforge-cache"
TOKENS, LEARNED, STARTS, TARGETS, META = "tokens.bin", "learned.bin", "starts.npy", "targets.npy", "meta.json"


@dataclass
class TokenCache:
    """One entry, opened: the arrays are memory-mapped (starts and targets are read whole)."""

    folder: Path
    tokens: np.ndarray
    learned: np.ndarray | None
    starts: np.ndarray
    targets: np.ndarray
    meta: dict
    #: whether this process tokenized it (False: read from an earlier run's entry)
    built: bool = False

    @property
    def samples(self) -> int:
        return len(self.starts) - 1


def entry_folder(root: Path, data: Path, parts: dict) -> Path:
    """Where the entry of ``data`` with the key made of ``parts`` lives under ``root``."""
    key = sha256_bytes(json.dumps({"version": VERSION, **parts}, sort_keys=True).encode())
    return root / f"{data.name}-{key[:20]}"


def cached(
    folder: Path,
    data: Path,
    chunks: Callable[[], Iterable[list[Sample]]],
    *,
    vocabulary: int,
    meta: dict,
    where: str,
) -> TokenCache:
    """The entry at ``folder``, tokenized from ``chunks()`` first where it is not there yet."""
    if (folder / META).is_file():
        return _open(folder, where)
    root = folder.parent
    made_root = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot make the token cache {shown(root)} ({one_line(exc)}); name a writable folder with data.cache"
        ) from None
    try:
        with _locked(data):
            if (folder / META).is_file():  # another process wrote it while this one waited
                return _open(folder, where)
            remove_stale(root)
            _write(folder, chunks(), vocabulary, meta)
    except BaseException:
        if made_root:
            with contextlib.suppress(OSError):
                root.rmdir()  # only if empty: another file's entry may have arrived meanwhile
        raise
    cache = _open(folder, where)
    cache.built = True
    return cache


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write(folder: Path, chunks: Iterable[list[Sample]], vocabulary: int, meta: dict) -> None:
    dtype = np.dtype(np.uint16 if vocabulary <= np.iinfo(np.uint16).max + 1 else np.uint32)
    starts, targets = array("q", [0]), array("i")
    largest, learned_any = -1, False
    with temp_folder_beside(folder) as tmp:
        with open(tmp / TOKENS, "wb") as tokens, open(tmp / LEARNED, "wb") as learned:
            for chunk in chunks:
                for sample in chunk:
                    ids = sample.ids
                    if len(ids):
                        largest = max(largest, int(ids.max()))
                    tokens.write(ids.astype(dtype).tobytes())
                    starts.append(starts[-1] + len(ids))
                    if sample.learned is not None:
                        learned_any = True
                        learned.write(sample.learned.astype(np.uint8).tobytes())
                        targets.append(int(np.count_nonzero(sample.learned[1:])))
                    else:
                        targets.append(max(len(ids) - 1, 0))
        if not learned_any:
            (tmp / LEARNED).unlink()
        np.save(tmp / STARTS, np.frombuffer(starts, np.int64))
        np.save(tmp / TARGETS, np.frombuffer(targets, np.int32))
        meta = {**meta, "samples": len(targets), "tokens": starts[-1], "dtype": dtype.name, "max_id": largest}
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        folder.mkdir(exist_ok=True)
        for path in [*sorted(p for p in tmp.iterdir() if p.name != META), tmp / META]:
            move_into_place(path, folder / path.name)


def _open(folder: Path, where: str) -> TokenCache:
    try:
        meta = json.loads((folder / META).read_text())
        dtype, count = np.dtype(meta["dtype"]), int(meta["tokens"])

        def mapped(name: str, kind) -> np.ndarray:
            return np.memmap(folder / name, kind, mode="r", shape=(count,)) if count else np.zeros(0, kind)

        learned = mapped(LEARNED, np.uint8) if (folder / LEARNED).is_file() else None
        cache = TokenCache(
            folder=folder,
            tokens=mapped(TOKENS, dtype),
            learned=learned,
            starts=np.load(folder / STARTS, allow_pickle=False),
            targets=np.load(folder / TARGETS, allow_pickle=False),
            meta=meta,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{where}: the token cache {shown(folder)} is damaged ({one_line(exc)}); delete the folder to tokenize again"
        ) from None
    if cache.samples != meta["samples"] or int(cache.starts[-1]) != count:
        raise ConfigError(f"{where}: the token cache {shown(folder)} is damaged; delete the folder to tokenize again")
    return cache
