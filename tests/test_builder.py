"""graphforge.builder's folds: what a transpose or a sum emits when its input's producer
makes a cheaper form exact. Each fold is checked against numpy on onnxruntime, and the
cases it must leave alone are checked to keep the plain op."""

from __future__ import annotations

import itertools

import numpy as np
import onnx_graphsurgeon as gs
import pytest

import graphforge
from graphforge.builder import Builder

RNG = np.random.default_rng(0)


def _run(graph: gs.Graph, outputs: list[gs.Tensor], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    graph.outputs = outputs
    for t in outputs:
        t.dtype = t.dtype if t.dtype is not None else np.float32
    graph.cleanup().toposort()
    session = graphforge.create_session(gs.export_onnx(graph), providers=["CPUExecutionProvider"])
    return session.run([t.name for t in outputs], feeds)


def _graph(**inputs: tuple[int, ...]) -> tuple[gs.Graph, Builder, dict[str, gs.Variable]]:
    tensors = {name: gs.Variable(name, dtype=np.float32, shape=list(shape)) for name, shape in inputs.items()}
    graph = gs.Graph(inputs=list(tensors.values()), opset=17)
    return graph, Builder(graph), tensors


def _ops(graph: gs.Graph) -> list[str]:
    return sorted(n.op for n in graph.cleanup().nodes)


@pytest.mark.parametrize("inner", list(itertools.permutations(range(3))))
def test_transpose_of_a_transpose_is_one_transpose_of_its_source(inner):
    graph, b, t = _graph(x=(2, 3, 4))
    x = np.asarray(RNG.standard_normal((2, 3, 4)), np.float32)
    first = b.transpose(t["x"], inner)
    outer = [1, 2, 0]
    second = b.transpose(first, outer)
    composed = np.transpose(np.transpose(x, inner), outer)
    (got,) = _run(graph, [b.op("Identity", second)], {"x": x})
    np.testing.assert_array_equal(got, composed)
    assert _ops(graph).count("Transpose") == (0 if np.array_equal(composed, x) else 1)


def test_inverse_transpose_returns_the_source_tensor():
    _, b, t = _graph(w=(5, 3))
    assert b.transpose(b.transpose(t["w"], [1, 0]), [1, 0]) is t["w"]


@pytest.mark.parametrize(("trans_a", "trans_b"), list(itertools.product((0, 1), repeat=2)))
def test_transposed_gemm_product_is_the_swapped_gemm(trans_a, trans_b):
    m, k, n = 4, 3, 5
    graph, b, t = _graph(a=(k, m) if trans_a else (m, k), w=(n, k) if trans_b else (k, n))
    a = np.asarray(RNG.standard_normal(t["a"].shape), np.float32)
    w = np.asarray(RNG.standard_normal(t["w"].shape), np.float32)
    attrs = {k: 1 for k, v in (("transA", trans_a), ("transB", trans_b)) if v}
    product = b.op("Gemm", t["a"], t["w"], alpha=0.5, **attrs)
    out = b.transpose(product, [1, 0])
    expected = (0.5 * (a.T if trans_a else a) @ (w.T if trans_b else w)).T
    (got,) = _run(graph, [out], {"a": a, "w": w})
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert _ops(graph) == ["Gemm"]


def test_a_gemm_read_elsewhere_or_with_a_bias_is_transposed_as_it_is():
    graph, b, t = _graph(a=(4, 3), w=(3, 5), c=(4, 5))
    read = b.op("Gemm", t["a"], t["w"])
    other = b.op("Relu", read)
    biased = b.op("Gemm", t["a"], t["w"], t["c"])
    outs = [b.transpose(read, [1, 0]), other, b.transpose(biased, [1, 0])]
    assert [o.inputs[0].op for o in outs] == ["Transpose", "Relu", "Transpose"]
    feeds = {k: np.asarray(RNG.standard_normal(t[k].shape), np.float32) for k in "awc"}
    got = _run(graph, outs, feeds)
    np.testing.assert_allclose(got[0], (feeds["a"] @ feeds["w"]).T, rtol=1e-6)
    np.testing.assert_allclose(got[2], (feeds["a"] @ feeds["w"] + feeds["c"]).T, rtol=1e-6)


@pytest.mark.parametrize("scatter", ["ScatterElements", "ScatterND"])
def test_sum_with_a_scatter_add_into_zeros_scatters_into_the_rest(scatter):
    rows, width = 6, 3
    graph, b, t = _graph(table=(rows, width), dense=(rows, width), other=(rows, width), updates=(4, width))
    idx = np.array([1, 4, 1, 5], np.int64)
    if scatter == "ScatterElements":
        index = b.constant(np.repeat(idx[:, None], width, axis=1))
    else:
        index = b.constant(idx[:, None])
    scattered = b.op(scatter, b.zeros_like(t["table"]), index, t["updates"], reduction="add")
    total = b.sum([t["dense"], scattered, t["other"]])
    feeds = {k: np.asarray(RNG.standard_normal(t[k].shape), np.float32) for k in ("table", "dense", "other", "updates")}
    expected = feeds["dense"] + feeds["other"]
    np.add.at(expected, idx, feeds["updates"])
    (got,) = _run(graph, [total], feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert "ConstantOfShape" not in _ops(graph) and _ops(graph).count(scatter) == 1


def test_a_scatter_into_something_else_or_read_elsewhere_is_summed_as_it_is():
    _, b, t = _graph(table=(4, 2), dense=(4, 2), updates=(1, 2))
    index = b.constant(np.array([[2]], np.int64))
    into_data = b.op("ScatterND", t["table"], index, t["updates"], reduction="add")
    into_zeros = b.op("ScatterND", b.zeros_like(t["table"]), index, t["updates"], reduction="add")
    b.op("Relu", into_zeros)  # read before the sum: its scatter cannot be replaced
    replaced = b.op("ScatterND", b.zeros_like(t["table"]), index, t["updates"])  # no reduction: not a sum
    totals = [b.sum([t["dense"], x]) for x in (into_data, into_zeros, replaced)]
    assert [total.inputs[0].op for total in totals] == ["Sum", "Sum", "Sum"]
