"""Model pairs for the diff tests: small graphs in ONNX text form, and helpers that change one thing."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

#: an If whose branches read ``z`` from the enclosing graph
IF_MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
cond_model (bool c, float[N] x) => (float[N] y) {
    z = Relu(x)
    y = If(c) <then_branch = g1 () => (float[N] t) { t = Neg(z) }, else_branch = g2 () => (float[N] e) { e = Abs(z) }>
}
"""

#: a model calling a local function
FUNCTION_MODEL = """
<ir_version: 8, opset_import: ["" : 17, "local" : 1]>
agraph (float[N] x) => (float[N] y) {
    y = local.twice(x)
}
<domain: "local", opset_import: ["" : 17]>
twice (a) => (b) {
    c = Add(a, a)
    b = Relu(c)
}
"""

#: A and B differ in one of each kind: Neg removed, Sigmoid added, LeakyRelu's alpha changed
STATUS_A = """
<ir_version: 8, opset_import: ["" : 17]>
statuses (float[N, 4] x) => (float[N, 4] y) {
    [relu] a = Relu(x)
    [neg] b = Neg(a)
    [leaky] c = LeakyRelu<alpha = 0.1>(b)
    [add] y = Add(c, x)
}
"""
STATUS_B = """
<ir_version: 8, opset_import: ["" : 17]>
statuses (float[N, 4] x) => (float[N, 4] y) {
    [relu] a = Relu(x)
    [leaky] c = LeakyRelu<alpha = 0.2>(a)
    [sig] d = Sigmoid(c)
    [add] y = Add(d, x)
}
"""

#: fold_constants folds Sqrt(k) * 2 into one Constant
FOLDABLE = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2] x) => (float[2] y) {
  [k] k = Constant<value = float[2] {4.0, 9.0}>()
  [sqrt] s = Sqrt(k)
  [two] two = Constant<value_float = 2.0>()
  [scale] t = Mul(s, two)
  [mul] y = Mul(x, t)
}
"""


def parse(text: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model, full_check=True)
    return model


def copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def perturb_initializer(model: onnx.ModelProto, name: str, index: tuple[int, ...], delta: float) -> onnx.ModelProto:
    """A copy with one element of initializer ``name`` moved by ``delta``."""
    out = copy(model)
    (tensor,) = [t for t in out.graph.initializer if t.name == name]
    values = numpy_helper.to_array(tensor).copy()
    values[index] += delta
    tensor.CopyFrom(numpy_helper.from_array(values, name))
    return out


def set_attribute(model: onnx.ModelProto, node_name: str, attribute: str, value) -> onnx.ModelProto:
    """A copy with one attribute of the node ``node_name`` set to ``value``."""
    out = copy(model)
    (node,) = [n for n in out.graph.node if n.name == node_name]
    (attr,) = [a for a in node.attribute if a.name == attribute]
    attr.CopyFrom(onnx.helper.make_attribute(attribute, value))
    return out


def export_norm_block(path: Path, opset: int) -> Path:
    """The same small torch module (LayerNorm, Linear, GELU, residual) exported at ``opset``:
    before opset 17 the exporter writes LayerNorm as ReduceMean/Sub/Pow/Sqrt/Div, from 17 on as
    LayerNormalization."""
    import torch

    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(8)
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return x + torch.nn.functional.gelu(self.linear(self.norm(x)))

    block = Block().eval()
    with torch.no_grad():
        block.norm.weight.add_(0.1 * torch.randn(8))
        block.norm.bias.add_(0.1 * torch.randn(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            block,
            (torch.randn(2, 8),),
            str(path),
            dynamo=False,
            do_constant_folding=False,
            opset_version=opset,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        )
    return path


def constants_mid_graph(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Float Constant nodes between the first and last third of the graph (by file order)."""
    n = len(model.graph.node)
    found = []
    for k, node in enumerate(model.graph.node):
        if node.op_type != "Constant" or not n // 3 <= k <= 2 * n // 3:
            continue
        (attr,) = node.attribute
        if attr.name == "value" and attr.t.data_type == onnx.TensorProto.FLOAT:
            found.append(node)
    return found


def scale_constant(model: onnx.ModelProto, node_name: str, factor: float) -> onnx.ModelProto:
    out = copy(model)
    (node,) = [n for n in out.graph.node if n.name == node_name]
    (attr,) = node.attribute
    values = numpy_helper.to_array(attr.t) * np.float32(factor)
    attr.t.CopyFrom(numpy_helper.from_array(values.astype(np.float32), attr.t.name))
    return out


#: MatMul + Add in A; in B one Gemm that a fusion pass named after the MatMul it replaced
FUSE_A = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 3] y) {
    [w] w = Constant<value = float[4, 3] {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}>()
    [bias] bias = Constant<value = float[3] {1, 2, 3}>()
    [mm] h = MatMul(x, w)
    [add] z = Add(h, bias)
    [act] y = Relu(z)
}
"""
FUSE_B = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 3] y) {
    [w] w = Constant<value = float[4, 3] {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}>()
    [bias] bias = Constant<value = float[3] {1, 2, 3}>()
    [GEMM] z = Gemm(x, w, bias)
    [act] y = Relu(z)
}
"""

#: A computes h once for two readers; B recomputes it for the second reader (as a
#: recompute pass does for the backward graph), the copy named after the node it copies
RECOMPUTE_A = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 4] y1, float[N, 4] y2) {
    [pre] p = Sigmoid(x)
    [r] h = Tanh(p)
    [use1] y1 = Neg(h)
    [use2] y2 = Abs(h)
}
"""
RECOMPUTE_B = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 4] y1, float[N, 4] y2) {
    [pre] p = Sigmoid(x)
    [r] h = Tanh(p)
    [use1] y1 = Neg(h)
    [COPY_PRE] p2 = Sigmoid(x)
    [COPY_R] h2 = Tanh(p2)
    [use2] y2 = Abs(h2)
}
"""


def named(text: str, **names: str) -> onnx.ModelProto:
    """``text`` parsed, with the nodes named by placeholder (``GEMM``) renamed: the ONNX text
    syntax has no ``::`` in names."""
    model = onnx.parser.parse_model(text)
    for node in model.graph.node:
        node.name = names.get(node.name, node.name)
    onnx.checker.check_model(model, full_check=True)
    return model
