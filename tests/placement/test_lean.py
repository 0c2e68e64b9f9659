"""lean_model: the copy of a model a session runs, with fewer nodes, no output copies and no
bound initializers; onnxruntime on the unchanged model is the oracle for the values."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest

from graphforge.analysis.memory import execution_order
from graphforge.errors import GraphforgeError
from graphforge.placement.lean import lean_model
from graphforge.runtime.sessions import create_session

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


def _made_in_order(model: onnx.ModelProto) -> list[str]:
    """Each node's first output, in the order onnxruntime runs the nodes."""
    return [model.graph.node[i].output[0] for i in execution_order(model.graph)]


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


def test_the_first_output_is_made_as_soon_as_onnxruntime_can():
    """A training step's loss reads the forward's last activation; made last (onnxruntime's
    default order reaches it from its own node, visited after the backward's), it would keep
    that activation alive through the whole backward."""
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float loss, float[4] grad) {
        big = Exp(x)
        loss = ReduceSum(big)
        scaled = Mul(big, x)
        grad = Neg(scaled)
    }
    """)
    assert _made_in_order(lean_model(model, ["grad", "loss"])) == ["big", "scaled", "grad", "loss"]
    lean = lean_model(model, ["loss", "grad"])
    assert _made_in_order(lean) == ["big", "loss", "scaled", "grad"]
    x = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    expected, got = _run(model, ["loss", "grad"], x=x), _run(lean, ["loss", "grad"], x=x)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])
