"""lean_model: the copy of a model a session runs, with fewer nodes, no output copies and no
bound initializers; onnxruntime on the unchanged model is the oracle for the values."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest

from graphforge.errors import GraphforgeError
from graphforge.runtime.sessions import create_session, lean_model

MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x, float[2] w) => (float[2] a, float[2] b, float[2] c, float[2] d, float[2] e) <float[2] w = {1.5, -2.0}> {
    t = Mul(x, w)
    a = Identity(t)
    u = Add(t, x)
    b = Identity(u)
    c = Neg(x)
    d = Identity(x)
    e = Identity(a)
}
"""


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _run(model: onnx.ModelProto, names: list[str], **feeds) -> dict[str, np.ndarray]:
    session = create_session(model, providers=["CPUExecutionProvider"])
    return dict(zip(names, session.run(names, feeds), strict=True))


@pytest.fixture
def model():
    return onnx.parser.parse_model(MODEL)


def test_unfetched_outputs_and_their_nodes_go_and_identities_fold(model):
    lean = lean_model(model, ["a", "b"])
    assert [o.name for o in lean.graph.output] == ["a", "b"]
    assert _ops(lean) == ["Mul", "Add"]  # Neg computed only c; both Identities folded
    assert [list(n.output) for n in lean.graph.node] == [["a"], ["b"]]
    x = np.array([1.0, 2.0], np.float32)
    expected = _run(model, ["a", "b"], x=x)
    got = _run(lean, ["a", "b"], x=x)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])
    assert len(model.graph.node) == 7  # the model itself is untouched


def test_identities_that_must_copy_stay(model):
    lean = lean_model(model)
    # d copies a graph input, e copies another graph output: both stay
    assert _ops(lean).count("Identity") == 2
    x = np.array([3.0, -1.0], np.float32)
    names = ["a", "b", "c", "d", "e"]
    expected, got = _run(model, names, x=x), _run(lean, names, x=x)
    for name in names:
        np.testing.assert_array_equal(got[name], expected[name])


def test_bound_initializers_go_and_other_defaults_stay(model):
    assert [t.name for t in lean_model(model, ["a"]).graph.initializer] == ["w"]
    lean = lean_model(model, ["a"], bound={"w"})
    assert not lean.graph.initializer and [i.name for i in lean.graph.input] == ["x", "w"]
    x, w = np.array([1.0, 2.0], np.float32), np.array([4.0, 5.0], np.float32)
    np.testing.assert_array_equal(_run(lean, ["a"], x=x, w=w)["a"], x * w)


def test_an_unknown_output_is_refused(model):
    with pytest.raises(GraphforgeError, match="no output 'nope'"):
        lean_model(model, ["a", "nope"])
