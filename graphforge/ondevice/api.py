"""onnxruntime-training's on-device Python API (``onnxruntime.training.api``) over graphforge's
artifacts, on stock onnxruntime: a script written for it runs with its import lines changed.

    from graphforge import artifacts
    from graphforge.ondevice import CheckpointState, Module, Optimizer, LinearLRScheduler

The classes keep onnxruntime-training's names, signatures and semantics: ``module(*inputs)``
runs the training model in train mode (forward, backward, the gradients accumulated until
``lazy_reset_grad()``) and the eval model in eval mode, returning the loss (and the additional
outputs); ``optimizer.step()`` runs the update with the accumulated gradients and counts the
step; ``LinearLRScheduler`` warms the rate up linearly from 0, then decays it linearly to 0,
as onnxruntime-training's does (in float32). The state is the artifact folder's checkpoint,
held as numpy arrays between runs; it is what the manifest beside the models says it is.
This mirrors graphforge's JavaScript runtime (js/): the same files, the same feeds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import numpy_helper

from graphforge.errors import GraphforgeError
from graphforge.model_io import load, save
from graphforge.ondevice.manifest import FROZEN, Manifest, ManifestError, ModelEntry
from graphforge.placement.lean import lean_model
from graphforge.runtime.checkpoint import CheckpointState as _State
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.dropout import run_key
from graphforge.runtime.sessions import create_session


class Parameter:
    """One parameter of a CheckpointState: its values, its accumulated gradient, whether it trains."""

    def __init__(self, state: CheckpointState, name: str):
        self._state, self.name = state, name

    @property
    def data(self) -> np.ndarray:
        return self._state._state.tensors[self.name]

    @data.setter
    def data(self, value: np.ndarray) -> None:
        current = self.data
        value = np.asarray(value)
        if value.shape != current.shape or value.dtype != current.dtype:
            raise GraphforgeError(
                f"parameter {self.name!r} is {current.dtype}{list(current.shape)}, got {value.dtype}{list(value.shape)}"
            )
        self._state._state.tensors[self.name] = value.copy()

    @property
    def grad(self) -> np.ndarray | None:
        gradient = self._state._gradients.get(self.name)
        return None if gradient is None else self._state._state.tensors[gradient]

    @property
    def requires_grad(self) -> bool:
        return self.name in self._state._trainable

    def __repr__(self) -> str:
        return f"Parameter(name={self.name!r}, requires_grad={self.requires_grad})"


class Parameters(Mapping):
    """The parameters of a CheckpointState by name (a read-only mapping of Parameter)."""

    def __init__(self, state: CheckpointState):
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        if name not in self._state._parameters:
            raise KeyError(f"no parameter {name!r}; the checkpoint's: {', '.join(self._state._parameters)}")
        return Parameter(self._state, name)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self[name].data = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._state._parameters)

    def __len__(self) -> int:
        return len(self._state._parameters)


class CheckpointState:
    """The state of a training session: parameters (trainable, and frozen: ``requires_grad``
    false), optimizer states, accumulated gradients and user properties (ints, floats, strings), as graphforge's checkpoint holds them (each tensor
    with its role). ``load_checkpoint`` reads an artifact folder's checkpoint, or any saved since."""

    def __init__(self, state: _State):
        self._state = state
        #: every parameter, trainable or frozen, in the checkpoint's order; the trainable ones
        self._parameters = [s.name for s in state.specs if s.role in ("parameter", FROZEN)]
        self._trainable = [s.name for s in state.specs if s.role == "parameter"]
        #: parameter -> the accumulator of its gradient (a Module's manifest says which)
        self._gradients: dict[str, str] = {}
        self.properties = state.properties

    @classmethod
    def load_checkpoint(cls, checkpoint_uri: str | os.PathLike) -> CheckpointState:
        return cls(_State.load(Path(checkpoint_uri)))

    def _bind(self, manifest: Manifest) -> None:
        """Check the state against the artifacts it trains with; learn which accumulator holds
        each parameter's gradient."""
        missing = [s.name for s in manifest.state if s.name not in self._state.tensors]
        if missing:
            raise ManifestError(
                f"the checkpoint lacks {missing[0]!r}, which the artifacts carry ({len(missing)} missing)"
            )
        self._gradients = {s.like: s.name for s in manifest.state if s.role == "accumulator" and s.like}

    @classmethod
    def save_checkpoint(
        cls, state: CheckpointState, checkpoint_uri: str | os.PathLike, include_optimizer_state: bool = False
    ) -> None:
        """Write ``state`` (atomically). Without ``include_optimizer_state``, the optimizer's
        moments are written as they are anyway: graphforge's checkpoint is the whole state."""
        state._state.save(Path(checkpoint_uri))

    @property
    def parameters(self) -> Parameters:
        return Parameters(self)


class Module:
    """The training and eval models of an artifact folder over a CheckpointState."""

    def __init__(
        self,
        train_model_uri: str | os.PathLike,
        state: CheckpointState,
        eval_model_uri: str | os.PathLike | None = None,
        device: str = "cpu",
        session_options: ort.SessionOptions | None = None,
    ):
        path = Path(train_model_uri)
        self._manifest = _manifest_beside(path, lambda m: m.model("training").file == path.name)
        self._folder, self.state, self.training = path.parent, state, True
        state._bind(self._manifest)
        # resolved now: a device that does not work here is refused before any session is made
        self._providers = resolve_device(device).providers
        self._sessions: dict[str, ort.InferenceSession] = {}
        self._entries = {"training": self._manifest.model("training")}
        if eval_model_uri is not None:
            self._entries["eval"] = self._manifest.model("eval")
            if Path(eval_model_uri).name != self._entries["eval"].file:
                raise ManifestError(f"{eval_model_uri}: the manifest's eval model is {self._entries['eval'].file}")
        self._options = session_options
        self._reset = True  # the first run overwrites the (zero) accumulators
        self._micro_batch = 0
        self._optimizer: Optimizer | None = None
        self._session("training")

    def __call__(self, *user_inputs: np.ndarray):
        key = "training" if self.training else "eval"
        if key not in self._entries:
            raise GraphforgeError("no eval model: give eval_model_uri to Module(...) to evaluate")
        entry = self._entries[key]
        users = [p for p in entry.inputs if p.role in ("batch", "labels")]
        if len(user_inputs) != len(users):
            raise GraphforgeError(
                f"the {key} model takes {len(users)} inputs ({', '.join(p.name for p in users)}), got {len(user_inputs)}"
            )
        feeds = {p.name: np.asarray(v) for p, v in zip(users, user_inputs, strict=True)}
        feeds.update(self._scalars(entry))
        outputs = self._run(key, feeds)
        if self.training:
            self._reset = False
            self._micro_batch += 1
        returned = [outputs[self._manifest.loss], *(outputs[n] for n in self._manifest.outputs)]
        return returned[0] if len(returned) == 1 else tuple(returned)

    def _scalars(self, entry: ModelEntry) -> dict[str, np.ndarray]:
        state = self.state._state
        scalars = {}
        for port in entry.inputs:
            if port.role == "state":
                scalars[port.name] = state.tensors[port.state]
            elif port.role == "reset":
                scalars[port.name] = np.array(self._reset)
            elif port.role == "dropout_key":
                seed = int(self._manifest.dropout["seed"]) if self._manifest.dropout else 0
                scalars[port.name] = run_key(seed, state.step, self._micro_batch)
        return scalars

    def _run(self, key: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run model ``key``: its outputs by name; the carried tensors it writes go to the state."""
        entry = self._manifest.model(key)
        names = [p.name for p in entry.outputs]
        values = dict(zip(names, self._session(key).run(names, feeds), strict=True))
        for port in entry.outputs:
            if port.role == "state":
                self.state._state.tensors[port.state] = values[port.name]
        return values

    def _session(self, key: str) -> ort.InferenceSession:
        if key not in self._sessions:
            path = self._folder / self._manifest.model(key).file
            self._sessions[key] = create_session(path, providers=self._providers, options=self._options)
        return self._sessions[key]

    def train(self, mode: bool = True) -> Module:
        self.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def lazy_reset_grad(self) -> None:
        """The next training run overwrites the accumulated gradients instead of adding to them."""
        self._reset = True

    def _parameter_names(self, trainable_only: bool) -> list[str]:
        return self.state._trainable if trainable_only else self.state._parameters

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        return sum(int(self.state._state.tensors[n].size) for n in self._parameter_names(trainable_only))

    def get_contiguous_parameters(self, trainable_only: bool = False) -> np.ndarray:
        """The parameters in one float32 buffer, in the checkpoint's order: the trainable ones,
        or (``trainable_only=False``, onnxruntime-training's default here) the frozen ones too."""
        tensors = self.state._state.tensors
        return np.concatenate(
            [tensors[n].reshape(-1).astype(np.float32) for n in self._parameter_names(trainable_only)]
        )

    def copy_buffer_to_parameters(self, buffer: np.ndarray, trainable_only: bool = True) -> None:
        buffer = np.asarray(buffer).reshape(-1)
        size = self.get_parameters_size(trainable_only)
        if buffer.size != size:
            raise GraphforgeError(f"the parameters hold {size} elements, the buffer {buffer.size}")
        at, tensors = 0, self.state._state.tensors
        for name in self._parameter_names(trainable_only):
            count = tensors[name].size
            tensors[name] = buffer[at : at + count].reshape(tensors[name].shape).astype(tensors[name].dtype)
            at += count

    def export_model_for_inferencing(
        self, inference_model_uri: str | os.PathLike, graph_output_names: list[str]
    ) -> None:
        """Write the inference model computing ``graph_output_names`` with the current
        parameters (and BatchNorm statistics): the artifacts' inference model, its weights replaced."""
        model = load(self._folder / self._manifest.model("inference").file)
        tensors = self.state._state.tensors
        for tensor in model.graph.initializer:
            if tensor.name in tensors:
                tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(tensors[tensor.name]), tensor.name))
        save(lean_model(model, list(graph_output_names)), Path(inference_model_uri))

    def input_names(self) -> list[str]:
        entry = self._manifest.model("training" if self.training else "eval")
        return [p.name for p in entry.inputs if p.role in ("batch", "labels")]

    def output_names(self) -> list[str]:
        return [self._manifest.loss, *self._manifest.outputs]


class Optimizer:
    """The optimizer model of an artifact folder over a Module's state."""

    def __init__(self, optimizer_model_uri: str | os.PathLike, module: Module):
        entry = module._manifest.model("optimizer")
        if Path(optimizer_model_uri).name != entry.file:
            raise ManifestError(f"{optimizer_model_uri}: the manifest's optimizer model is {entry.file}")
        if module._optimizer is not None:
            raise GraphforgeError("this Module already has an Optimizer")
        module._optimizer = self
        self.module = module
        state = module.state._state
        if state.learning_rate is None:
            state.learning_rate = module._manifest.default_lr
        module._session("optimizer")

    def step(self) -> None:
        module = self.module
        state = module.state._state
        entry = module._manifest.model("optimizer")
        feeds = module._scalars(entry)
        for port in entry.inputs:
            if port.role == "lr":
                feeds[port.name] = np.array(self.get_learning_rate(), np.float32)
            elif port.role == "step":
                feeds[port.name] = np.array(state.step, np.int64)
        module._run("optimizer", feeds)
        state.step = int(state.step) + 1
        module._micro_batch = 0

    def set_learning_rate(self, learning_rate: float) -> None:
        self.module.state._state.learning_rate = float(np.float32(learning_rate))

    def get_learning_rate(self) -> float:
        return float(np.float32(self.module.state._state.learning_rate))


class LinearLRScheduler:
    """The rate ``initial_lr`` × a factor of the optimizer's step count: ``step / warmup`` while
    warming up, then ``(total - step) / (total - warmup)``, at least 0; computed in float32,
    set on the optimizer at construction and at each ``step()``.

    onnxruntime-training's Python class hands ``warmup_step_count`` to its engine as the total
    and ``total_step_count`` as the warm-up (its binding declares them in the other order), so
    a script tuned on it warms up for ``total_step_count`` steps. This class does the same,
    so the script's rates, and losses, are the ones it had; ``as_documented=True`` takes the
    counts as their names say."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_step_count: int,
        total_step_count: int,
        initial_lr: float,
        *,
        as_documented: bool = False,
    ):
        counts = (warmup_step_count, total_step_count) if as_documented else (total_step_count, warmup_step_count)
        self.optimizer = optimizer
        self.warmup, self.total = int(counts[0]), int(counts[1])
        self.initial_lr = np.float32(initial_lr)
        self.step()

    def step(self) -> None:
        done = int(self.optimizer.module.state._state.step)
        if done < self.warmup:
            factor = np.float32(done) / np.float32(max(1, self.warmup))
        else:
            factor = max(np.float32(0), np.float32(self.total - done) / np.float32(max(1, self.total - self.warmup)))
        self.optimizer.set_learning_rate(float(self.initial_lr * np.float32(factor)))


def _manifest_beside(path: Path, chooses) -> Manifest:
    """The manifest in ``path``'s folder that names it (a folder may hold prefixed sets)."""
    found = sorted(path.parent.glob("*manifest.json"))
    for candidate in found:
        prefix = candidate.name[: -len("manifest.json")]
        manifest = Manifest.read(path.parent, prefix, verify=False)
        if chooses(manifest):
            return Manifest.read(path.parent, prefix)
    raise ManifestError(f"{path}: no manifest.json beside it names it (write the artifacts with graphforge)")


__all__ = ["CheckpointState", "LinearLRScheduler", "Module", "Optimizer", "Parameter", "Parameters"]
