"""Data for the training loop: arrays from .npz / .npy files, rows of tokens from JSONL text
(graphforge/train/text/, an ArraySource over them) or a Python iterable, batched, shuffled per
epoch from a seed, checked against the program's inputs, and resumable.

The batches form one stream across epochs; its position is ``{"epoch": e, "batch": b}``
(b batches of epoch e consumed). Epoch e's order is ``default_rng([seed, e]).permutation``,
so a position alone restores the stream exactly: that is what makes a resumed run equal to
an uninterrupted one.

Data-parallel runs (a :class:`Shard` of N replicas) follow PyTorch's DistributedSampler:
``batch_size`` is per replica, batch b of an epoch is the global batch of N·batch_size
samples that one process would take with that batch size, and replica r takes every N-th
of its samples, from the r-th; the order is the same on every replica, so the global batch of
a step is the same set of samples whatever N is. A last, partial global batch is padded
with the epoch's first samples so that every replica has as many (``drop_last`` drops it
instead; evaluation pads nothing). A Python source batches itself: replica r takes batches
r, r + N, r + 2N, ... of what it yields (every replica iterates all of it), and a last group
of fewer than N batches is left out. Positions count global batches.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphforge.errors import ConfigError, one_line
from graphforge.program import BatchInput
from graphforge.train.config import DataLocation, PythonSource, shown

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class Shard:
    """Which share of the data this process takes: replica ``index`` of ``count``."""

    count: int = 1
    index: int = 0


ALL = Shard()


class Conformer:
    """Checks batches against the program's inputs and casts integer data to a float input
    (uint8 images → float32) and any data to a type that holds all its values (int32 labels →
    int64), saying so once through ``note``; any other mismatch is an error.
    ``where`` starts every message (the config file and key: ``train.toml: data.train``)."""

    def __init__(self, inputs: list[BatchInput], where: str, note: Callable[[str], None]):
        self.inputs = {spec.name: spec for spec in inputs}
        self.where = where
        self.note = note
        self._noted: set[str] = set()

    def check_array(self, name: str, array: np.ndarray, *, what: str = "array") -> np.dtype | None:
        """Check one array (first dim = samples); returns the dtype to cast it to, or None."""
        spec = self.inputs[name]
        if spec.dims is not None:
            sample_dims = spec.dims[1:]
            static_ok = all(
                isinstance(want, str) or want is None or want == have
                for want, have in zip(sample_dims, array.shape[1:], strict=False)
            )
            if array.ndim != len(spec.dims) or not static_ok:
                raise ConfigError(
                    f"{self.where}: {what} {name!r} is {array.dtype.name} {list(array.shape)}; the program "
                    f"input {name!r} takes {spec.dtype.name} {spec.describe_dims()}"
                )
        if array.dtype == spec.dtype:
            return None
        integer_to_float = np.issubdtype(array.dtype, np.integer) and np.issubdtype(spec.dtype, np.floating)
        if integer_to_float or np.can_cast(array.dtype, spec.dtype, casting="safe"):
            if name not in self._noted:
                self._noted.add(name)
                self.note(f"casting {name} {array.dtype.name} → {spec.dtype.name} (the program's input type)")
            return spec.dtype
        raise ConfigError(
            f"{self.where}: {what} {name!r} is {array.dtype.name}, the program input {name!r} takes "
            f"{spec.dtype.name} (data is cast only where no value changes, or integers to a float input; "
            "convert it beforehand)"
        )

    def required(self) -> list[str]:
        return [name for name, spec in self.inputs.items() if not spec.has_default]

    def conform(self, batch: Any, index: int) -> Batch:
        """A batch from a Python source: a dict holding every required input, nothing unknown."""
        what = f"batch {index}"
        if not isinstance(batch, dict):
            raise ConfigError(
                f"{self.where}: {what} is {type(batch).__name__}; a Python source yields dicts of "
                f"program input name → array ({', '.join(self.inputs)})"
            )
        missing = [n for n in self.required() if n not in batch]
        unknown = [n for n in batch if n not in self.inputs]
        if missing or unknown:
            problem = f"has no {missing[0]!r}" if missing else f"has {unknown[0]!r}, which is no program input"
            raise ConfigError(f"{self.where}: {what} {problem}; the program takes: {', '.join(self.inputs)}")
        out = {}
        for name, value in batch.items():
            array = np.asarray(value)
            cast = self.check_array(name, array, what=f"{what}'s")
            out[name] = np.ascontiguousarray(array if cast is None else array.astype(cast))
        return out


# --------------------------------------------------------------------------- sources


class ArraySource:
    """Arrays with one sample per row, cut into batches in a seeded per-epoch order; this
    process's ``shard`` of each (``pad``: make a partial last batch a multiple of the
    replicas with the epoch's first samples; else a replica's part may be smaller, or
    empty, and is then left out)."""

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        casts: dict[str, np.dtype],
        *,
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        label: str,
        shard: Shard = ALL,
        pad: bool = True,
    ):
        self.arrays = arrays
        self.casts = casts
        self.batch_size = batch_size
        self.shard, self.pad = shard, pad
        self.global_batch = batch_size * shard.count
        self.shuffle = shuffle
        self.seed = seed
        self.samples = len(next(iter(arrays.values())))
        full, rest = divmod(self.samples, self.global_batch)
        self.batches_per_epoch = full if drop_last or not rest else full + 1
        self.label = label

    def describe(self) -> str:
        return f"{self.samples:,} samples ({self.label})"

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.samples) if self.shuffle else None
        count, size = self.shard.count, self.global_batch
        for b in range(start, self.batches_per_epoch):
            rows = slice(b * size, min((b + 1) * size, self.samples))
            index = order[rows] if order is not None else rows
            if count > 1:
                index = np.arange(self.samples)[index] if isinstance(index, slice) else index
                short = -len(index) % count
                if short and self.pad:  # as DistributedSampler: wrap around to the epoch's first samples
                    first = order if order is not None else np.arange(self.samples)
                    index = np.concatenate([index, np.resize(first, short)])
                index = index[self.shard.index :: count]
                if len(index) == 0:
                    continue
            batch = {}
            for name, array in self.arrays.items():
                part = np.asarray(array[index])
                cast = self.casts.get(name)
                batch[name] = np.ascontiguousarray(part if cast is None else part.astype(cast))
            yield batch


class IterableSource:
    """A Python callable returning an iterable of dict batches, called once per epoch; this
    process takes its ``shard`` of each group of ``shard.count`` batches."""

    def __init__(self, factory: Callable[..., Any], conformer: Conformer, label: str, shard: Shard = ALL):
        self.factory = factory
        self.conformer = conformer
        self.label = label
        self.shard = shard
        try:
            self._takes_epoch = "epoch" in inspect.signature(factory).parameters
        except (TypeError, ValueError):
            self._takes_epoch = False
        self.samples: int | None = None
        self.batches_per_epoch: int | None = None

    def describe(self) -> str:
        return f"batches from {self.label}"

    def _iterable(self, epoch: int) -> Any:
        try:
            return self.factory(epoch=epoch) if self._takes_epoch else self.factory()
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{self.conformer.where}: {self.label} failed: {one_line(exc)}") from None

    def count_batches(self) -> int | None:
        """Batches per epoch when the iterable has a length (for train.epochs)."""
        iterable = self._iterable(0)
        try:
            self.batches_per_epoch = len(iterable) // self.shard.count
        except TypeError:
            return None
        return self.batches_per_epoch

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        iterable = self._iterable(epoch)
        try:
            iterator = iter(iterable)
        except TypeError:
            raise ConfigError(
                f"{self.conformer.where}: {self.label} returned {type(iterable).__name__}, not an iterable of batches"
            ) from None
        count, mine = self.shard.count, self.shard.index
        index, kept = 0, None
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return  # a group the iterable ended within is left out: every replica stops here
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(
                    f"{self.conformer.where}: {self.label} failed at batch {index}: {one_line(exc)}"
                ) from None
            group, place = divmod(index, count)
            if group >= start and place == mine:
                kept = self.conformer.conform(batch, index)
            if group >= start and place == count - 1:
                yield kept
            index += 1


Source = ArraySource | IterableSource


class Stream:
    """Batches one after another across epochs; ``position`` says where it stands."""

    def __init__(self, source: Source, position: dict | None = None):
        self.source = source
        position = position or {}
        self.epoch = int(position.get("epoch", 0))
        self.batch = int(position.get("batch", 0))
        self._iterator: Iterator[Batch] | None = None

    @property
    def position(self) -> dict[str, int]:
        """Where the stream stands; the end of an epoch of known length reads as the next one's start."""
        if self.source.batches_per_epoch is not None and self.batch >= self.source.batches_per_epoch:
            return {"epoch": self.epoch + 1, "batch": 0}
        return {"epoch": self.epoch, "batch": self.batch}

    def next(self) -> Batch:
        for _ in range(2):
            if self._iterator is None:
                self._iterator = self.source.epoch(self.epoch, self.batch)
            batch = next(self._iterator, None)
            if batch is not None:
                self.batch += 1
                return batch
            if self.batch == 0:
                raise ConfigError(f"{self.source.label}: epoch {self.epoch} has no batches")
            self.epoch, self.batch, self._iterator = self.epoch + 1, 0, None
        raise ConfigError(f"{self.source.label}: epoch {self.epoch} has no batches")  # pragma: no cover

    def fractional_epoch(self) -> float:
        per_epoch = self.source.batches_per_epoch
        return self.epoch + self.batch / per_epoch if per_epoch else float(self.epoch)


# --------------------------------------------------------------------------- opening a source


def open_source(
    location: DataLocation,
    conformer: Conformer,
    *,
    names: dict[str, str],
    batch_size: int,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    shard: Shard = ALL,
    pad: bool = True,
) -> Source:
    """The source at ``location`` (``data.train`` or ``data.eval``), checked against the
    program; this process's ``shard`` of it (see the module's docstring). (JSONL text is
    graphforge/train/text/source.py's open_text, an ArraySource too.)"""
    where = conformer.where
    if isinstance(location, PythonSource):
        return IterableSource(_import(location, where), conformer, str(location), shard)
    batching = {"batch_size": batch_size, "shuffle": shuffle, "seed": seed, "drop_last": drop_last}
    arrays, casts = mapped_arrays(_load_arrays(location, where), location, conformer, names)
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ConfigError(
            f"{where}: the arrays hold different numbers of samples: "
            + ", ".join(f"{n} {c:,}" for n, c in lengths.items())
        )
    refuse_too_few(next(iter(lengths.values())), batch_size, shard, drop_last, where)
    return ArraySource(arrays, casts, **batching, label=shown(location), shard=shard, pad=pad)


def mapped_arrays(
    available: dict[str, Any], location: Path, conformer: Conformer, names: dict[str, str]
) -> tuple[dict[str, Any], dict[str, np.dtype]]:
    """The arrays that feed the program's inputs, by input name (``names`` maps an input to
    an array of another name), each checked; and the dtypes to cast some of them to."""
    where = conformer.where
    arrays, casts = {}, {}
    for name in [n for n in names if n not in conformer.inputs]:
        raise ConfigError(
            f"{where}: data.inputs.{name} maps no program input; the program takes: {', '.join(conformer.inputs)}"
        )
    for name in conformer.inputs:
        array_name = names.get(name, name)
        if array_name not in available:
            if name not in conformer.required():
                continue
            hint = (
                f"data.inputs.{name} maps it to {array_name!r}"
                if name in names
                else f'map one with data.inputs.{name} = "ARRAY"'
            )
            raise ConfigError(
                f"{where}: {shown(location)} has no array {array_name!r} for the program input {name!r} ({hint}); "
                f"its arrays: {', '.join(available) or 'none'}"
            )
        array = available[array_name]
        if array.ndim == 0:
            raise ConfigError(f"{where}: array {array_name!r} is a scalar; expected one row per sample")
        cast = conformer.check_array(name, array, what="array")
        arrays[name] = array
        if cast is not None:
            casts[name] = cast
    if not arrays:
        raise ConfigError(f"{where}: the program takes no batch inputs")
    return arrays, casts


def refuse_too_few(
    count: int, batch_size: int, shard: Shard, drop_last: bool, where: str, what: str = "samples"
) -> None:
    """Refuse data that makes no batch."""
    if count == 0 or (drop_last and count < batch_size * shard.count):
        replicas = f" on each of {shard.count} processes" if shard.count > 1 else ""
        raise ConfigError(
            f"{where}: {count} {what} make no batch of data.batch_size = {batch_size}{replicas}"
            + (" with data.drop_last" if count else "")
        )


def _load_arrays(path: Path, where: str) -> dict[str, np.ndarray]:
    if not path.exists():
        raise ConfigError(f"{where}: no such file or folder {shown(path)}")
    try:
        if path.is_dir():
            files = sorted(path.glob("*.npy"))
            if not files:
                raise ConfigError(f"{where}: the folder {shown(path)} holds no .npy files")
            return {f.stem: np.load(f, mmap_mode="r", allow_pickle=False) for f in files}
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ConfigError(f"{where}: {shown(path)} is a single array; give an .npz file or a folder of .npy files")
        with loaded as archive:
            return {name: archive[name] for name in archive.files}
    except ConfigError:
        raise
    except (OSError, ValueError, EOFError) as exc:
        raise ConfigError(f"{where}: cannot read {shown(path)} ({one_line(exc)})") from None


def _import(source: PythonSource, where: str) -> Callable[..., Any]:
    """The callable a Python source names; a module is looked up beside the config first."""
    try:
        if source.file is not None:
            module = _module_from_file(source.file, where)
        else:
            sys.path.insert(0, str(source.folder))
            try:
                module = importlib.import_module(source.module)
            finally:
                sys.path.remove(str(source.folder))
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{where}: importing {source} failed: {one_line(exc)}") from None
    if not hasattr(module, source.attr):
        raise ConfigError(f"{where}: {source.file or source.module} has no attribute {source.attr!r}")
    target = getattr(module, source.attr)
    if callable(target):
        return target
    if isinstance(target, list | tuple):
        return lambda: target
    raise ConfigError(
        f"{where}: {source} is {type(target).__name__}; expected a callable returning an iterable of batches"
    )


def _module_from_file(file: Path, where: str):
    if not file.is_file():
        raise ConfigError(f"{where}: no such file {shown(file)}")
    name = f"graphforge_data_{file.stem}_{abs(hash(str(file.resolve())))}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return module
