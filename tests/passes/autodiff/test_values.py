"""The Values rules write their formulas with (passes/autodiff/values.py) and the registry's
``linear`` helper: each expression is emitted into a small graph, run by onnxruntime and
compared with numpy computing the same formula, the same association, in the same type."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from graphforge.passes.autodiff.context import GradContext
from graphforge.passes.autodiff.registry import RuleRegistry
from graphforge.passes.autodiff.values import Emitter, Value, raw

import graphforge
from graphforge.builder import Builder

RNG = np.random.default_rng(0)
X = RNG.uniform(-2.0, 2.0, (3, 4))
Y = RNG.uniform(0.5, 2.0, (3, 4))
W = RNG.uniform(-1.0, 1.0, (4, 2))


def _run(make, dtype, opset: int = 17, **arrays):
    """``make(e, **values)`` over graph inputs holding ``arrays`` (cast to ``dtype``), run by onnxruntime."""
    graph = gs.Graph(opset=opset)
    graph.inputs = [gs.Variable(name, dtype=dtype, shape=list(a.shape)) for name, a in arrays.items()]
    e = Emitter(Builder(graph))
    outputs = make(e, **{t.name: e.value(t) for t in graph.inputs})
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    graph.outputs = [raw(o) for o in outputs]
    model = gs.export_onnx(graph.cleanup())
    session = graphforge.create_session(model, providers=["CPUExecutionProvider"])
    return session.run(None, {name: a.astype(dtype) for name, a in arrays.items()})


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_operators_with_numbers_compute_the_formula_in_the_tensors_type(dtype):
    # a number takes the other operand's type (a float32 constant beside float16 would be refused)
    x, y = X.astype(dtype), Y.astype(dtype)
    one, two, half = (dtype(v) for v in (1.0, 2.0, 0.5))
    got = _run(
        lambda e, x, y: (y * (one - y), 1 - x * x, two / y + 0.5, -x - 3, x / y * 2, np.float32(2) * x),
        dtype,
        x=X,
        y=Y,
    )
    want = [y * (one - y), one - x * x, two / y + half, -x - dtype(3), x / y * two, two * x]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        if dtype is np.float16:  # onnxruntime's CPU kernels compute float16 through float32
            np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-3)
        else:  # the same ops in the same order: the same roundings
            np.testing.assert_array_equal(g, w)


def test_parentheses_are_the_association_the_rounding_follows():
    dy, y = X.astype(np.float32), Y.astype(np.float32)
    left, right = _run(lambda e, dy, y: (dy * y * (1 - y), dy * (y * (1 - y))), np.float32, dy=X, y=Y)
    np.testing.assert_array_equal(left, (dy * y) * (np.float32(1) - y))
    np.testing.assert_array_equal(right, dy * (y * (np.float32(1) - y)))
    assert not np.array_equal(left, right)  # these inputs round differently: the order is kept


def test_comparisons_masks_and_where():
    got = _run(
        lambda e, x, y: (
            e.where(x > 0, y, 0.0),
            e.where((x > -1) & (x < 1), 1.0, y),
            e.where(~(x < 0) | (y > 1.5), x, y),
        ),
        np.float64,
        x=X,
        y=Y,
    )
    np.testing.assert_array_equal(got[0], np.where(X > 0, Y, 0.0))
    np.testing.assert_array_equal(got[1], np.where((X > -1) & (X < 1), 1.0, Y))
    np.testing.assert_array_equal(got[2], np.where(~(X < 0) | (Y > 1.5), X, Y))


def test_products_transposes_reductions_and_shapes():
    batched = RNG.uniform(-1.0, 1.0, (2, 3, 4))
    got = _run(
        lambda e, x, w, b: (
            x @ w,
            w.T @ x.T,
            b.mT,
            b.transpose([2, 0, 1]),
            b.sum([0, 2], keepdims=True),
            b.sum(),
            b.mean([1]),
            b.reshape([6, 4]),
            b.flatten(2).reshape_like(b),
            b.slice(1, 1, 3),
            b.unsqueeze([0]).squeeze([0]),
            x.exp().log(),
            e.concat([x, x.abs()], axis=0),
            e.sum([x, x, x]),
        ),
        np.float64,
        x=X,
        w=W,
        b=batched,
    )
    want = [
        X @ W, W.T @ X.T, np.swapaxes(batched, -1, -2), batched.transpose(2, 0, 1),
        batched.sum((0, 2), keepdims=True), batched.sum(), batched.mean(1), batched.reshape(6, 4), batched,
        batched[:, 1:3], batched, np.log(np.exp(X)), np.concatenate([X, np.abs(X)]), X + X + X,
    ]  # fmt: skip
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_values_of_two_builders_are_not_mixed():
    outer, body = Emitter(Builder(gs.Graph())), Emitter(Builder(gs.Graph()))
    a = outer.value(gs.Variable("a", dtype=np.float32, shape=[2]))
    b = body.value(gs.Variable("b", dtype=np.float32, shape=[2]))
    with pytest.raises(ValueError, match="two builders"):
        b * a
    rebound = body.value(a)  # an outer tensor a body reads: the node goes to the body
    assert isinstance(rebound, Value) and rebound.tensor is a.tensor and body.value(rebound) is rebound
    product = b * rebound
    assert [n.op for n in body.b.graph.nodes] == ["Mul"] and not outer.b.graph.nodes
    assert raw(product) is body.b.graph.nodes[0].outputs[0]


def _context(inputs: int) -> GradContext:
    graph = gs.Graph(opset=17)
    xs = [gs.Variable(f"x{i}", dtype=np.float32, shape=[2]) for i in range(inputs)]
    node = gs.Node("Op", inputs=xs, outputs=[gs.Variable("y", dtype=np.float32, shape=[2])])
    graph.nodes.append(node)
    return GradContext(node, Builder(graph), 17)


def test_linear_rules_give_the_inputs_after_the_transposes_none():
    registry = RuleRegistry()
    registry.linear("Reshapeish")(lambda ctx, dy: -dy)
    registry.linear("Scatterish", broadcast=True, settings={1: "indices"})(lambda ctx, dy: [dy, None, dy * 2])
    ctx = _context(3)
    dy = ctx.value(gs.Variable("dy", dtype=np.float32, shape=[2]))
    one = registry.get("Reshapeish").fn(ctx, [dy])
    assert len(one) == 3 and one[1:] == [None, None] and ctx.b.graph.nodes[-1].op == "Neg"
    rule = registry.get("Scatterish")
    many = rule.fn(ctx, [dy])
    assert many[0] is dy and many[1] is None and ctx.b.graph.nodes[-1].op == "Mul"
    assert rule.broadcast and rule.setting(1) == "indices" and rule.module == __name__
    with pytest.raises(ValueError, match="already registered"):
        registry.linear("Reshapeish")(lambda ctx, dy: dy)


def test_a_multi_output_transpose_gets_every_outputs_gradient():
    registry = RuleRegistry()
    registry.linear("Splitish")(lambda ctx, *dys: [dys[0] + dys[1]])
    ctx = _context(2)
    a, b = (ctx.value(gs.Variable(n, dtype=np.float32, shape=[2])) for n in ("da", "db"))
    dx = registry.get("Splitish").fn(ctx, [a, b])
    assert dx[1] is None and ctx.b.graph.nodes[-1].op == "Add" and ctx.b.graph.nodes[-1].inputs == [a.tensor, b.tensor]
