"""A language model's tied embedding: the table is read by a Gather (the token lookup) and,
transposed, by the output head's MatMul, as exporters write ``nn.Linear`` on a batch of
sequences (``MatMul(h, Transpose(W))``, the Transpose kept when constant folding is off,
as training exports need).

The table's gradient must cost one table-sized tensor, as torch's ``.grad`` does: the
head's part made directly in the table's layout (not a product transposed afterwards),
the lookup's part scattered into it (not into a zero-filled table that is then summed),
and the head's backward reading the table itself (not a transpose of its transpose). Checked
against numpy at two batch sizes, and on the compiled graph's backward nodes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphforge.passes import Autodiff
from onnx import helper, numpy_helper

import graphforge
from graphforge import roles

VOCAB, WIDTH = 11, 4


def _model() -> onnx.ModelProto:
    """loss = 0.5 * sum(Y²), Y = MatMul(tanh(W[ids]), Transpose(W)), ids [B, S] symbolic."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((VOCAB, WIDTH)).astype(np.float32), "W")
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    nodes = [
        helper.make_node("Gather", ["W", "ids"], ["x"], name="embed"),
        helper.make_node("Tanh", ["x"], ["h"], name="act"),
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0], name="head/Transpose"),
        helper.make_node("MatMul", ["h", "Wt"], ["Y"], name="head/MatMul"),
        helper.make_node("Mul", ["Y", "Y"], ["Y2"]),
        helper.make_node("ReduceSum", ["Y2"], ["S"], keepdims=0),
        helper.make_node("Mul", ["S", "half"], ["loss"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["B", "S"])],
        [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
        [table, half],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _expected(w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    h = np.tanh(w[ids])  # [B, S, K]
    y = h @ w.T  # dY = Y
    head = y.reshape(-1, VOCAB).T @ h.reshape(-1, WIDTH)
    dx = (y @ w) * (1 - h**2)
    lookup = np.zeros_like(w)
    np.add.at(lookup, ids.reshape(-1), dx.reshape(-1, WIDTH))
    return head + lookup


@pytest.fixture(scope="module")
def compiled() -> onnx.ModelProto:
    return graphforge.compile(_model(), [Autodiff()]).model


def test_the_tied_table_gradient_equals_numpy(compiled):
    w = numpy_helper.to_array(next(t for t in compiled.graph.initializer if t.name == "W")).astype(np.float64)
    session = graphforge.create_session(compiled, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch, seq in [(2, 3), (3, 5)]:
        ids = rng.integers(0, VOCAB, (batch, seq))
        ids[0, :2] = 7  # a row looked up more than once
        (grad,) = session.run(["W_grad"], {"ids": ids})
        np.testing.assert_allclose(grad, _expected(w, ids), rtol=1e-4, atol=1e-4)


def test_the_tied_table_gradient_costs_one_table(compiled):
    backward = [n for n in compiled.graph.node if (roles.node_origin(n.name) or ("",))[0] == "grad"]
    producer = {o: n for n in backward for o in n.output}
    assert "ConstantOfShape" not in [n.op_type for n in backward], "no zero-filled table"
    assert not [n for n in backward if n.op_type == "Transpose"], "the backward transposes no table or product"
    assert [n for n in backward if n.op_type == "MatMul" and "W" in n.input], "the head's backward reads W itself"
    scatter = producer["W_grad"]  # the lookup's part scattered into the head's
    assert scatter.op_type == "ScatterElements" and helper.get_node_attr_value(scatter, "reduction") == b"add"
    head = producer[scatter.input[0]]
    assert head.op_type == "Gemm" and {a.name: a.i for a in head.attribute} == {"transA": 1}
