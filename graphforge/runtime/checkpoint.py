"""Checkpoints: every tensor a training program carries, plus the loop's properties, in one file.

A checkpoint is one safetensors file. Its tensors are the program's carried tensors
(parameters, optimizer states, gradient accumulators, buffers such as BatchNorm running
statistics), each under its program input name. Its header metadata holds, under the key
``graphforge.checkpoint``, one JSON document with the properties: format version, step,
learning rate, LR-schedule state, seeds, data position, user properties
(``state.properties[...]``), a manifest of the tensors (name, role, dtype, shape, and the
CRC-32 of the tensor's bytes), and for a program whose base the lora pass froze, that base
by reference (each frozen weight's CRC-32, as the program records it): the frozen weights
themselves are the program's constants, kept once in its file, never in a checkpoint, so a
LoRA run's checkpoint holds the adapters and their optimizer states alone. The safetensors header is itself JSON, so any safetensors
tool (or ``head -c``) reads both.

One file means one atomic write: the checkpoint is written to a temporary file beside the
target, flushed to disk, and renamed over it. A crash leaves either the previous
checkpoint or the new one, never a half-written file; at most the temporary stays, which the
next run into the folder removes (``graphforge.tempfiles``: the writer holds it locked).

Loading refuses, with a CheckpointError naming the file and the tensor, a checkpoint that
is truncated (naming the first tensor whose bytes are cut, from the header's offsets) or
not a checkpoint, whose JSON does not parse, whose tensors disagree with its manifest or
with their checksum (a damaged byte), or that does not match the program it is loaded for: a missing tensor, a
tensor of another shape or dtype, and also an **extra** tensor the program does not carry
(refused rather than ignored: it means the checkpoint was saved from another program, say
an adam program's ``exp_avg`` offered to an sgd program, and silently dropping state is
how a resumed run quietly diverges), and one trained on another base than the program's
(a frozen weight whose CRC-32 differs, named).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from onnx import numpy_helper

from graphforge.errors import CheckpointError, GraphforgeError
from graphforge.graph import Model
from graphforge.model_io import ModelSource
from graphforge.program import CarriedSpec, ProgramRoles, joined_slices, program_proto
from graphforge.tempfiles import move_into_place, temp_file_beside

FORMAT = "graphforge.checkpoint"
VERSION = 1
#: the safetensors header metadata key that holds the JSON properties
METADATA_KEY = "graphforge.checkpoint"
#: mismatches listed in one error message; the rest are counted
_LISTED = 5
#: the largest safetensors header (the library refuses larger ones)
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class TensorSpec:
    """One carried tensor: its program input name, role, dtype and shape."""

    name: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    #: CRC-32 of the tensor's bytes as saved (None: not known, e.g. a checkpoint written before checksums)
    crc32: int | None = None
    #: a piece of a tensor (a ZeRO shard's): (its first element in the whole tensor, flattened;
    #: the whole tensor's shape); ``shape`` is then the piece's, one dimension. None: whole
    part: tuple[int, tuple[int, ...]] | None = None
    #: a piece that is a slice along this axis (a tensor-parallel member's): ``part``'s start
    #: is then its first index along the axis, and ``shape`` the slice's
    axis: int | None = None
    #: a slice of each of these sections along ``axis`` (their whole sizes: a fused QKV
    #: weight's), side by side; ``part``'s start is then its offset in the first, scaled
    #: to the whole axis (rank × the slice's size along it)
    sections: tuple[int, ...] | None = None

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)}"

    def to_json(self) -> dict:
        entry = {"name": self.name, "role": self.role, "dtype": self.dtype, "shape": list(self.shape)}
        if self.crc32 is not None:
            entry["crc32"] = self.crc32
        if self.part is not None:
            entry["part"] = {"start": self.part[0], "of": list(self.part[1])}
            if self.axis is not None:
                entry["part"]["axis"] = self.axis
            if self.sections:
                entry["part"]["sections"] = list(self.sections)
        return entry


def checksum(array: np.ndarray) -> int:
    """CRC-32 of an array's bytes in C order (what safetensors writes): zlib's, a few GB/s
    (3.4 on a 2-core EPYC VM), no copy for a contiguous array."""
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _tensor_specs(specs: Sequence[CarriedSpec]) -> list[TensorSpec]:
    return [TensorSpec(s.input, s.role, s.dtype, s.shape) for s in specs]


class TensorHolder(Protocol):
    """Whatever holds a state's tensors while it trains (a runtime's device buffers): the
    state reads its current values back through this, and only this."""

    def read_tensors(self) -> dict[str, np.ndarray]:
        """The current value of every carried tensor, by program input name (copies)."""
        ...


class CheckpointState:
    """The state of a training run: carried tensors and properties.

    Attributes: ``step`` (optimizer steps done), ``learning_rate`` (None: the program's
    default), ``scheduler`` (an LR schedule's state_dict), ``seeds`` (name -> seed),
    ``data_position`` (any JSON value: where the data loader stands), ``properties``
    (any JSON values the user keeps), ``grad_reset_pending`` (an accumulating program's
    next ``module(...)`` overwrites the accumulated gradients instead of adding to them;
    saved so a run resumed mid-accumulation continues it), ``micro_batch`` (forward passes
    of the current step so far: with ``seeds["dropout"]`` and the step, it picks the dropout
    masks). ``tensors`` are numpy arrays by program input name;
    while a :class:`~graphforge.runtime.Module` trains on this state, they live inside
    onnxruntime (the state is attached to its holder) and ``tensors`` reads the current
    values back (a copy).
    """

    def __init__(
        self,
        tensors: Mapping[str, np.ndarray],
        specs: Sequence[TensorSpec],
        *,
        step: int = 0,
        learning_rate: float | None = None,
        scheduler: dict | None = None,
        seeds: dict[str, int] | None = None,
        data_position: Any = None,
        properties: dict[str, Any] | None = None,
        grad_reset_pending: bool = True,
        micro_batch: int = 0,
        source: str | None = None,
        base: Mapping[str, int] | None = None,
    ):
        self._tensors = dict(tensors)
        self.specs = list(specs)
        self.step = step
        self.learning_rate = learning_rate
        self.scheduler = scheduler
        self.seeds = dict(seeds or {})
        self.data_position = data_position
        self.properties = dict(properties or {})
        self.grad_reset_pending = bool(grad_reset_pending)
        self.micro_batch = micro_batch
        #: where the state came from, for messages ("checkpoint runs/ck.safetensors")
        self.source = source
        #: the frozen base it trains on, by reference (weight -> CRC-32; ProgramRoles.lora_base), or None
        self.base = dict(base) if base else None
        self._holder: TensorHolder | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_program(cls, program: ModelSource | Model, *, writable: bool = True) -> CheckpointState:
        """The initial state of a program: initializer values, zeros for zero-initialized
        states (optimizer moments, accumulators), step 0, the program's learning rate.
        ``writable=False``: the initializers' arrays are read-only views of the program's
        bytes, not copies, for a holder that copies them where it keeps them at once (a Module
        made without a state: GPT-2 small's 0.5 GB of weights copied once less, 1.1 s here)."""
        proto = program_proto(program)
        program_roles = ProgramRoles.of_proto(proto).require_training_program()
        specs = program_roles.carried
        initializers = {t.name: t for t in proto.graph.initializer}
        tensors = {}
        for spec in specs:
            if spec.init == "initializer":
                if spec.input not in initializers:
                    raise CheckpointError(f"the program carries {spec.input!r} from an initializer it does not have")
                value = numpy_helper.to_array(initializers[spec.input])
                tensors[spec.input] = value.copy() if writable else value
            else:
                tensors[spec.input] = np.zeros(spec.shape, np.dtype(spec.dtype))
        lr = program_roles.default_lr
        return cls(
            tensors,
            _tensor_specs(specs),
            learning_rate=lr,
            source="the program's initial state",
            base=program_roles.lora_base,
        )

    def copy(self) -> CheckpointState:
        """A detached snapshot (a state trains in one Module at a time)."""
        return self.with_tensors({k: np.array(v, copy=True) for k, v in self.tensors.items()}, self.specs)

    def with_tensors(self, tensors: Mapping[str, np.ndarray], specs: Sequence[TensorSpec]) -> CheckpointState:
        """A detached state with this one's step, learning rate, schedule, seeds, position and
        properties (copies), holding ``tensors`` (``specs``) instead: a tensor-parallel member's
        slices of a whole state, or the whole joined from them."""
        return CheckpointState(
            tensors,
            specs,
            step=self.step,
            learning_rate=self.learning_rate,
            scheduler=copy.deepcopy(self.scheduler),
            seeds=dict(self.seeds),
            data_position=copy.deepcopy(self.data_position),
            properties=copy.deepcopy(self.properties),
            grad_reset_pending=self.grad_reset_pending,
            micro_batch=self.micro_batch,
            source=self.source,
            base=self.base,
        )

    # ------------------------------------------------------------------ tensors

    @property
    def tensors(self) -> dict[str, np.ndarray]:
        """Carried tensors by name; read back from their holder while a Module trains on them."""
        if self._holder is not None:
            return self._holder.read_tensors()
        return self._tensors

    @property
    def attached(self) -> bool:
        """Whether a holder (a Module's runtime) holds the tensors now."""
        return self._holder is not None

    def attach(self, holder: TensorHolder) -> dict[str, np.ndarray]:
        """Hand the tensors to ``holder``, which keeps them from now on; returns them (the
        state's own arrays, for the holder to copy where it keeps them). A state trains in
        one Module at a time: a second holder is refused."""
        if self._holder is not None and self._holder is not holder:
            raise GraphforgeError(
                "this CheckpointState already belongs to a Module; give the second Module state.copy() "
                "(or CheckpointState.from_program / load) instead"
            )
        tensors, self._tensors = self._tensors, {}
        self._holder = holder
        return tensors

    def check(self, program: ModelSource | Model | Sequence[CarriedSpec]) -> None:
        """Refuse (CheckpointError) a state whose tensors do not match what ``program`` carries:
        a missing tensor, an extra one, or one of another dtype or shape; or, where both record
        the frozen base they train on, one trained on another base."""
        if isinstance(program, Sequence) and not isinstance(program, str | bytes):
            specs = program
        else:
            program_roles = ProgramRoles.read(program).require_training_program()
            specs = program_roles.carried
            self._check_base(program_roles.lora_base)
        expected = {s.name: s for s in _tensor_specs(specs)}
        tensors = self._tensors if self._holder is None else {s.name: s for s in self.specs}
        where = self.source or "the checkpoint"
        problems = []
        for name, spec in expected.items():
            if name not in tensors:
                problems.append(f"no tensor {name!r} ({spec.role}, {spec.describe()}), which the program carries")
                continue
            have = tensors[name]
            dtype, shape = (have.dtype, have.shape) if isinstance(have, TensorSpec) else (have.dtype.name, have.shape)
            if (str(dtype), tuple(shape)) != (spec.dtype, spec.shape):
                problems.append(f"tensor {name!r} is {dtype} {list(shape)}, the program expects {spec.describe()}")
        extra = [n for n in tensors if n not in expected]
        for name in extra:
            problems.append(f"tensor {name!r} is not carried by the program (saved from a different program?)")
        if problems:
            raise CheckpointError(f"{where} does not match the program: " + _capped(problems))

    def _check_base(self, base: Mapping[str, int]) -> None:
        """Refuse a state trained on another frozen base than ``base`` (the program's), naming
        the first weight that differs; a side that records no base is not compared."""
        if not base or not self.base:
            return
        where = self.source or "the checkpoint"
        for name in sorted(set(base) | set(self.base)):
            mine, theirs = self.base.get(name), base.get(name)
            if mine == theirs:
                continue
            if mine is None or theirs is None:
                what = f"the frozen weight {name!r} is in {'the program' if mine is None else 'its'} base only"
            else:
                what = f"the frozen weight {name!r} differs (crc32 {mine:08x}; the program's {theirs:08x})"
            raise CheckpointError(
                f"{where} was trained on another base model than the program's: {what}; use the base model it "
                "was trained on"
            )

    # ------------------------------------------------------------------ files

    def _document(
        self,
        tensors: Mapping[str, np.ndarray],
        shards: Sequence[str] = (),
        parts: Mapping[str, tuple[int, tuple[int, ...], int | None]] | None = None,
    ) -> str:
        roles_by_name = {s.name: s.role for s in self.specs}
        parts = parts or {}
        document = {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "learning_rate": self.learning_rate,
            "scheduler": self.scheduler,
            "seeds": self.seeds,
            "data_position": self.data_position,
            "properties": self.properties,
            "grad_reset_pending": bool(self.grad_reset_pending),
            "micro_batch": self.micro_batch,
            "tensors": [
                TensorSpec(
                    n,
                    roles_by_name.get(n, "unknown"),
                    t.dtype.name,
                    tuple(t.shape),
                    checksum(t),
                    parts[n][:2] if n in parts else None,
                    parts[n][2] if n in parts else None,
                    parts[n][3] if n in parts else None,
                ).to_json()
                for n, t in tensors.items()
            ],
        }
        if shards:
            document["shards"] = list(shards)
        if self.base:
            document["base"] = {name: int(crc) for name, crc in self.base.items()}
        if isinstance(self.step, bool) or not isinstance(self.step, int | np.integer) or self.step < 0:
            raise CheckpointError(f"state.step must be a whole number ≥ 0, got {self.step!r}")
        document["step"] = int(self.step)
        if (
            isinstance(self.micro_batch, bool)
            or not isinstance(self.micro_batch, int | np.integer)
            or self.micro_batch < 0
        ):
            raise CheckpointError(f"state.micro_batch must be a whole number ≥ 0, got {self.micro_batch!r}")
        document["micro_batch"] = int(self.micro_batch)
        if self.learning_rate is not None:
            document["learning_rate"] = float(self.learning_rate)
        for key in ("scheduler", "seeds", "data_position", "properties"):
            try:
                json.dumps(document[key], allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise CheckpointError(f"state.{key} cannot be saved as JSON: {exc}") from None
        return json.dumps(document, allow_nan=False)

    def save(
        self,
        path: str | os.PathLike,
        *,
        names: Sequence[str] | None = None,
        shards: Sequence[str] = (),
        parts: Mapping[str, tuple] | None = None,
    ) -> Path:
        """Write the checkpoint atomically (temp file beside ``path``, fsync, rename).

        On any failure the previous file at ``path`` is left as it was and no temp file stays.
        A sharded checkpoint (pipeline stages, each writing its own tensors): ``names``, the
        tensors this file holds (default all), and ``shards``, the files beside it holding
        the others (written before it: this file, the last, makes the checkpoint whole), which
        :meth:`load` reads with it. ``parts``: pieces of tensors this file holds besides (a
        ZeRO replica's shard of the optimizer states: name -> (its elements, flat; the first
        one's index in the whole tensor; the whole tensor's shape); a tensor-parallel member's
        slices: name -> (the slice; its first index along ``axis``; the whole shape; axis));
        :meth:`load` puts the pieces of every file together and refuses a tensor whose pieces
        do not cover it.
        """
        path = Path(path)
        if path.is_dir():
            raise CheckpointError(f"{path}: is a folder, expected a checkpoint file path")
        if not path.parent.is_dir():
            raise CheckpointError(f"{path}: folder {path.parent} does not exist")
        if names is None:
            chosen = self.tensors
        else:  # reading the holder's tensors back only when this file holds some
            held = self.tensors if names else {}
            chosen = {n: held[n] for n in names}
        tensors = {name: np.asarray(value, order="C") for name, value in chosen.items()}
        twice = sorted(set(parts or {}) & set(tensors))
        if twice:
            raise CheckpointError(f"{path}: tensor {twice[0]!r} is both whole and a part in one file")
        pieces = {}
        for name, (values, start, shape, *along) in (parts or {}).items():
            axis = int(along[0]) if along else None
            sections = tuple(int(x) for x in along[1]) if len(along) > 1 and along[1] else None
            tensors[name] = (
                np.ascontiguousarray(values) if axis is not None else np.ascontiguousarray(values).reshape(-1)
            )
            pieces[name] = (int(start), tuple(int(d) for d in shape), axis, sections)
        metadata = {METADATA_KEY: self._document(tensors, shards, pieces)}
        try:
            with temp_file_beside(path) as tmp:  # locked: a later run's remove_stale knows it is ours
                _write_tensors(tmp, tensors, metadata)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                move_into_place(tmp, path)
        except BaseException as exc:
            if isinstance(exc, OSError | ValueError) or type(exc).__name__ == "SafetensorError":
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise CheckpointError(f"{path}: cannot write the checkpoint ({reason})") from None
            raise
        _fsync_folder(path.parent)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, program: ModelSource | Model | None = None) -> CheckpointState:
        """Read a checkpoint; with ``program``, also check that it matches what the program carries."""
        state = cls._load(Path(path), None)
        if program is not None:
            state.check(program)
        return state

    @classmethod
    def _load(cls, path: Path, parts_of_parent: dict | None) -> CheckpointState:
        """One file and the shards it lists. The pieces of tensors a shard holds go to
        ``parts_of_parent`` (name -> pieces), for the checkpoint listing it to join."""
        if not path.is_file():
            raise CheckpointError(f"{path}: no such checkpoint file")
        import safetensors

        _check_layout(path)
        try:
            with safetensors.safe_open(str(path), framework="numpy") as f:
                metadata = f.metadata() or {}
                names = list(f.keys())
                if METADATA_KEY not in metadata:
                    raise CheckpointError(f"{path}: not a graphforge checkpoint (no {METADATA_KEY!r} metadata)")
                document = _parse_document(path, metadata[METADATA_KEY])
                manifest = _parse_manifest(path, document)
                _check_names(path, manifest, names)
                tensors = {}
                for spec in manifest:
                    try:
                        value = f.get_tensor(spec.name)
                    except Exception as exc:
                        raise CheckpointError(f"{path}: cannot read tensor {spec.name!r} ({exc})") from None
                    if (value.dtype.name, tuple(value.shape)) != (spec.dtype, spec.shape):
                        raise CheckpointError(
                            f"{path}: tensor {spec.name!r} is {value.dtype.name} {list(value.shape)} but its "
                            f"manifest says {spec.describe()}"
                        )
                    if spec.crc32 is not None and checksum(value) != spec.crc32:
                        raise CheckpointError(
                            f"{path}: tensor {spec.name!r} is damaged: its bytes do not match the checksum saved "
                            f"with it (crc32 {checksum(value):08x}, saved {spec.crc32:08x})"
                        )
                    tensors[spec.name] = value
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors' own errors: truncated, bad header, not a safetensors file
            raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt: {exc})") from None
        parts = {s.name: [(s, tensors.pop(s.name), path.name)] for s in manifest if s.part is not None}
        manifest = [s for s in manifest if s.part is None]
        for shard in document.get("shards", []):  # a sharded checkpoint: the other stages' (replicas') files
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise CheckpointError(f"{path}: malformed shard entry {str(shard)[:80]!r} (a file name beside it)")
            if not (path.parent / shard).is_file():
                raise CheckpointError(f"{path}: its shard {shard} is missing (the checkpoint is not whole without it)")
            other = cls._load(path.parent / shard, parts)
            if other.step != document["step"]:
                raise CheckpointError(
                    f"{path}: its shard {shard} is of step {other.step}, not {document['step']} (a stale file?)"
                )
            twice = sorted(set(other._tensors) & set(tensors))
            if twice:
                raise CheckpointError(f"{path}: tensor {twice[0]!r} is in it and in its shard {shard}")
            tensors.update(other._tensors)
            manifest += other.specs
        if parts_of_parent is not None:  # a shard: its pieces go to the checkpoint that lists it
            for name, pieces in parts.items():
                parts_of_parent.setdefault(name, []).extend(pieces)
        else:
            for name, pieces in parts.items():
                if name in tensors:
                    raise CheckpointError(f"{path}: tensor {name!r} is saved whole and in pieces")
                spec, tensors[name] = _joined(path, name, pieces)
                manifest.append(spec)
        return cls(
            tensors,
            manifest,
            step=document["step"],
            learning_rate=document.get("learning_rate"),
            scheduler=document.get("scheduler"),
            seeds=document.get("seeds"),
            data_position=document.get("data_position"),
            properties=document.get("properties"),
            grad_reset_pending=document.get("grad_reset_pending", True),
            micro_batch=document.get("micro_batch", 0),
            source=f"checkpoint {path}",
            base=document.get("base"),
        )


def _write_tensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write the safetensors file (one function, so tests can make it fail half-way)."""
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX); not possible everywhere, so best effort."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parse_document(path: Path, text: str) -> dict:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: its properties are not valid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(f"{path}: its properties are not a {FORMAT} document")
    version = document.get("version")
    if version != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version!r}; this graphforge reads version {VERSION}")
    step = document.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: its step is {step!r}, expected a whole number ≥ 0")
    lr = document.get("learning_rate")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr)):
        raise CheckpointError(f"{path}: its learning_rate is {lr!r}, expected a number")
    micro = document.get("micro_batch", 0)
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 0:
        raise CheckpointError(f"{path}: its micro_batch is {micro!r}, expected a whole number ≥ 0")
    if not isinstance(document.get("grad_reset_pending", True), bool):
        raise CheckpointError(
            f"{path}: its grad_reset_pending is {document['grad_reset_pending']!r}, expected true/false"
        )
    base = document.get("base", {})
    if not isinstance(base, dict) or any(isinstance(v, bool) or not isinstance(v, int) for v in base.values()):
        raise CheckpointError(f"{path}: its base is {json.dumps(base)[:80]}, expected {{weight: crc32}}")
    for key, kind in (("scheduler", dict), ("seeds", dict), ("properties", dict)):
        value = document.get(key)
        if value is not None and not isinstance(value, kind):
            raise CheckpointError(f"{path}: its {key} is {type(value).__name__}, expected an object")
    return document


def _parse_manifest(path: Path, document: dict) -> list[TensorSpec]:
    entries = document.get("tensors")
    if not isinstance(entries, list):
        raise CheckpointError(f"{path}: its properties have no tensor manifest")
    manifest = []
    for entry in entries:
        try:
            crc = entry.get("crc32")
            if crc is not None and (isinstance(crc, bool) or not isinstance(crc, int)):
                raise TypeError
            part, axis, sections = entry.get("part"), None, None
            if part is not None:
                axis = None if part.get("axis") is None else int(part["axis"])
                sections = tuple(int(x) for x in part["sections"]) if part.get("sections") else None
                part = (int(part["start"]), tuple(int(d) for d in part["of"]))
            spec = TensorSpec(
                str(entry["name"]), str(entry["role"]), str(entry["dtype"]), tuple(entry["shape"]), crc, part, axis,
                sections,
            )  # fmt: skip
        except (KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{path}: malformed tensor manifest entry {str(entry)[:120]}") from None
        manifest.append(spec)
    return manifest


def _joined(path: Path, name: str, pieces: list[tuple[TensorSpec, np.ndarray, str]]) -> tuple[TensorSpec, np.ndarray]:
    """The whole tensor ``name`` from its pieces (spec, values, file), which must cover it once."""
    spec = pieces[0][0]
    shape = spec.part[1]
    if any(p[0].axis is not None for p in pieces):
        return _joined_slices(path, name, pieces)
    size = math.prod(shape)
    whole = np.empty(size, dtype=pieces[0][1].dtype)
    at = 0
    for piece, values, file in sorted(pieces, key=lambda p: p[0].part[0]):
        start = piece.part[0]
        if piece.part[1] != shape or values.dtype != whole.dtype:
            raise CheckpointError(f"{path}: the pieces of tensor {name!r} disagree on its shape or type ({file})")
        if start != at:
            what = f"elements {at}..{start} of it are in no shard" if start > at else f"{file} holds elements twice"
            raise CheckpointError(f"{path}: tensor {name!r} is not whole: {what} (a shard missing or from another run)")
        whole[start : start + values.size] = values.reshape(-1)
        at = start + values.size
    if at != size:
        raise CheckpointError(f"{path}: tensor {name!r} is not whole: elements {at}..{size} of it are in no shard")
    return TensorSpec(name, spec.role, spec.dtype, shape), whole.reshape(shape)


def _joined_slices(path: Path, name: str, pieces: list[tuple[TensorSpec, np.ndarray, str]]):
    """The whole tensor ``name`` from slices along one axis (tensor-parallel members'), which must cover it once."""
    spec = pieces[0][0]
    shape, axis = spec.part[1], spec.axis
    at, slices = 0, []
    for piece, values, file in sorted(pieces, key=lambda p: p[0].part[0]):
        start = piece.part[0]
        expected = (*shape[:axis], values.shape[axis] if values.ndim == len(shape) else -1, *shape[axis + 1 :])
        if (
            piece.axis != axis
            or piece.sections != spec.sections
            or piece.part[1] != shape
            or values.dtype.name != spec.dtype
            or values.shape != expected
        ):
            raise CheckpointError(f"{path}: the slices of tensor {name!r} disagree on its shape, axis or type ({file})")
        if start != at:
            what = (
                f"indices {at}..{start} of its axis {axis} are in no shard"
                if start > at
                else f"{file} holds a slice twice"
            )
            raise CheckpointError(f"{path}: tensor {name!r} is not whole: {what} (a shard missing or from another run)")
        slices.append(values)
        at = start + values.shape[axis]
    if at != shape[axis]:
        raise CheckpointError(
            f"{path}: tensor {name!r} is not whole: indices {at}..{shape[axis]} of its axis {axis} are in no shard"
        )
    return TensorSpec(name, spec.role, spec.dtype, shape), joined_slices(slices, axis, spec.sections)


def _check_layout(path: Path) -> None:
    """Refuse a file whose safetensors layout does not add up, naming what is cut: the
    header, or the first tensor whose byte range (from the header's offsets) runs past the
    end of the file. safetensors itself only says "incomplete metadata"."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: not a checkpoint ({size} bytes: empty or cut short before its header)")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER:
            raise CheckpointError(f"{path}: not a readable checkpoint (not a safetensors file: no header length)")
        if length > size - 8:
            raise CheckpointError(
                f"{path}: truncated inside its header ({length} bytes, the file holds {size - 8} after its length)"
            )
        text = f.read(length)
    try:
        header = json.loads(text)
        ranges = sorted(
            (int(v["data_offsets"][0]), int(v["data_offsets"][1]), name)
            for name, v in header.items()
            if name != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise CheckpointError(
            f"{path}: damaged: its safetensors header is not valid JSON with tensor offsets"
        ) from None
    data = size - 8 - length
    end = max((stop for _, stop, _ in ranges), default=0)
    if data < end:
        cut = [(start, stop, name) for start, stop, name in ranges if stop > data]
        start, stop, name = cut[0]
        after = f"; {len(cut) - 1} more tensor(s) after it are cut or missing" if len(cut) > 1 else ""
        raise CheckpointError(
            f"{path}: truncated: tensor {name!r} needs data bytes {start}..{stop} but the file holds only {data}{after}"
        )
    if data > end:
        raise CheckpointError(f"{path}: damaged: {data - end} unexpected byte(s) after its last tensor")


def _capped(problems: list[str]) -> str:
    """Problems joined with '; ', the first few listed and the rest counted."""
    shown = "; ".join(problems[:_LISTED])
    return shown + (f"; ... and {len(problems) - _LISTED} more" if len(problems) > _LISTED else "")


def _check_names(path: Path, manifest: list[TensorSpec], names: list[str]) -> None:
    listed = {s.name for s in manifest}
    missing = [s.name for s in manifest if s.name not in names]
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]!r} is listed in its manifest but missing from the file")
    unlisted = [n for n in names if n not in listed]
    if unlisted:
        raise CheckpointError(f"{path}: tensor {unlisted[0]!r} is in the file but not in its manifest")


class CheckpointManager:
    """Step-numbered checkpoints in one folder: ``<prefix>-<step:08d>.safetensors``.

    ``save(state)`` writes the checkpoint for ``state.step`` atomically, then deletes the
    oldest so that at most ``keep_last`` remain (None keeps all). ``latest()`` is the path
    of the newest one (by step), or None.
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = None, prefix: str = "checkpoint"):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise GraphforgeError(f"keep_last must be a whole number ≥ 1 (or None to keep all), got {keep_last!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise GraphforgeError(f"checkpoint prefix {prefix!r} must be letters, digits, '_', '.' or '-'")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.prefix = prefix
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.safetensors")

    def path_for(self, step: int) -> Path:
        return self.directory / f"{self.prefix}-{step:08d}.safetensors"

    def shard_path(self, step: int, stage: int, stages: int) -> Path:
        """Where pipeline stage ``stage`` (of ``stages``, not 0: it writes ``path_for``) writes its shard."""
        return self.directory / f"{self.prefix}-{step:08d}.stage{stage}-of-{stages}.safetensors"

    def save_shard(self, state: CheckpointState, names: Sequence[str], stage: int, stages: int) -> Path:
        """Write one pipeline stage's tensors ``names`` for ``state.step`` (before stage 0 writes the checkpoint)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return state.save(self.shard_path(int(state.step), stage, stages), names=names)

    def part_path(self, step: int, rank: int, size: int) -> Path:
        """Where ZeRO replica ``rank`` (of ``size``) writes its shard of the optimizer states."""
        return self.directory / f"{self.prefix}-{step:08d}.zero{rank}-of-{size}.safetensors"

    def save_part(
        self, state: CheckpointState, parts: Mapping[str, tuple[np.ndarray, int, tuple[int, ...]]], rank: int, size: int
    ) -> Path:
        """Write one ZeRO replica's pieces of the optimizer states for ``state.step`` (before rank 0 writes the checkpoint)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return state.save(self.part_path(int(state.step), rank, size), names=[], parts=parts)

    def slice_path(self, step: int, rank: int, size: int) -> Path:
        """Where tensor-parallel member ``rank`` (of ``size``) writes its slices."""
        return self.directory / f"{self.prefix}-{step:08d}.tensor{rank}-of-{size}.safetensors"

    def piece_path(self, step: int, stage: int, stages: int, rank: int, size: int) -> Path:
        """Where tensor-parallel member ``rank`` (of ``size``) of pipeline stage ``stage`` (of
        ``stages``) writes its stage's tensors: its slices, and member 0 the whole ones."""
        return self.directory / f"{self.prefix}-{step:08d}.stage{stage}-of-{stages}.tensor{rank}-of-{size}.safetensors"

    def save_slices(self, state: CheckpointState, parts: Mapping[str, tuple], rank: int, size: int) -> Path:
        """Write one tensor-parallel member's slices for ``state.step`` (before member 0 writes the checkpoint)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return state.save(self.slice_path(int(state.step), rank, size), names=[], parts=parts)

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint in the folder, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = self._pattern.fullmatch(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    def load_latest(self, program: ModelSource | Model | None = None) -> CheckpointState | None:
        path = self.latest()
        return None if path is None else CheckpointState.load(path, program)

    def save(self, state: CheckpointState, *, names: Sequence[str] | None = None, shards: Sequence[Path] = ()) -> Path:
        """Write ``state`` for its step (with ``names``/``shards``: the last file of a sharded
        checkpoint, see CheckpointState.save), then delete the oldest beyond ``keep_last``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = state.save(self.path_for(int(state.step)), names=names, shards=[Path(p).name for p in shards])
        if self.keep_last is not None:
            for step, old in self.checkpoints()[: -self.keep_last]:
                if old != path:
                    old.unlink(missing_ok=True)  # the checkpoint first: a shard alone is never taken for one
                    for shard in self.directory.glob(f"{self.prefix}-{step:08d}.*.safetensors"):
                        shard.unlink(missing_ok=True)
        return path
