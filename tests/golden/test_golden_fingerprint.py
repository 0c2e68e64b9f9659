"""The structural fingerprint: blind to names and floating-point values, sensitive to op types,
attributes, integer constants, wiring and the I/O signature; and the deterministic .npz."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest

from graphforge.golden.fingerprint import fingerprint, op_histogram
from graphforge.golden.layout import npz_bytes
from graphforge.ir import FLOAT_TYPES

BASE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x, float[N, 4] y) => (float[N, 2] out)
<float[4, 2] w = {1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0}, int64[2] shape = {-1, 2}>
{
    d = Sub(x, y)
    t = Transpose <perm = [1, 0]> (d)
    u = Transpose <perm = [1, 0]> (t)
    m = MatMul(u, w)
    out = Reshape(m, shape)
}
"""


def _model(text: str = BASE) -> onnx.ModelProto:
    return onnx.parser.parse_model(text)


RENAMED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x, float[N, 4] y) => (float[N, 2] out)
<float[4, 2] weights = {1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0}, int64[2] target = {-1, 2}>
{
    difference = Sub(x, y)
    flipped = Transpose <perm = [1, 0]> (difference)
    back = Transpose <perm = [1, 0]> (flipped)
    product = MatMul(back, weights)
    out = Reshape(product, target)
}
"""


def test_internal_names_do_not_count():
    assert fingerprint(_model(RENAMED)) == fingerprint(_model())


def test_float_values_do_not_count():
    assert fingerprint(_model(BASE.replace("1.0, 2.0", "1.5, 2.5"))) == fingerprint(_model())


@pytest.mark.parametrize(
    "change",
    [
        ("Sub(x, y)", "Sub(y, x)"),  # wiring: operands swapped
        ("Sub(x, y)", "Add(x, y)"),  # op type
        ("<perm = [1, 0]> (t)", "<perm = [0, 1]> (t)"),  # attribute
        ("{-1, 2}", "{2, -1}"),  # integer constant
        ("float[N, 2] out", "float[N, 3] out"),  # output signature
        ("float[N, 4] x,", "float[5, 4] x,"),  # a dynamic dim made static
    ],
)
def test_structure_counts(change):
    old, new = change
    assert fingerprint(_model(BASE.replace(old, new))) != fingerprint(_model())


def test_fingerprint_format_and_histogram():
    model = _model()
    assert fingerprint(model).startswith("wl1:")
    assert op_histogram(model) == {"MatMul": 1, "Reshape": 1, "Sub": 1, "Transpose": 2}


def test_npz_bytes_are_deterministic_and_readable():
    arrays = {"run/0/loss": np.array(1.5, np.float32), "run/0/w_grad": np.arange(6, dtype=np.float32).reshape(2, 3)}
    first = npz_bytes(arrays)
    assert npz_bytes(arrays) == first
    with np.load(io.BytesIO(first)) as loaded:
        assert loaded["run/0/loss"].shape == ()
        np.testing.assert_array_equal(loaded["run/0/w_grad"], arrays["run/0/w_grad"])


def _one_initializer(data_type: int, payload: bytes) -> onnx.ModelProto:
    tensor = onnx.TensorProto(name="w", data_type=data_type, dims=[len(payload) * 8 // _BITS.get(data_type, 8)])
    tensor.raw_data = payload
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["w"], ["y"])], "g", [], [onnx.ValueInfoProto(name="y")], [tensor]
    )
    return onnx.helper.make_model(graph)


_BITS = {onnx.TensorProto.FLOAT: 32, onnx.TensorProto.DOUBLE: 64, onnx.TensorProto.FLOAT16: 16,
         onnx.TensorProto.BFLOAT16: 16, onnx.TensorProto.INT64: 64}  # fmt: skip


@pytest.mark.parametrize("name", sorted(onnx.TensorProto.DataType.keys()))
def test_weights_of_every_float_type_are_left_out_of_the_fingerprint(name):
    """Floating-point initializers are weights: their values never change a fingerprint, in
    every float type onnx knows (a copy of the type list once left FLOAT8E8M0 out, so E8M0
    weights changed fingerprints); other types' values (shapes, indices) do."""
    data_type = getattr(onnx.TensorProto, name)
    if data_type in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING):
        return
    is_float = name.startswith(("FLOAT", "BFLOAT", "DOUBLE"))
    assert (data_type in FLOAT_TYPES) == is_float, name
    a, b = _one_initializer(data_type, bytes(8)), _one_initializer(data_type, bytes(range(1, 9)))
    assert (fingerprint(a) == fingerprint(b)) == is_float, name
