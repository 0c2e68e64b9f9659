"""Rules read axes, pads, scales and shapes as constants; exporters compute them from
constants (Reshape(Constant, Constant), Shape of a static tensor): GradContext.const_value
evaluates such small constant-only subgraphs, and refuses anything that depends on an input."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

import graphforge
import graphforge.constants
from graphforge.constants import constant_value

COMPUTED_AXES = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[N, 3] x) => (float loss)
<float[3, 4] w = {1.,2.,3.,4.,5.,6.,7.,8.,9.,10.,11.,12.}>
{
    h = MatMul(x, w)
    a = Constant <value_ints = [1]> ()
    s = Constant <value_ints = [1]> ()
    axes = Reshape(a, s)
    m = ReduceMean <keepdims = 1> (h, axes)
    e = Exp(m)
    rank = Size(shape_h)
    shape_h = Shape(h)
    last = Sub(rank, one)
    one = Constant <value_int = 1> ()
    last_1d = Unsqueeze(last, zero)
    zero = Constant <value_ints = [0]> ()
    r = ReduceSum <keepdims = 0> (e, last_1d)
    loss = ReduceSum <keepdims = 0> (r)
}
"""


def _sorted(text: str) -> onnx.ModelProto:
    graph = gs.import_onnx(onnx.parser.parse_model(text))
    graph.toposort()
    return onnx.shape_inference.infer_shapes(gs.export_onnx(graph))


def test_computed_axes_are_constants():
    tensors = gs.import_onnx(_sorted(COMPUTED_AXES)).tensors()
    assert constant_value(tensors["axes"], 18).tolist() == [1]
    assert constant_value(tensors["last_1d"], 18).tolist() == [1]  # Size(Shape(h)) with h of known rank
    assert constant_value(tensors["shape_h"], 18) is None  # N is symbolic
    assert constant_value(tensors["h"], 18) is None  # depends on the input


def test_gradient_through_reductions_with_computed_axes():
    program = graphforge.compile(_sorted(COMPUTED_AXES), "autodiff(trainable=[w])").model
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    got = graphforge.create_session(program, providers=["CPUExecutionProvider"]).run(["w_grad"], {"x": x})[0]
    w = torch.arange(1.0, 13.0).reshape(3, 4).requires_grad_()
    torch.exp((torch.from_numpy(x) @ w).mean(1, keepdim=True)).sum().backward()
    np.testing.assert_allclose(got, w.grad.numpy(), rtol=1e-5)


def test_a_large_weight_is_not_read():
    big = gs.Constant("big", np.zeros((100, 100), np.float32))
    out = gs.Variable("out")
    gs.Node("Identity", inputs=[big], outputs=[out])
    assert constant_value(out, 18) is None


def test_a_computed_constant_read_by_several_nodes_is_evaluated_once(monkeypatch):
    # the driver shares GradContext.const_value's results over its walk: both reductions read `axes`
    text = COMPUTED_AXES.replace("r = ReduceSum <keepdims = 0> (e, last_1d)", "r = ReduceMean <keepdims = 1> (e, axes)")
    evaluated = []
    monkeypatch.setattr(
        graphforge.constants, "_evaluate", lambda nodes, leaves, t, opset: evaluated.append(t.name) or np.array([1])
    )
    graphforge.compile(_sorted(text), "autodiff(trainable=[w])")
    assert evaluated == ["axes"]
