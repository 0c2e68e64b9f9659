"""MatMul of a batched operand and a matrix: the matrix's gradient is one 2-D product.

dW of ``Y = A[B, S, K] @ W[K, N]`` must not go through a [B, K, N] batched product summed
afterwards (411 MB for GPT-2's LM head): the batch is folded into the rows instead. Checked
on the compiled graph (no intermediate larger than the largest of A, dY and W) and against
numpy at two batch sizes with one compiled graph, static and symbolic dims alike.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphforge.passes import Autodiff
from onnx import helper, numpy_helper, shape_inference

import graphforge

K, N = 5, 7


def _model(a_shape, w_shape, opset: int, dtype=np.float64) -> onnx.ModelProto:
    """loss = 0.5 * sum(Y * Y), Y = A @ W: dY is Y itself. ``a_shape``/``w_shape`` may hold
    dim names; the operand whose shape is all ints is an initializer (a parameter)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(0)
    inputs, inits = [], []
    for name, shape in (("A", a_shape), ("W", w_shape)):
        if all(isinstance(d, int) for d in shape) and len(shape) == 2:
            inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(dtype), name))
        else:
            inputs.append(helper.make_tensor_value_info(name, elem, shape))
    inits.append(numpy_helper.from_array(np.array(0.5, dtype=dtype), "half"))
    nodes = [
        helper.make_node("MatMul", ["A", "W"], ["Y"]),
        helper.make_node("Mul", ["Y", "Y"], ["Y2"]),
        helper.make_node("ReduceSum", ["Y2"], ["S"], keepdims=0),
        helper.make_node("Mul", ["S", "half"], ["loss"]),
    ]
    graph = helper.make_graph(nodes, "mm", inputs, [helper.make_tensor_value_info("loss", elem, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _compile(model: onnx.ModelProto) -> onnx.ModelProto:
    inputs = tuple(i.name for i in model.graph.input)
    return graphforge.compile(model, [Autodiff(inputs=inputs)]).model


def _bound(model: onnx.ModelProto, feeds: dict) -> onnx.ModelProto:
    """A copy with every graph input's dims set to the fed arrays' shapes, shapes inferred."""
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    for vi in bound.graph.input:
        if vi.name in feeds:
            for dim, size in zip(vi.type.tensor_type.shape.dim, feeds[vi.name].shape, strict=True):
                dim.Clear()
                dim.dim_value = size
    del bound.graph.value_info[:]
    return shape_inference.infer_shapes(bound, data_prop=True)


def _assert_no_large_intermediate(compiled: onnx.ModelProto, feeds: dict, limit: int) -> None:
    """Every float intermediate holds at most ``limit`` elements: its shape from shape
    inference with the inputs' dims bound, or, where inference cannot tell (a shape computed
    at run time), measured by running the graph with that tensor exposed."""
    inferred = _bound(compiled, feeds)
    infos = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    sizes, unresolved = {}, []
    for name in [o for node in inferred.graph.node for o in node.output if o]:
        tensor_type = infos[name].type.tensor_type if name in infos else None
        if tensor_type is not None and tensor_type.elem_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE):
            continue
        dims = tensor_type.shape.dim if tensor_type is not None and tensor_type.HasField("shape") else None
        if dims is not None and all(d.HasField("dim_value") for d in dims):
            sizes[name] = [d.dim_value for d in dims]
        else:
            unresolved.append(name)
    if unresolved:
        probe = onnx.ModelProto()
        probe.CopyFrom(compiled)
        probe.graph.output.extend(helper.make_value_info(n, onnx.TypeProto()) for n in unresolved)
        for name, value in zip(unresolved, _run(probe, feeds, unresolved), strict=True):
            if np.issubdtype(np.asarray(value).dtype, np.floating):
                sizes[name] = list(np.shape(value))
    for name, shape in sizes.items():
        assert int(np.prod(shape)) <= limit, f"intermediate {name!r} of shape {shape} exceeds {limit} elements"


def _run(compiled: onnx.ModelProto, feeds: dict, names):
    session = graphforge.create_session(compiled, providers=["CPUExecutionProvider"])
    return session.run(list(names), feeds)


@pytest.mark.parametrize("opset", [18, 10])
@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "static"])
@pytest.mark.parametrize("rank", [3, 4])
def test_batched_activations_times_weight(rank: int, symbolic: bool, opset: int):
    rng = np.random.default_rng(rank)
    sizes = [(3, 4), (1, 6)] if symbolic else [(3, 4)]
    for batch, seq in sizes:
        lead = [batch, 2][: rank - 2]
        a_shape = [*lead, seq, K]
        declared = [*["B", 2][: rank - 2], "S", K] if symbolic else a_shape
        if not symbolic or (batch, seq) == sizes[0]:
            model = _model(declared, [K, N], opset)
            compiled = _compile(model)
            w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W"))
        a = rng.standard_normal(a_shape)
        feeds = {"A": a}
        da, dw = _run(compiled, feeds, ["A_grad", "W_grad"])
        y = a @ w
        np.testing.assert_allclose(dw, a.reshape(-1, K).T @ y.reshape(-1, N), rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(da, y @ w.T, rtol=1e-5, atol=1e-8)
        _assert_no_large_intermediate(compiled, feeds, max(a.size, y.size, w.size))


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "static"])
def test_weight_times_batched_activations(symbolic: bool):
    """The mirror image: A [M, K] a parameter, W [B, K, N] batched: dA sums over the batch."""
    m = 4
    rng = np.random.default_rng(7)
    sizes = [(3, 6), (2, 1)] if symbolic else [(3, 6)]
    for i, (batch, n) in enumerate(sizes):
        if i == 0:
            model = _model([m, K], ["B", K, "N"] if symbolic else [batch, K, n], 18)
            compiled = _compile(model)
            a = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "A"))
        w = rng.standard_normal((batch, K, n))
        feeds = {"W": w}
        da, dw = _run(compiled, feeds, ["A_grad", "W_grad"])
        y = a @ w
        np.testing.assert_allclose(da, np.einsum("bmn,bkn->mk", y, w), rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(dw, np.swapaxes(a, -1, -2) @ y, rtol=1e-5, atol=1e-8)
        _assert_no_large_intermediate(compiled, feeds, max(a.size, y.size, w.size))


def test_float32_central_differences():
    """float32, symbolic batch: dW against central differences of the loss (in float64)."""
    model = _model(["B", "S", K], [K, N], 18, dtype=np.float32)
    compiled = _compile(model)
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W")).astype(np.float64)
    rng = np.random.default_rng(3)
    for batch, seq in [(2, 3), (3, 1)]:
        a = rng.standard_normal((batch, seq, K)).astype(np.float32)
        (dw,) = _run(compiled, {"A": a}, ["W_grad"])
        a64, eps = a.astype(np.float64), 1e-6
        numeric = np.zeros_like(w)
        for idx in np.ndindex(w.shape):  # the loss in float64: central differences without rounding noise
            bumped = [w.copy(), w.copy()]
            bumped[0][idx] += eps
            bumped[1][idx] -= eps
            up, down = (0.5 * np.sum((a64 @ wb) ** 2) for wb in bumped)
            numeric[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(dw, numeric, rtol=1e-4, atol=1e-4)
