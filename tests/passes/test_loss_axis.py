"""``loss(axis=-1)``: cross-entropy and nll over scores whose classes lie on the last axis, as
transformers' causal LMs export their logits ([batch, seq, vocab]), against torch's
cross_entropy and nll_loss on the same scores moved to torch's layout: the value and the
gradient with respect to the scores, ignore_index, label smoothing, both reductions, symbolic
dims and two shapes through one compiled graph. No transpose of the scores is emitted."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphforge
from graphforge.errors import GraphforgeError

torch = pytest.importorskip("torch")
F = torch.nn.functional
VOCAB = 7


def _scores_model() -> onnx.ModelProto:
    shape = ["batch", "seq", VOCAB]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["logits"])],
        "scores",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("kind", "smoothing"), [("cross_entropy", 0.0), ("cross_entropy", 0.1), ("nll", 0.0)])
def test_classes_last_match_torch(kind, smoothing, reduction):
    text = f"loss(kind={kind}, output=logits, axis=-1, reduction={reduction}"
    text += f", label_smoothing={smoothing})" if smoothing else ")"
    program = graphforge.compile(_scores_model(), f"{text}, autodiff(inputs=[x])").model
    assert not [n for n in program.graph.node if n.op_type == "Transpose"]
    names = [i.name for i in program.graph.input]
    assert names == ["x", "labels"], names
    labels_dims = [d.dim_param or d.dim_value for d in program.graph.input[1].type.tensor_type.shape.dim]
    assert labels_dims == ["batch", "seq"]
    session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch, seq in [(2, 5), (3, 1)]:
        x = rng.standard_normal((batch, seq, VOCAB)).astype(np.float32)
        if kind == "nll":
            x = np.log(np.exp(x) / np.exp(x).sum(-1, keepdims=True)).astype(np.float32)
        labels = rng.integers(0, VOCAB, (batch, seq))
        labels[0, 0] = -100  # ignored
        loss, grad = session.run(["loss", "x_grad"], {"x": x, "labels": labels})
        t = torch.tensor(x, requires_grad=True)
        flat, target = t.reshape(-1, VOCAB), torch.tensor(labels).reshape(-1)
        if kind == "cross_entropy":
            expected = F.cross_entropy(flat, target, reduction=reduction, label_smoothing=smoothing)
        else:
            expected = F.nll_loss(flat, target, reduction=reduction)
        expected.backward()
        np.testing.assert_allclose(loss, expected.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_axis_is_refused_where_there_are_no_classes():
    with pytest.raises(GraphforgeError, match="axis applies to kind=cross_entropy and kind=nll only"):
        graphforge.compile(_scores_model(), "loss(kind=mse, output=logits, axis=-1)")
    with pytest.raises(GraphforgeError, match="axis"):
        graphforge.compile(_scores_model(), "loss(kind=cross_entropy, output=logits, axis=2)")
