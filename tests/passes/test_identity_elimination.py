"""identity_elimination: pass-through nodes are bypassed; output names and non-no-ops stay."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _util import apply, assert_same_outputs, branch, check_on_cnn, feeds_for, names, op_list, ops, parse


def test_case1_internal_identity_is_bypassed():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,3] x) => (float[2,3] y) {
          [id1] a = Identity(x)
          [relu] b = Relu(a)
          [id2] c = Identity(b)
          [neg] y = Neg(c)
        }
    """)
    result = apply(model, "identity_elimination")
    (record,) = result.records
    assert record.changed
    assert record.delta == {"Identity": -2}
    assert names(result.model.graph) == ["relu", "neg"]
    assert [list(n.input) for n in result.model.graph.node] == [["x"], ["b"]]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_case3_identity_from_input_to_output_stays():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y) { y = Identity(x) }
    """)
    result = apply(model, "identity_elimination")
    assert not result.records[0].changed
    assert result.model == model


def test_case3_identity_from_initializer_to_output_stays():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y, float[2] w) <float[2] W = {1, 2}> {
          y = Relu(x)
          w = Identity(W)
        }
    """)
    assert not apply(model, "identity_elimination").records[0].changed


def test_case2_producer_writes_the_graph_output():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,3] x) => (float[2,3] y) {
          [relu] t = Relu(x)
          [id] y = Identity(t)
        }
    """)
    result = apply(model, "identity_elimination")
    assert result.records[0].delta == {"Identity": -1}
    (node,) = result.model.graph.node
    assert (node.name, list(node.output)) == ("relu", ["y"])
    assert [o.name for o in result.model.graph.output] == ["y"]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_case2_through_a_chain_of_identities():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y) {
          [relu] t = Relu(x)
          u = Identity(t)
          y = Identity(u)
        }
    """)
    result = apply(model, "identity_elimination")
    assert result.records[0].delta == {"Identity": -2}
    assert [(n.name, list(n.output)) for n in result.model.graph.node] == [("relu", ["y"])]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_case3_source_with_other_consumers_keeps_the_identity():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y, float[2] z) {
          t = Relu(x)
          y = Identity(t)
          z = Neg(t)
        }
    """)
    result = apply(model, "identity_elimination")
    assert not result.records[0].changed
    assert op_list(result.model.graph) == ["Relu", "Identity", "Neg"]


def test_two_outputs_of_one_tensor_keep_both_names():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y, float[2] z) {
          y = Relu(x)
          z = Identity(y)
        }
    """)
    assert not apply(model, "identity_elimination").records[0].changed


DROPOUT = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2,3] x, bool flag) => (float[2,3] y{outputs}) <float ratio = {{0.5}}, bool on = {{1}}, bool off = {{0}}> {{
  [dropout] d{mask} = Dropout({args})
  [relu] y = Relu(d)
}}
"""


@pytest.mark.parametrize(
    "args",
    ["x", "x, ratio", "x, ratio, off", "x, , off", "x, ratio, const_off"],
    ids=["no-ratio", "no-training-mode", "training-false", "omitted-ratio", "constant-node-false"],
)
def test_dropout_in_inference_mode_is_removed(args):
    text = DROPOUT.format(outputs="", mask="", args=args)
    if "const_off" in args:
        text = text.replace("  [dropout]", "  const_off = Constant<value = bool {0}>()\n  [dropout]")
    model = parse(text)
    result = apply(model, "identity_elimination")
    assert result.records[0].delta["Dropout"] == -1
    assert names(result.model.graph) == ["relu"]
    assert_same_outputs(model, result.model, feeds_for(model))


@pytest.mark.parametrize(
    ("args", "outputs", "mask"),
    [
        ("x, ratio, on", "", ""),  # training mode: it really drops
        ("x, ratio, flag", "", ""),  # decided at run time
        ("x", ", bool[2,3] m", ", m"),  # its mask is read
    ],
    ids=["training-true", "training-from-input", "mask-used"],
)
def test_dropout_that_may_drop_or_whose_mask_is_read_stays(args, outputs, mask):
    model = parse(DROPOUT.format(outputs=outputs, mask=mask, args=args))
    result = apply(model, "identity_elimination")
    assert not result.records[0].changed
    assert ops(result.model)["Dropout"] == 1


CAST = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2] x) => ({out}[2] y, float[2] z) {{
  [cast] c = Cast<to = {to}>(x)
  [relu] y = Relu(c)
  [to_bf16] h = Cast<to = 16>(x)
  [bf16_again] hc = Cast<to = 16>(h)
  [back] z = Cast<to = 1>(hc)
}}
"""


def cast_model(to: int, out: str) -> onnx.ModelProto:
    # shape inference records h's type (bfloat16), which the pass needs to see the no-op
    return onnx.shape_inference.infer_shapes(parse(CAST.format(to=to, out=out)), strict_mode=True)


def test_cast_to_the_type_the_input_has_is_removed():
    # also a regression: comparing types crashed on a bfloat16 tensor (gs keeps its type
    # as an ONNX enum, which NumPy cannot read)
    model = cast_model(1, "float")
    result = apply(model, "identity_elimination")
    assert result.records[0].delta == {"Cast": -2}
    assert names(result.model.graph) == ["relu", "to_bf16", "back"]
    assert [list(n.input) for n in result.model.graph.node] == [["x"], ["x"], ["h"]]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_cast_to_another_type_stays():
    model = cast_model(10, "float16")  # float -> float16
    result = apply(model, "identity_elimination")
    assert result.records[0].delta == {"Cast": -1}  # only the bfloat16 no-op
    assert {"cast", "to_bf16", "back"} <= set(names(result.model.graph))
    assert_same_outputs(model, result.model, feeds_for(model))


def test_cast_of_a_tensor_of_unknown_type_stays():
    # without value_info the type of r is unknown to the pass: it must not guess
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y) {
          r = Relu(x)
          c = Cast<to = 1>(r)
          y = Neg(c)
        }
    """)
    assert not apply(model, "identity_elimination").records[0].changed


def test_identity_transpose_is_removed_others_stay():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,3,4] x) => (float[2,3,4] y, float[4,3,2] z, float[4,3,2] w) {
          [same] a = Transpose<perm = [0, 1, 2]>(x)
          [relu] y = Relu(a)
          [swap] b = Transpose<perm = [2, 1, 0]>(x)
          z = Neg(b)
          [default] c = Transpose(x)
          w = Neg(c)
        }
    """)
    result = apply(model, "identity_elimination")
    assert result.records[0].delta == {"Transpose": -1}
    assert "same" not in names(result.model.graph)
    assert {"swap", "default"} <= set(names(result.model.graph))
    assert_same_outputs(model, result.model, feeds_for(model))


def test_reshape_to_the_same_static_shape_is_removed():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,3] x) => (float[2,3] y, float[3,2] z) <int64[2] same = {2, 3}, int64[2] other = {3, 2}> {
          r = Reshape(x, same)
          y = Relu(r)
          q = Reshape(x, other)
          z = Neg(q)
        }
    """)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)  # the pass needs r's shape
    result = apply(model, "identity_elimination")
    assert result.records[0].delta == {"Reshape": -1}
    assert_same_outputs(model, result.model, feeds_for(model))


IF_MODEL = """
<ir_version: 10, opset_import: ["" : 18]>
g (bool c, float[2] x) => (float[2] y) {
  y = If(c) <then_branch = g1 () => (float[2] r1) {
      [then_id] a = Identity(x)
      [then_relu] r1 = Relu(a)
  }, else_branch = g2 () => (float[2] r2) {
      [else_neg] n = Neg(x)
      [else_id] r2 = Identity(n)
  }>
}
"""


def test_inside_if_branches():
    model = parse(IF_MODEL)
    result = apply(model, "identity_elimination")
    assert result.records[0].delta == {"Identity": -2}
    then_branch, else_branch = branch(result.model, "then_branch"), branch(result.model, "else_branch")
    assert [(n.name, list(n.input)) for n in then_branch.node] == [("then_relu", ["x"])]
    # case 2 inside the branch: Neg now writes the branch output
    assert [(n.name, list(n.output)) for n in else_branch.node] == [("else_neg", ["r2"])]
    for cond in (True, False):
        assert_same_outputs(model, result.model, feeds_for(model, seed=4) | {"c": np.array(cond)})


def test_identity_read_by_a_subgraph_is_bypassed_there_too():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (bool c, float[2] x) => (float[2] y) {
          t = Identity(x)
          y = If(c) <then_branch = g1 () => (float[2] r1) { r1 = Relu(t) },
                     else_branch = g2 () => (float[2] r2) { r2 = Neg(t) }>
        }
    """)
    result = apply(model, "identity_elimination")
    assert result.records[0].delta == {"Identity": -1}
    assert list(branch(result.model, "then_branch").node[0].input) == ["x"]
    for cond in (True, False):
        assert_same_outputs(model, result.model, feeds_for(model, seed=5) | {"c": np.array(cond)})


def test_loop_body_pass_through_output_stays():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x, int64 n) => (float[2] y) {
          cond = Constant<value = bool {1}>()
          y = Loop(n, cond, x) <body = body (int64 i, bool c, float[2] acc) => (bool c_out, float[2] acc_out) {
             c_out = Identity(c)
             t = Identity(acc)
             acc_out = Sigmoid(t)
          }>
        }
    """)
    result = apply(model, "identity_elimination")
    assert result.records[0].delta == {"Identity": -1}
    assert op_list(branch(result.model, "body", 1)) == ["Identity", "Sigmoid"]
    assert_same_outputs(model, result.model, feeds_for(model) | {"n": np.array(3, np.int64)})


def test_inside_a_local_function():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
        g (float[2] x) => (float[2] y) { y = local.f(x) }
        <domain: "local", opset_import: ["" : 18]>
        f (a) => (b) {
          t = Identity(a)
          b = Relu(t)
        }
    """)
    result = apply(model, "identity_elimination")
    assert op_list(result.model.functions[0]) == ["Relu"]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_on_exported_cnn(tmp_path_factory):
    result = check_on_cnn(tmp_path_factory, "identity_elimination")
    assert ops(result.model)["Identity"] == 0


#: dead code (``Neg``) beside the no-ops, in the main graph, a branch and a local function
WITH_DEAD_CODE = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
g (bool c, float[2] x) => (float[2] y, float[2] z) {
  [dead] d = Neg(x)
  [id] a = Identity(x)
  [ratio] ratio = Constant<value_float = 0.5>()
  [mode] mode = Constant<value = bool {0}>()
  [drop] r = Dropout(a, ratio, mode)
  [call] y = local.f(r)
  [if] z = If(c) <then_branch = t () => (float[2] o) { dt = Neg(x)  i = Identity(x)  o = Relu(i) },
                  else_branch = e () => (float[2] o2) { o2 = Sigmoid(x) }>
}
<domain: "local", opset_import: ["" : 18]>
f (p) => (q) {
  df = Neg(p)
  t = Identity(p)
  q = Relu(t)
}
"""


def test_dead_code_it_did_not_make_is_left_for_dce():
    # regression: the pass ran a full cleanup, so the report blamed it for dce's work
    model = parse(WITH_DEAD_CODE)
    result = apply(model, "identity_elimination, dce")
    eliminated, dce = result.records
    # the Dropout's ratio and mode Constants go with it: only the Dropout read them
    assert eliminated.delta == {"Identity": -3, "Dropout": -1, "Constant": -2}
    assert dce.delta == {"Neg": -3}
    for cond in (True, False):
        assert_same_outputs(model, result.model, feeds_for(model, seed=6) | {"c": np.array(cond)})
