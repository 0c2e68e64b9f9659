"""Small models and helpers shared by the model I/O, verification and session tests."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

#: a model as onnx 1.23 writes it by default (IR 14, ai.onnx opset 28): newer than onnxruntime 1.31 reads
RELU_TEXT = """
<ir_version: 14, opset_import: ["" : 28], producer_name: "graphforge-tests">
relu (float[N, 3] x) => (float[N, 3] y) {
    y = Relu(x)
}
"""

#: 512 weights in the text form: the parser keeps them in float_data, not raw_data
BIAS_TEXT = (
    '<ir_version: 14, opset_import: ["" : 28]>\n'
    "bias (float[N, 512] x) => (float[N, 512] y)\n"
    "<float[512] b = {" + ", ".join(str(i / 8) for i in range(512)) + "}>\n"
    "{\n    y = Add(x, b)\n}\n"
)


def relu_model() -> onnx.ModelProto:
    return onnx.parser.parse_model(RELU_TEXT)


def bias_model() -> onnx.ModelProto:
    return onnx.parser.parse_model(BIAS_TEXT)


def bias_values() -> np.ndarray:
    return (np.arange(512) / 8).astype(np.float32)


def affine_model(
    seed: int = 0, *, n_in: int = 64, n_out: int = 32, opset: int | None = None
) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """y = x @ W + b with W (n_in × n_out, 8 KiB by default) and b stored as raw_data initializers."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_in, n_out)).astype(np.float32)
    b = rng.standard_normal((n_out,)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["t"], name="matmul"), helper.make_node("Add", ["t", "b"], ["y"])],
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", n_out])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    kwargs = {} if opset is None else {"opset_imports": [helper.make_opsetid("", opset)]}
    return helper.make_model(graph, **kwargs), w, b


def inputs(seed: int = 1, shape: tuple[int, ...] = (3, 64)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def ort_run(source, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a model file or serialized model with plain onnxruntime on the CPU: the oracle for
    "onnxruntime reads what graphforge wrote", independent of graphforge's own session code."""
    if isinstance(source, onnx.ModelProto):
        source = source.SerializeToString()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(
        str(source) if not isinstance(source, bytes) else source, options, ["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def ort_loads(model: onnx.ModelProto) -> bool:
    """Whether plain onnxruntime builds a CPU session for ``model``: the oracle for
    ``runtime_limits``, so written apart from graphforge's own probe (ort_compat._runtime_loads)."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True


def set_location(model: onnx.ModelProto, location: str) -> onnx.ModelProto:
    """A copy of ``model`` whose external tensors all point at ``location``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in out.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    return out
