"""dce: dead nodes, initializers and (optionally) inputs go; everything an output needs stays."""

from __future__ import annotations

import numpy as np
from _util import apply, assert_same_outputs, branch, check_on_cnn, feeds_for, initializer_names, names, op_list, parse
from graphforge.passes import DeadCodeElimination

DEAD_CHAIN = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2,3] x, float[2,3] unused) => (float[2,3] y) <float[3,3] W = {1,2,3,4,5,6,7,8,9}, float[3] b = {1,2,3}> {
  [live_relu] r = Relu(x)
  [live_add] y = Add(r, b)
  [dead_matmul] m = MatMul(x, W)
  [dead_neg] n = Neg(m)
  [dead_exp] e = Exp(r)
}
"""


def test_removes_dead_nodes_and_their_initializers():
    model = parse(DEAD_CHAIN)
    result = apply(model, "dce")
    (record,) = result.records
    assert record.changed
    assert record.delta == {"MatMul": -1, "Neg": -1, "Exp": -1}
    assert names(result.model.graph) == ["live_relu", "live_add"]
    assert initializer_names(result.model) == {"b"}  # W fed only the dead MatMul
    assert [i.name for i in result.model.graph.input] == ["x", "unused"]  # case 3: inputs stay
    assert_same_outputs(model, result.model, feeds_for(model))


def test_remove_unused_inputs_drops_only_unused_main_graph_inputs():
    model = parse(DEAD_CHAIN)
    result = apply(model, "dce(remove_unused_inputs=true)")
    assert [i.name for i in result.model.graph.input] == ["x"]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_unused_input_alone_is_a_change_only_when_asked():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x, float[2] unused) => (float[2] y) { y = Relu(x) }
    """)
    assert not apply(model, "dce").records[0].changed
    result = apply(model, "dce(remove_unused_inputs=true)")
    assert result.records[0].changed
    assert [i.name for i in result.model.graph.input] == ["x"]


def test_nothing_dead_reports_unchanged():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y, float[2] z) { r = Relu(x)
          y = Neg(r)
          z = Exp(r) }
    """)
    result = apply(model, "dce")
    assert not result.records[0].changed
    assert result.records[0].delta == {}
    assert result.model == model


LOOP = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2] x, int64 n, float[2] unused) => (float[2] y) {
  cond = Constant<value = bool {1}>()
  y = Loop(n, cond, x) <body = body (int64 i, bool c, float[2] acc) => (bool c_out, float[2] acc_out) {
     c_out = Identity(c)
     dead = Neg(acc)
     acc_out = Relu(acc)
  }>
}
"""


def test_remove_unused_inputs_keeps_loop_body_signature():
    # regression: gs's cleanup(remove_unused_graph_inputs=True) recursed into the Loop body
    # and dropped its unused iteration-number input, which made the model invalid
    model = parse(LOOP)
    result = apply(model, "dce(remove_unused_inputs=true)")
    body = branch(result.model, "body", 1)
    assert [i.name for i in body.input] == ["i", "c", "acc"]
    assert op_list(body) == ["Identity", "Relu"]  # the body's dead Neg is gone
    assert [i.name for i in result.model.graph.input] == ["x", "n"]
    assert_same_outputs(model, result.model, feeds_for(model, seed=1) | {"n": np.array(3, np.int64)})


IF_MODEL = """
<ir_version: 10, opset_import: ["" : 18]>
g (bool c, float[2] x) => (float[2] y) {
  outer_dead = Sigmoid(x)
  y = If(c) <then_branch = g1 () => (float[2] r1) {
      [then_dead] d = Neg(x)
      [then_live] r1 = Relu(x)
  }, else_branch = g2 () => (float[2] r2) {
      [else_live] r2 = Exp(x)
  }>
}
"""


def test_dead_nodes_in_if_branches():
    model = parse(IF_MODEL)
    result = apply(model, "dce")
    assert result.records[0].changed
    assert result.records[0].delta == {"Neg": -1, "Sigmoid": -1}
    assert names(branch(result.model, "then_branch")) == ["then_live"]
    assert names(branch(result.model, "else_branch")) == ["else_live"]
    for cond in (True, False):
        feeds = feeds_for(model, seed=2) | {"c": np.array(cond)}
        assert_same_outputs(model, result.model, feeds)


def test_outer_tensor_read_only_by_a_subgraph_is_live():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (bool c, float[2] x) => (float[2] y) {
          t = Neg(x)
          y = If(c) <then_branch = g1 () => (float[2] r1) { r1 = Relu(t) },
                     else_branch = g2 () => (float[2] r2) { r2 = Exp(x) }>
        }
    """)
    result = apply(model, "dce")
    assert not result.records[0].changed
    assert op_list(result.model.graph) == ["Neg", "If"]


def test_dead_nodes_in_a_local_function():
    # regression: the change check ignored local functions, so this reported changed=False
    # and the PassManager kept the unchanged model
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
        g (float[2] x) => (float[2] y) { y = local.f(x) }
        <domain: "local", opset_import: ["" : 18]>
        f (a) => (b) {
          dead = Neg(a)
          b = Relu(a)
        }
    """)
    result = apply(model, "dce")
    assert result.records[0].changed
    assert op_list(result.model.functions[0]) == ["Relu"]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_pass_object_defaults():
    assert DeadCodeElimination().remove_unused_inputs is False
    assert DeadCodeElimination(remove_unused_inputs=True).spec() == "dce(remove_unused_inputs=true)"


def test_on_exported_cnn(tmp_path_factory):
    result = check_on_cnn(tmp_path_factory, "dce")
    assert not result.records[0].changed  # an export has no dead code
