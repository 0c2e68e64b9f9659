"""Training programs compiled from PyTorch exports, for the prune and inference tests.

Each case is a torch module exported in *training* mode (Dropout and BatchNormalization
keep their training behaviour in the graph) and compiled with
``loss, autodiff, adamw``. The module is kept after the export (a training-mode export
runs the module once, so BatchNorm's running statistics in the file are the module's
current ones); put in ``eval()`` mode it is the oracle for every inference model.
Exports are made in memory, once per test process.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import models
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import graphforge

torch = pytest.importorskip("torch")

OPSET = 17
MLP_SIZES = (16, 32, 32, 4)
CNN_CLASSES = 5


@dataclass(frozen=True)
class Case:
    """One exported model, its training program and how to feed and judge it."""

    name: str
    module: torch.nn.Module  # eval mode: the oracle
    forward: onnx.ModelProto  # the export, as torch wrote it
    program: onnx.ModelProto  # loss, autodiff, adamw
    input_name: str
    make_input: Callable[[int, int], np.ndarray]  # (batch, seed) -> input
    make_labels: Callable[[np.ndarray, int], np.ndarray]  # (logits, seed) -> labels
    torch_loss: Callable  # (logits, labels) -> loss tensor, the one the program was compiled with
    atol: float = 1e-6

    def torch_logits(self, x: np.ndarray, state: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """The module's eval-mode output, with ``state`` (torch state_dict names) replacing
        its parameters and buffers when given."""
        module = self.module
        if state:
            module = _with_state(module, state)
        with torch.no_grad():
            return module(torch.from_numpy(x)).numpy()

    def torch_eval_loss(self, x, labels, state=None) -> float:
        logits = torch.from_numpy(self.torch_logits(x, state))
        return float(self.torch_loss(logits, torch.from_numpy(labels)))


def _with_state(module: torch.nn.Module, state: dict[str, np.ndarray]) -> torch.nn.Module:
    """A copy of ``module`` with the parameters and buffers named in ``state`` replaced
    (in place, so a tied weight changes under both its names)."""
    import copy

    clone = copy.deepcopy(module)
    tensors = {**dict(clone.named_parameters(remove_duplicate=False)), **dict(clone.named_buffers())}
    missing = sorted(set(state) - set(tensors))
    assert not missing, f"not torch parameter or buffer names: {missing}"
    with torch.no_grad():
        for name, value in state.items():
            tensors[name].copy_(torch.from_numpy(np.array(value)))
    return clone.eval()


def _export(module, example, input_name: str, dynamic: dict[int, str]) -> onnx.ModelProto:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript exporter deprecation and tracer warnings
        torch.onnx.export(
            module.train(),
            (example,),
            buffer,
            dynamo=False,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,  # Dropout and BatchNorm stay in training mode
            opset_version=OPSET,
            input_names=[input_name],
            output_names=["logits"],
            dynamic_axes={input_name: dynamic, "logits": dynamic},
        )
    return onnx.load_from_string(buffer.getvalue())


def _compile(forward: onnx.ModelProto, loss: str) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BatchNorm's running statistics get no gradient
        return graphforge.compile(forward, f"{loss}, autodiff, adamw(lr=1e-3)").model


def _class_labels(classes_axis: int = 1):
    def make(logits: np.ndarray, seed: int) -> np.ndarray:
        shape = [logits.shape[0], *logits.shape[classes_axis + 1 :]]
        return np.random.default_rng(seed).integers(0, logits.shape[classes_axis], shape).astype(np.int64)

    return make


def _normal(*shape_tail: int):
    def make(batch: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal((batch, *shape_tail)).astype(np.float32)

    return make


@functools.cache
def mlp_with_dropout() -> Case:
    """16-32-32-4 ReLU MLP with a Dropout(0.3) after each hidden layer."""
    torch.manual_seed(0)
    n_in, h1, h2, n_out = MLP_SIZES
    module = torch.nn.Sequential(
        torch.nn.Linear(n_in, h1),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(h1, h2),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(h2, n_out),
    )
    models._jitter_vectors(module, 0)
    forward = _export(module, torch.zeros(2, n_in), "x", {0: "batch"})
    program = _compile(forward, "loss(kind=cross_entropy, output=logits)")
    return Case(
        "mlp_dropout",
        module.eval(),
        forward,
        program,
        "x",
        _normal(n_in),
        _class_labels(),
        torch.nn.functional.cross_entropy,
    )


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 4 * 4, CNN_CLASSES)

    def forward(self, x):
        h = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(torch.flatten(h, 1))


@functools.cache
def cnn_with_batchnorm() -> Case:
    """Conv - BatchNorm (training mode, non-trivial running statistics) - ReLU - MaxPool - Linear."""
    torch.manual_seed(0)
    module = SmallCNN()
    models._jitter_vectors(module, 0)
    with torch.no_grad():
        module.bn.running_mean.uniform_(-0.5, 0.5)
        module.bn.running_var.uniform_(0.5, 1.5)
    example = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    forward = _export(module, example, "x", {0: "batch"})
    program = _compile(forward, "loss(kind=cross_entropy, output=logits)")
    return Case(
        "cnn_batchnorm",
        module.eval(),
        forward,
        program,
        "x",
        _normal(3, 8, 8),
        _class_labels(),
        torch.nn.functional.cross_entropy,
    )


@functools.cache
def gpt2_with_dropout() -> Case:
    """The 1-layer GPT-2 of tests/models.py (embedding, attention and residual dropouts 0.1)."""
    module = models.gpt2_module(0)
    vocab = models.GPT2_CONFIG["vocab_size"]
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    forward = _export(module, ids, "input_ids", {0: "batch", 1: "seq"})
    program = _compile(forward, "loss(kind=mse, output=logits)")

    def make_ids(batch: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, vocab, (batch, 3 + batch)).astype(np.int64)

    def make_targets(logits: np.ndarray, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(logits.shape).astype(np.float32)

    return Case(
        "gpt2_dropout",
        module.eval(),
        forward,
        program,
        "input_ids",
        make_ids,
        make_targets,
        torch.nn.functional.mse_loss,
        atol=1e-5,
    )


CASES = {"mlp_dropout": mlp_with_dropout, "cnn_batchnorm": cnn_with_batchnorm, "gpt2_dropout": gpt2_with_dropout}


# --------------------------------------------------------------------------- running and inspecting


def plain_session(model: onnx.ModelProto, *, optimized: bool = False) -> ort.InferenceSession:
    """A stock onnxruntime CPU session, nothing of graphforge's in between.

    Graph optimizations are off unless asked for: onnxruntime's own rewrites delete a
    Dropout whose mask nobody reads even in training mode, which would hide a Dropout the
    prune pass left in training mode."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def dim_params(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def dropout_in_training_mode(model: onnx.ModelProto) -> list[str]:
    """Dropout nodes whose training_mode input is given and not a constant false."""
    constants = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            value = next((a for a in node.attribute if a.name == "value"), None)
            if value is not None:
                constants[node.output[0]] = onnx.numpy_helper.to_array(value.t)
    found = []
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            value = constants.get(node.input[2])
            if value is None or bool(value.reshape(-1)[0]):
                found.append(node.name)
    return found


def batch_norm_in_training_mode(model: onnx.ModelProto) -> list[str]:
    found = []
    for node in model.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        training = any(a.name == "training_mode" and a.i for a in node.attribute)
        if training or len([o for o in node.output if o]) > 1:
            found.append(node.name)
    return found
