"""topo_sort: a valid, stable order (subgraph reads included), iterative on deep graphs,
cycles refused by name. Also the whole generic pipeline: on an exported CNN, and on
random DAGs (hypothesis)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from _util import (
    GENERIC_PIPELINE,
    apply,
    assert_same_outputs,
    assert_topologically_sorted,
    branch,
    check_on_cnn,
    feeds_for,
    names,
    parse,
    run_pass,
)
from graphforge.passes import TopologicalSort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphforge import GraphforgeError, Model, PassError, PipelineError

SORTED = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2,3] x, float[2,3] z) => (float[2,3] y, float[2,3] w) {
  [relu] a = Relu(x)
  [neg] b = Neg(z)
  [add] c = Add(a, b)
  [exp] w = Exp(b)
  [mul] y = Mul(c, a)
}
"""


def shuffled(model: onnx.ModelProto, order: list[int], graph: Callable | None = None) -> onnx.ModelProto:
    """A copy of ``model`` with the main graph's nodes (or those of ``graph(copy)``) in ``order``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    target = graph(out) if graph is not None else out.graph
    nodes = [onnx.NodeProto() for _ in target.node]
    for new, old in zip(nodes, [target.node[i] for i in order], strict=True):
        new.CopyFrom(old)
    del target.node[:]
    target.node.extend(nodes)
    return out


def test_sorts_a_shuffled_graph():
    model = parse(SORTED)
    mixed = shuffled(model, [4, 2, 3, 1, 0])  # mul, add, exp, neg, relu
    result = apply(mixed, "topo_sort", verify=False)  # the shuffled input itself fails the checker
    assert result.records[0].changed
    assert result.records[0].delta == {}
    onnx.checker.check_model(result.model, full_check=True)
    assert_topologically_sorted(result.model.graph)
    # ties go to the node that came first: neg (index 3) is ready before relu (index 4)
    assert names(result.model.graph) == ["neg", "exp", "relu", "add", "mul"]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_sorted_graph_is_left_as_it_is():
    model = parse(SORTED)
    result = apply(model, "topo_sort")
    assert not result.records[0].changed
    assert result.model == model
    # any valid order is kept, not just one canonical order
    other = shuffled(model, [1, 3, 0, 2, 4])  # neg, exp, relu, add, mul: valid too
    result = apply(other, "topo_sort")
    assert not result.records[0].changed
    assert names(result.model.graph) == ["neg", "exp", "relu", "add", "mul"]


def test_sorts_inside_if_branches_and_functions():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
        g (bool c, float[2] x) => (float[2] y) {
          t = local.f(x)
          y = If(c) <then_branch = g1 () => (float[2] r1) {
              [then_relu] a = Relu(t)
              [then_neg] r1 = Neg(a)
          }, else_branch = g2 () => (float[2] r2) {
              [else_exp] r2 = Exp(t)
          }>
        }
        <domain: "local", opset_import: ["" : 18]>
        f (p) => (q) {
          [f_sig] s = Sigmoid(p)
          [f_mul] q = Mul(s, p)
        }
    """)
    mixed = shuffled(model, [1, 0], graph=lambda m: branch(m, "then_branch", 1))
    function_nodes = list(mixed.functions[0].node)
    del mixed.functions[0].node[:]
    mixed.functions[0].node.extend(reversed(function_nodes))
    result = apply(mixed, "topo_sort", verify=False)
    assert result.records[0].changed
    onnx.checker.check_model(result.model, full_check=True)
    assert names(branch(result.model, "then_branch", 1)) == ["then_relu", "then_neg"]
    assert names(result.model.functions[0]) == ["f_sig", "f_mul"]
    for cond in (True, False):
        assert_same_outputs(model, result.model, feeds_for(model, seed=6) | {"c": np.array(cond)})


@pytest.mark.parametrize("source", ["in memory", "file"])
@pytest.mark.parametrize("owner", ["If", "Loop", "nested If"])
def test_node_with_a_subgraph_goes_after_the_producer_of_what_the_subgraph_reads(owner, source):
    # t is read only inside the subgraph, never as an input of the owning node
    bodies = {
        "If": """y = If(c) <then_branch = g1 () => (float[2] r1) { r1 = Relu(t) },
                              else_branch = g2 () => (float[2] r2) { r2 = Neg(x) }>""",
        "Loop": """y = Loop(n, c, x) <body = body (int64 i, bool ci, float[2] acc) => (bool co, float[2] out) {
                       co = Identity(ci)
                       out = Add(acc, t)
                   }>""",
        "nested If": """y = If(c) <then_branch = g1 () => (float[2] r1) {
                            r1 = If(c) <then_branch = h1 () => (float[2] s1) { s1 = Relu(t) },
                                        else_branch = h2 () => (float[2] s2) { s2 = Neg(x) }>
                        }, else_branch = g2 () => (float[2] r2) { r2 = Neg(x) }>""",
    }
    model = parse(f"""
        <ir_version: 10, opset_import: ["" : 18]>
        g (bool c, float[2] x, int64 n) => (float[2] y) {{
          [producer] t = Sigmoid(x)
          [owner] {bodies[owner]}
        }}
    """)
    if source == "file":
        # gs imports the subgraph's read of t, produced later in the file, as a separate
        # tensor named t: the sort must link them by name
        result, proto = run_pass(shuffled(model, [1, 0]), TopologicalSort())
    else:
        # the usual case: a pass appended the producer after the owner, in memory
        graph_model = Model.from_proto(model)
        graph_model.graph.nodes.reverse()
        result = TopologicalSort().run(graph_model)
        proto = result.model.to_proto()
    assert result.changed
    assert names(proto.graph) == ["producer", "owner"]
    onnx.checker.check_model(proto, full_check=True)
    for cond in (True, False):
        feeds = feeds_for(model, seed=7) | {"c": np.array(cond), "n": np.array(2, np.int64)}
        assert_same_outputs(model, proto, feeds)


def test_fifty_thousand_node_chain_sorts_without_recursion():
    # gs's own toposort recurses once per node (Python's limit is 1000 by default); ours
    # must not. Built in gs directly: importing 50,000 nodes from a proto takes longer.
    n = 50_000
    tensors = [gs.Variable("x", np.float32, [1]), *(gs.Variable(f"t{i}") for i in range(1, n))]
    tensors.append(gs.Variable("y", np.float32, [1]))
    nodes = [gs.Node("Neg", name=f"n{i}", inputs=[tensors[i]], outputs=[tensors[i + 1]]) for i in range(n)]
    graph = gs.Graph(nodes=nodes[::-1], inputs=[tensors[0]], outputs=[tensors[-1]], opset=18)
    start = time.perf_counter()
    result = TopologicalSort().run(Model(graph))
    assert time.perf_counter() - start < 30
    assert result.changed
    assert [node.name for node in graph.nodes] == [f"n{i}" for i in range(n)]


CYCLE = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2] x) => (float[2] y) {
  [first] a = Add(x, b)
  [second] b = Relu(a)
  [last] y = Neg(b)
}
"""


def test_cycle_is_refused_naming_its_nodes():
    model = parse(CYCLE, check=False)
    with pytest.raises(PassError, match=r"cycle: (first -> second|second -> first)") as caught:
        run_pass(model, TopologicalSort())
    assert isinstance(caught.value, GraphforgeError)
    assert caught.value.node in ("first", "second")
    assert "last" not in str(caught.value)
    with pytest.raises(PipelineError, match=r"topo_sort.*cycle"):
        apply(model, "topo_sort", verify=False)


def test_on_exported_cnn(tmp_path_factory):
    result = check_on_cnn(tmp_path_factory, "topo_sort")
    assert not result.records[0].changed  # an export is sorted already


# --------------------------------------------------------------------------- the whole generic pipeline


def test_generic_pipeline_on_exported_cnn(tmp_path_factory):
    result = check_on_cnn(tmp_path_factory, GENERIC_PIPELINE)
    assert [r.name for r in result.records] == ["identity_elimination", "fold_constants", "cse", "dce", "topo_sort"]
    assert result.records[1].changed  # the flattening reshape's integer arithmetic folds
    assert_topologically_sorted(result.model.graph)
    # every parameter is still an initializer, nothing was folded into a derived constant
    conv = next(n for n in result.model.graph.node if n.op_type == "Conv")
    assert list(conv.input) == ["x", "conv.weight", "conv.bias"]


def test_generic_pipeline_on_exported_transformer(transformer_path):
    # a 1-layer GPT-2 with dynamic batch and sequence: lots of shape arithmetic to fold and
    # repeated Shape/Constant nodes to merge, none of which may bake a symbolic dim
    source = onnx.load(str(transformer_path))
    result = apply(source, GENERIC_PIPELINE)
    assert result.records[1].changed and result.records[2].changed  # fold_constants, cse
    assert sum(1 for _ in result.model.graph.node) < sum(1 for _ in source.graph.node)
    dims = [d.dim_param for d in result.model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq"]
    for batch, seq in ((1, 5), (3, 11)):
        assert_same_outputs(source, result.model, feeds_for(source, seed=seq, dims={"batch": batch, "seq": seq}))


OPS = {"Add": 2, "Mul": 2, "Relu": 1, "Identity": 1, "Neg": 1}


@st.composite
def elementwise_dags(draw) -> str:
    """Text of a random DAG over float[4] tensors: x and z in, a Constant k for folding,
    repeated subexpressions, dead branches."""
    available = ["x", "z", "k"]
    lines = ["k = Constant<value = float[4] {0.5, -1.0, 2.0, -3.0}>()"]
    made: list[tuple[str, tuple[str, ...]]] = []
    for i in range(draw(st.integers(2, 14))):
        if made and draw(st.integers(0, 2)) == 0:
            op, args = draw(st.sampled_from(made))  # a common subexpression
        else:
            op = draw(st.sampled_from(sorted(OPS)))
            args = tuple(draw(st.sampled_from(available)) for _ in range(OPS[op]))
        made.append((op, args))
        lines.append(f"t{i} = {op}({', '.join(args)})")
        available.append(f"t{i}")
    # one output sums a few nodes (so repeated ones are live), up to two more are nodes
    summed = draw(st.lists(st.sampled_from(available[3:]), min_size=1, max_size=4, unique=True))
    lines.append(f"out = Sum({', '.join(summed)})")
    others = draw(st.lists(st.sampled_from(available[3:]), max_size=2, unique=True))
    signature = ", ".join(f"float[4] {o}" for o in ["out", *others])
    body = "\n  ".join(lines)
    return f"""<ir_version: 10, opset_import: ["" : 18]>
g (float[4] x, float[4] z) => ({signature}) {{
  {body}
}}"""


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(elementwise_dags())
def test_generic_passes_keep_outputs_of_random_dags(text):
    model = parse(text)
    feeds = feeds_for(model, seed=len(text))
    for pipeline in [*GENERIC_PIPELINE.split(", "), GENERIC_PIPELINE]:
        result = apply(model, pipeline)
        assert_topologically_sorted(result.model.graph)
        assert_same_outputs(model, result.model, feeds)
    # after the whole pipeline only an Identity that must keep an output name is left
    outputs = {o.name for o in model.graph.output}
    kept = [n for n in result.model.graph.node if n.op_type == "Identity"]
    assert all(n.output[0] in outputs for n in kept)
