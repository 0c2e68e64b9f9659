"""The manifest of an artifact folder: everything a runtime in any language needs to train
with it, so that none reads ONNX metadata (onnxruntime's JavaScript API shows a session's
input and output names, types and shapes, not ``metadata_props``).

``manifest.json`` (schema ``FORMAT`` version ``VERSION``, docs/ondevice-manifest.md) lists
each model's file, sha256, and its inputs and outputs in order, each with a dtype, a shape (a
number per fixed dim, the dim's name or null per symbolic one) and a role:

- inputs: ``batch`` (a model input), ``labels``, ``state`` (a carried tensor, read from the
  checkpoint's tensor named in ``state``), ``reset`` (the lazy-reset flag: true overwrites
  the accumulated gradients), ``dropout_key`` (uint32[2], from ``dropout``), ``lr``, ``step``
  (int64: optimizer steps done before this one), ``gradient`` (what the training model
  handed the optimizer model, where the program does not accumulate);
- outputs: ``loss``, ``output`` (a forward output), ``state`` (the new value of the carried
  tensor named in ``state``), ``gradient``, ``report`` (the gradient norm, whether the update
  was skipped, the step after it).

Beside them: the carried tensors (``state``: name, role, dtype, shape, the parameter each
state belongs to; the role ``frozen`` for a parameter the models read and never update), the optimizer and its hyperparameters, the default learning rate, whether
the training model accumulates, the checkpoint's file and sha256, and graphforge's version.
A reader refuses a newer schema version, and a file whose sha256 is not the manifest's (a
checkpoint whose tensor is damaged, naming the tensor: its CRC-32 says which).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from graphforge.digests import sha256_file
from graphforge.errors import CheckpointError, GraphforgeError
from graphforge.runtime.checkpoint import CheckpointState
from graphforge.tempfiles import write_atomically

FORMAT = "graphforge.ondevice"
#: 2: the models may include ``train_steps`` (k steps in one run); a version-1 folder reads as before
VERSION = 2
MANIFEST = "manifest.json"
#: the models of an artifact folder, by key, and the file each is written to (after the prefix)
FILES = {
    "training": "training_model.onnx",
    "eval": "eval_model.onnx",
    "optimizer": "optimizer_model.onnx",
    "train_step": "train_step.onnx",
    "train_steps": "train_steps.onnx",
    "inference": "inference.onnx",
}
CHECKPOINT = "checkpoint"
#: the role, in ``state``, of a parameter the models read and never update (a frozen base's)
FROZEN = "frozen"
INPUT_ROLES = ("batch", "labels", "state", "reset", "dropout_key", "lr", "step", "gradient")
OUTPUT_ROLES = ("loss", "output", "state", "gradient", "report")


class ManifestError(GraphforgeError):
    """An artifact folder that cannot be trained with: one line naming the file and what is wrong."""


@dataclass(frozen=True)
class Port:
    """One input or output of a model: its name, dtype, shape and role (and, for a carried
    tensor, the checkpoint tensor it reads or replaces)."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...] | None
    role: str
    state: str | None = None

    def to_json(self) -> dict:
        entry = {"name": self.name, "dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}
        entry["role"] = self.role
        if self.state is not None:
            entry["state"] = self.state
        return entry

    @classmethod
    def from_json(cls, entry: dict) -> Port:
        shape = entry.get("shape")
        return cls(
            entry["name"], entry["dtype"], None if shape is None else tuple(shape), entry["role"], entry.get("state")
        )


@dataclass(frozen=True)
class ModelEntry:
    file: str
    sha256: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "sha256": self.sha256,
            "inputs": [p.to_json() for p in self.inputs],
            "outputs": [p.to_json() for p in self.outputs],
        }

    @classmethod
    def from_json(cls, entry: dict) -> ModelEntry:
        return cls(
            entry["file"],
            entry["sha256"],
            tuple(Port.from_json(p) for p in entry["inputs"]),
            tuple(Port.from_json(p) for p in entry["outputs"]),
        )

    def names(self, role: str, *, outputs: bool = False) -> list[str]:
        return [p.name for p in (self.outputs if outputs else self.inputs) if p.role == role]


@dataclass(frozen=True)
class StateEntry:
    """One carried tensor, as the checkpoint holds it."""

    name: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    like: str | None = None


@dataclass
class Manifest:
    models: dict[str, ModelEntry]
    state: list[StateEntry]
    checkpoint: str
    checkpoint_sha256: str
    optimizer: str | None
    hyperparameters: dict[str, Any]
    default_lr: float | None
    accumulates: bool
    loss: str
    labels: str | None
    #: the training model's other outputs (what additional_output_names asked for)
    outputs: list[str] = field(default_factory=list)
    #: where the dropout masks come from: {"input", "seed", "key"} (key "splitmix64": run_key), or None
    dropout: dict | None = None
    graphforge: str = ""
    version: int = VERSION

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": self.version,
            "graphforge": self.graphforge,
            "optimizer": {"kind": self.optimizer, "hyperparameters": self.hyperparameters},
            "default_lr": self.default_lr,
            "accumulates": self.accumulates,
            "loss": self.loss,
            "labels": self.labels,
            "outputs": list(self.outputs),
            "dropout": self.dropout,
            "checkpoint": {"file": self.checkpoint, "sha256": self.checkpoint_sha256},
            "state": [{k: (list(v) if k == "shape" else v) for k, v in asdict(s).items()} for s in self.state],
            "models": {key: entry.to_json() for key, entry in self.models.items()},
        }

    @classmethod
    def from_json(cls, document: dict, where: str = MANIFEST) -> Manifest:
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ManifestError(f"{where}: not a graphforge artifact manifest (its format is not {FORMAT!r})")
        version = document.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise ManifestError(
                f"{where}: manifest version {version!r} is newer than this graphforge reads ({VERSION}): "
                "upgrade graphforge, or write the artifacts with this one"
            )
        try:
            optimizer = document["optimizer"]
            return cls(
                models={key: ModelEntry.from_json(entry) for key, entry in document["models"].items()},
                state=[
                    StateEntry(s["name"], s["role"], s["dtype"], tuple(s["shape"]), s.get("like"))
                    for s in document["state"]
                ],
                checkpoint=document["checkpoint"]["file"],
                checkpoint_sha256=document["checkpoint"]["sha256"],
                optimizer=optimizer["kind"],
                hyperparameters=dict(optimizer["hyperparameters"]),
                default_lr=document["default_lr"],
                accumulates=bool(document["accumulates"]),
                loss=document["loss"],
                labels=document["labels"],
                outputs=list(document.get("outputs", [])),
                dropout=document.get("dropout"),
                graphforge=document.get("graphforge", ""),
                version=version,
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"{where}: the manifest lacks {exc} (or it is of the wrong type)") from None

    def write(self, folder: Path, prefix: str = "") -> Path:
        path = folder / f"{prefix}{MANIFEST}"
        write_atomically(path, (json.dumps(self.to_json(), indent=2) + "\n").encode())
        return path

    @classmethod
    def read(cls, folder: Path, prefix: str = "", *, verify: bool = True) -> Manifest:
        """The manifest of ``folder``; with ``verify``, every file it names checked against its sha256."""
        path = folder / f"{prefix}{MANIFEST}"
        if not path.is_file():
            raise ManifestError(f"{path}: no such file (an artifact folder holds {MANIFEST} beside its models)")
        try:
            document = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{path}: cannot read it as JSON ({exc})") from None
        manifest = cls.from_json(document, str(path))
        if verify:
            files = [(e.file, e.sha256) for e in manifest.models.values()] + [
                (manifest.checkpoint, manifest.checkpoint_sha256)
            ]
            for name, digest in files:
                check_file(folder / name, digest, checkpoint=name == manifest.checkpoint)
        return manifest

    def model(self, key: str) -> ModelEntry:
        entry = self.models.get(key)
        if entry is None:
            raise ManifestError(f"the artifacts have no {key} model (they hold: {', '.join(self.models)})")
        return entry


def check_file(path: Path, expected: str, *, checkpoint: bool = False) -> None:
    """Refuse ``path`` unless it is there with the sha256 ``expected``. A ``checkpoint`` that
    differs is read first: a damaged tensor is named by its CRC-32, not the file by its hash."""
    if not path.is_file():
        raise ManifestError(f"{path}: no such file (the manifest names it)")
    got = sha256_file(path)
    if got != expected:
        if checkpoint:
            try:
                CheckpointState.load(path)  # a tensor whose bytes changed is named by its CRC-32
            except CheckpointError as exc:
                raise ManifestError(str(exc)) from None
        raise ManifestError(
            f"{path}: its sha256 is {got[:16]}…, the manifest's {expected[:16]}… (a file changed since it was written)"
        )


def ports(values: Iterable[onnx.ValueInfoProto], role_of) -> tuple[Port, ...]:
    """The ports of a model's inputs or outputs; ``role_of(name)`` gives (role, state)."""
    out = []
    for value in values:
        tensor = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        shape = None
        if tensor.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
        role, state = role_of(value.name)
        out.append(Port(value.name, dtype, shape, role, state))
    return tuple(out)
