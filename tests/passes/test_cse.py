"""cse: equal computations merge; random ops, parameters and graph outputs are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _util import apply, assert_same_outputs, branch, check_on_cnn, feeds_for, names, op_list, ops, parse, run_pass
from graphforge.passes import CommonSubexpressionElimination

import graphforge

CHAIN = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2,3] x) => (float[2,3] y) {
  [relu_a] a1 = Relu(x)
  [relu_b] a2 = Relu(x)
  [neg_a] b1 = Neg(a1)
  [neg_b] b2 = Neg(a2)
  [leaky_a] c1 = LeakyRelu<alpha = 0.1>(b1)
  [leaky_b] c2 = LeakyRelu<alpha = 0.2>(b2)
  [sum] y = Add(c1, c2)
}
"""


def test_merges_a_duplicated_chain_in_one_run():
    model = parse(CHAIN)
    result = apply(model, "cse")
    (record,) = result.records
    assert record.changed
    assert record.delta == {"Relu": -1, "Neg": -1}
    # the LeakyRelus differ in alpha: both stay, now reading the one Neg
    assert names(result.model.graph) == ["relu_a", "neg_a", "leaky_a", "leaky_b", "sum"]
    assert [list(n.input) for n in result.model.graph.node][2:4] == [["b1"], ["b1"]]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_nothing_to_merge_reports_unchanged():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x, float[2] z) => (float[2] y) { a = Relu(x)
          b = Relu(z)
          c = LeakyRelu<alpha = 0.1>(x)
          d = LeakyRelu<alpha = 0.3>(x)
          e = Add(a, b)
          f = Add(c, d)
          y = Sub(e, f) }
    """)
    result = apply(model, "cse")
    assert not result.records[0].changed
    assert result.model == model


def test_sees_through_argument_order_only_when_equal():
    # Sub(x, z) and Sub(z, x) are different computations
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x, float[2] z) => (float[2] y) { a = Sub(x, z)
          b = Sub(z, x)
          y = Add(a, b) }
    """)
    assert not apply(model, "cse").records[0].changed


def test_equal_constant_nodes_merge_but_not_across_dtypes():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x, double[2] z) => (float[2] y, double[2] w) {
          [k1] k1 = Constant<value = float[2] {1.5, 2.5}>()
          [k2] k2 = Constant<value = float[2] {1.5, 2.5}>()
          [k3] k3 = Constant<value = float[2] {1.5, 3.5}>()
          [k4] k4 = Constant<value = double[2] {1.5, 2.5}>()
          a = Mul(x, k1)
          b = Mul(x, k2)
          c = Mul(x, k3)
          s = Add(a, b)
          y = Add(s, c)
          w = Mul(z, k4)
        }
    """)
    result = apply(model, "cse")
    assert result.records[0].delta == {"Constant": -1, "Mul": -1}
    assert [n for n in names(result.model.graph) if n.startswith("k")] == ["k1", "k3", "k4"]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_equal_bfloat16_constants_merge_and_keep_their_type():
    # the text form writes bfloat16 as its bit patterns: 16320 = 1.5, 16416 = 2.5
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y) {
          k1 = Constant<value = bfloat16[2] {16320, 16416}>()
          k2 = Constant<value = bfloat16[2] {16320, 16416}>()
          f1 = Cast<to = 1>(k1)
          f2 = Cast<to = 1>(k2)
          a = Mul(x, f1)
          y = Add(a, f2)
        }
    """)
    result = apply(model, "cse")
    assert result.records[0].delta == {"Constant": -1, "Cast": -1}
    (constant,) = [n for n in result.model.graph.node if n.op_type == "Constant"]
    assert constant.attribute[0].t.data_type == onnx.TensorProto.BFLOAT16
    assert_same_outputs(model, result.model, feeds_for(model))


@pytest.mark.parametrize(
    "nodes",
    [
        "a = RandomNormalLike(x)\n b = RandomNormalLike(x)",
        "a = RandomUniform<shape = [2]>()\n b = RandomUniform<shape = [2]>()",
        "a, ma = Dropout(x, r, t)\n b, mb = Dropout(x, r, t)",
    ],
    ids=["RandomNormalLike", "RandomUniform", "Dropout"],
)
def test_random_ops_never_merge(nodes):
    model = parse(f"""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y) <float r = {{0.5}}, bool t = {{1}}> {{
          {nodes}
          y = Add(a, b)
        }}
    """)
    result = apply(model, "cse")
    assert not result.records[0].changed
    assert ops(result.model) == ops(model)


def test_equal_initializers_are_not_merged():
    # two parameters with equal values must stay two parameters
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,2] x) => (float[2,2] y) <float[2,2] W1 = {1,2,3,4}, float[2,2] W2 = {1,2,3,4}> {
          a = MatMul(x, W1)
          b = MatMul(x, W2)
          y = Add(a, b)
        }
    """)
    result = apply(model, "cse")
    assert not result.records[0].changed
    assert op_list(result.model.graph) == ["MatMul", "MatMul", "Add"]
    assert [t.name for t in result.model.graph.initializer] == ["W1", "W2"]


def test_node_writing_a_graph_output_is_never_the_one_removed():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y1, float[2] y2, float[2] z) {
          [first] y1 = Relu(x)
          [second] y2 = Relu(x)
          [internal] t = Relu(x)
          z = Neg(t)
        }
    """)
    result = apply(model, "cse")
    # the internal duplicate reads y1 now; the two output writers both stay
    assert result.records[0].delta == {"Relu": -1}
    assert names(result.model.graph)[:2] == ["first", "second"]
    assert [o.name for o in result.model.graph.output] == ["y1", "y2", "z"]
    assert list(result.model.graph.node[-1].input) == ["y1"]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_duplicate_writing_an_output_after_an_internal_one_stays():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y, float[2] z) {
          t = Relu(x)
          z = Neg(t)
          y = Relu(x)
        }
    """)
    result = apply(model, "cse")
    assert not result.records[0].changed
    assert [o.name for o in result.model.graph.output] == ["y", "z"]


def test_omitted_optional_inputs_are_equal():
    # regression: each omitted input was a distinct empty tensor, so these never merged
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[4] x, float m) => (float[4] y) {
          a = Clip(x, , m)
          b = Clip(x, , m)
          y = Add(a, b)
        }
    """)
    result = apply(model, "cse")
    assert result.records[0].delta == {"Clip": -1}
    assert_same_outputs(model, result.model, feeds_for(model))


def test_nodes_with_different_optional_outputs_do_not_merge():
    # regression: only the number of outputs was compared, so the second node's Mean was
    # rewired to the first node's omitted (empty) output
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,4] x) => (float[2,4] y) <float[4] s = {1,2,3,4}, float[4] b = {0,1,0,1}> {
          y1, , inv = LayerNormalization<axis = -1>(x, s, b)
          y2, mean, inv2 = LayerNormalization<axis = -1>(x, s, b)
          a = Mul(y1, inv)
          c = Add(y2, mean)
          y = Add(a, c)
        }
    """)
    result = apply(model, "cse")
    assert not result.records[0].changed
    assert_same_outputs(model, result.model, feeds_for(model))
    # and the same output pattern does merge
    same = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,4] x) => (float[2,4] y) <float[4] s = {1,2,3,4}, float[4] b = {0,1,0,1}> {
          y1, , inv1 = LayerNormalization<axis = -1>(x, s, b)
          y2, , inv2 = LayerNormalization<axis = -1>(x, s, b)
          a = Mul(y1, inv1)
          c = Mul(y2, inv2)
          y = Add(a, c)
        }
    """)
    result = apply(same, "cse")
    assert result.records[0].delta == {"LayerNormalization": -1, "Mul": -1}
    assert_same_outputs(same, result.model, feeds_for(same))


IF_MODEL = """
<ir_version: 10, opset_import: ["" : 18]>
g (bool c, float[2] x) => (float[2] y) {
  y = If(c) <then_branch = g1 () => (float[2] r1) {
      [then_a] a = Sigmoid(x)
      [then_b] b = Sigmoid(x)
      [then_sum] r1 = Add(a, b)
  }, else_branch = g2 () => (float[2] r2) {
      [else_a] p = Neg(x)
      [else_b] q = Neg(x)
      [else_mul] r2 = Mul(p, q)
  }>
}
"""


def test_duplicates_inside_if_branches():
    model = parse(IF_MODEL)
    result = apply(model, "cse")
    assert result.records[0].delta == {"Sigmoid": -1, "Neg": -1}
    assert names(branch(result.model, "then_branch")) == ["then_a", "then_sum"]
    assert names(branch(result.model, "else_branch")) == ["else_a", "else_mul"]
    for cond in (True, False):
        assert_same_outputs(model, result.model, feeds_for(model, seed=3) | {"c": np.array(cond)})


def test_nodes_holding_subgraphs_are_left_alone():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (bool c, float[2] x) => (float[2] y) {
          a = If(c) <then_branch = g1 () => (float[2] r1) { r1 = Relu(x) },
                     else_branch = g2 () => (float[2] r2) { r2 = Neg(x) }>
          b = If(c) <then_branch = g3 () => (float[2] r3) { r3 = Relu(x) },
                     else_branch = g4 () => (float[2] r4) { r4 = Neg(x) }>
          y = Add(a, b)
        }
    """)
    assert not apply(model, "cse").records[0].changed


def test_duplicates_in_a_local_function_with_attribute_references():
    # regression: an attribute reference is unhashable, and the pass crashed on it
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
        g (float[2] x) => (float[2] y) { y = local.f<alpha = 0.5>(x) }
        <domain: "local", opset_import: ["" : 18]>
        f <alpha>(a) => (b) {
          b1 = LeakyRelu<alpha: float = @alpha>(a)
          b2 = LeakyRelu<alpha: float = @alpha>(a)
          b = Add(b1, b2)
        }
    """)
    result = apply(model, "cse")
    assert result.records[0].delta == {"LeakyRelu": -1}
    assert op_list(result.model.functions[0]) == ["LeakyRelu", "Add"]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_run_directly_returns_changed():
    result, proto = run_pass(parse(CHAIN), CommonSubexpressionElimination())
    assert result.changed
    assert ops(proto)["Relu"] == 1


def test_on_exported_cnn(tmp_path_factory):
    result = check_on_cnn(tmp_path_factory, "cse")
    assert result.records[0].delta == {"Constant": -1}  # the exporter's two equal Constant nodes


def test_dead_code_it_did_not_make_is_left_for_dce():
    # regression: the pass ran a full cleanup, so the report blamed it for dce's work
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
        g (bool c, float[2] x) => (float[2] y, float[2] z) {
          [dead] d = Neg(x)
          [relu_a] a = Relu(x)
          [relu_b] b = Relu(x)
          [sum] s = Add(a, b)
          [call] y = local.f(s)
          [if] z = If(c) <then_branch = t () => (float[2] o) { dt = Neg(x)  s1 = Sqrt(x)  s2 = Sqrt(x)  o = Add(s1, s2) },
                          else_branch = e () => (float[2] o2) { o2 = Sigmoid(x) }>
        }
        <domain: "local", opset_import: ["" : 18]>
        f (p) => (q) {
          df = Neg(p)
          t1 = Tanh(p)
          t2 = Tanh(p)
          q = Mul(t1, t2)
        }
    """)
    result = apply(model, "cse, dce")
    merged, dce = result.records
    assert merged.delta == {"Relu": -1, "Sqrt": -1, "Tanh": -1}
    assert dce.delta == {"Neg": -3}
    for cond in (True, False):
        assert_same_outputs(model, result.model, feeds_for(model, seed=7) | {"c": np.array(cond)})


def test_cse_runs_after_an_optimizer_on_a_transformer(transformer_path):
    """The optimizer's nodes hold tensor attributes onnx-graphsurgeon keeps as TensorProtos
    (they are unhashable): cse keys them by their bytes instead of failing."""
    graphforge.compile(transformer_path, "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-3), cse")
