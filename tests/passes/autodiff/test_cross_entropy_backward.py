"""The cross-entropy backward: ``loss(kind=cross_entropy)`` then ``autodiff`` gives the
gradient w.r.t. the logits that torch autograd gives, in the fused form (Exp, Mul, a
scatter-add, plus an Add under label smoothing) rather than the six passes over the
logits that NLL's dense gradient followed by the LogSoftmax rule would make."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphforge
from graphforge import roles

torch = pytest.importorskip("torch")

IGNORE = -100


def _model(shape, elem=TensorProto.FLOAT) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", elem, shape)
    logits = helper.make_tensor_value_info("logits", elem, shape)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["logits"], name="id")], "ce", [x], [logits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _compile(shape, reduction="mean", smoothing=0.0, elem=TensorProto.FLOAT) -> onnx.ModelProto:
    pipeline = (
        f"loss(kind=cross_entropy, output=logits, reduction={reduction}, ignore_index={IGNORE}, "
        f"label_smoothing={smoothing}), autodiff(inputs=[x])"
    )
    return graphforge.compile(_model(shape, elem), pipeline).model


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(shape) * 3).astype(dtype)
    labels_shape = (shape[0], *shape[2:])
    labels = rng.integers(0, shape[1], labels_shape).astype(np.int64)
    labels.reshape(-1)[::3] = IGNORE  # some positions ignored
    return logits, labels


CASES = [
    pytest.param(shape, reduction, smoothing, id=f"{'x'.join(map(str, shape))}-{reduction}-ls{smoothing}")
    for shape in [(6, 11), (4, 7, 5)]
    for reduction in ["mean", "sum"]
    for smoothing in [0.0, 0.1]
]


@pytest.mark.parametrize(("shape", "reduction", "smoothing"), CASES)
@pytest.mark.parametrize(
    ("elem", "dtype", "rtol"), [(TensorProto.FLOAT, np.float32, 1e-4), (TensorProto.DOUBLE, np.float64, 1e-5)]
)
def test_gradient_matches_torch(shape, reduction, smoothing, elem, dtype, rtol):
    symbolic = ["batch", shape[1], *(f"d{i}" for i in range(len(shape) - 2))]
    model = _compile(symbolic, reduction, smoothing, elem)
    session = graphforge.create_session(model, providers=["CPUExecutionProvider"])
    grad_name = json.loads({p.key: p.value for p in model.metadata_props}[roles.GRADIENTS])["x"]
    for seed, batch in enumerate((shape[0], shape[0] + 3)):
        logits, labels = _data((batch, *shape[1:]), dtype, seed)
        loss, grad = session.run(["loss", grad_name], {"x": logits, "labels": labels})
        t = torch.from_numpy(logits).requires_grad_()
        expected = torch.nn.functional.cross_entropy(
            t, torch.from_numpy(labels), ignore_index=IGNORE, reduction=reduction, label_smoothing=smoothing
        )
        expected.backward()
        np.testing.assert_allclose(loss, expected.item(), rtol=rtol, atol=rtol * 1e-2)
        np.testing.assert_allclose(grad, t.grad.numpy(), rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize(("shape", "reduction", "smoothing"), CASES)
def test_backward_makes_few_passes_over_the_logits(shape, reduction, smoothing):
    model = onnx.shape_inference.infer_shapes(_compile(list(shape), reduction, smoothing), strict_mode=True)
    shapes = {
        v.name: tuple(d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim)
        for v in [*model.graph.value_info, *model.graph.output]
        if v.type.tensor_type.HasField("shape")
    }
    backward = [n for n in model.graph.node if n.name.startswith("grad::")]
    assert backward
    logits_sized = [n.op_type for n in backward if any(shapes.get(o) == tuple(shape) for o in n.output)]
    assert len(logits_sized) <= 4, logits_sized
    assert "ScatterElements" in logits_sized
