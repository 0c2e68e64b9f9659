"""fold_constants: constant subcomputations become values; parameters, symbolic dims,
random ops and oversized results stay computations."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from _util import (
    apply,
    assert_same_outputs,
    branch,
    check_on_cnn,
    feeds_for,
    float_initializers,
    initializer_names,
    names,
    op_list,
    ops,
    parse,
    run_pass,
)
from graphforge.passes import FoldConstants
from graphforge.passes.fold_constants import may_fold

from graphforge.graph import Model
from graphforge.ort_compat import runtime_limits
from graphforge.shapes import infer_shapes

CHAIN = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2] x) => (float[2] y) {
  [k] k = Constant<value = float[2] {4.0, 9.0}>()
  [sqrt] s = Sqrt(k)
  [two] two = Constant<value_float = 2.0>()
  [scale] t = Mul(s, two)
  [mul] y = Mul(x, t)
}
"""


def test_folds_a_constant_chain_into_one_constant_node():
    model = parse(CHAIN)
    result = apply(model, "fold_constants")
    (record,) = result.records
    assert record.changed
    assert record.delta == {"Constant": -1, "Sqrt": -1, "Mul": -1}
    assert op_list(result.model.graph) == ["Constant", "Mul"]
    assert names(result.model.graph)[1] == "mul"
    (constant,) = [n for n in result.model.graph.node if n.op_type == "Constant"]
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(constant.attribute[0].t), [4.0, 6.0])
    # regression: gs made the folded value (and every Constant node) an initializer, which
    # training would take for a new parameter; value_float came out as float64
    assert float_initializers(result.model) == set()
    assert constant.attribute[0].t.data_type == onnx.TensorProto.FLOAT
    assert_same_outputs(model, result.model, feeds_for(model))


def test_constant_nodes_alone_are_no_change():
    # regression: gs lowered every Constant node to an initializer, reported as a change
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,3] x) => (float[3,2] y) {
          shape = Constant<value = int64[2] {3, 2}>()
          half = Constant<value_float = 0.5>()
          r = Reshape(x, shape)
          y = Mul(r, half)
        }
    """)
    result = apply(model, "fold_constants")
    assert not result.records[0].changed
    assert result.model == model


def test_integer_shape_arithmetic_folds_into_an_initializer():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,3] x) => (float[3,2] y) {
          a = Constant<value = int64[2] {1, 1}>()
          b = Constant<value = int64[2] {2, 1}>()
          shape = Add(a, b)
          [reshape] y = Reshape(x, shape)
        }
    """)
    result = apply(model, "fold_constants")
    assert result.records[0].delta == {"Add": -1, "Constant": -2}
    assert names(result.model.graph) == ["reshape"]
    assert initializer_names(result.model) == {"shape"}
    assert_same_outputs(model, result.model, feeds_for(model))


PARAMETER = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2,3] x) => (float[2,2] y) <float[2,3] W = {1,2,3,4,5,6}, int64[2] perm_shape = {3, 2}> {
  [transpose] t = Transpose<perm = [1, 0]>(W)
  [matmul] y = MatMul(x, t)
}
"""


def test_parameters_are_not_folded_by_default():
    model = parse(PARAMETER)
    result = apply(model, "fold_constants")
    assert not result.records[0].changed
    assert op_list(result.model.graph) == ["Transpose", "MatMul"]
    assert "W" in initializer_names(result.model)


def test_fold_parameters_folds_them():
    model = parse(PARAMETER)
    result = apply(model, "fold_constants(fold_parameters=true)")
    assert result.records[0].delta == {"Transpose": -1}
    assert names(result.model.graph) == ["matmul"]
    assert initializer_names(result.model) == {"t"}  # W^T replaced W
    assert_same_outputs(model, result.model, feeds_for(model))


def test_bfloat16_parameter_stays():
    # regression: telling parameters apart crashed on a bfloat16 initializer (gs keeps its
    # type as an ONNX enum, which NumPy cannot read)
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,3] x) => (float[2,2] y) <bfloat16[2,3] W = {16256, 16384, 16448, 16512, 16544, 16576}> {
          t = Transpose<perm = [1, 0]>(W)
          w = Cast<to = 1>(t)
          y = MatMul(x, w)
        }
    """)
    result = apply(model, "fold_constants")
    assert not result.records[0].changed
    (weight,) = result.model.graph.initializer
    assert weight.data_type == onnx.TensorProto.BFLOAT16
    assert_same_outputs(model, result.model, feeds_for(model))


DYNAMIC = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[N,3,4] x) => (float[N,12] y, int64[2] tail, int64[3] full) {
  s = Shape(x)
  i0 = Constant<value = int64 {0}>()
  i12 = Constant<value = int64[2] {1, 2}>()
  n = Gather<axis = 0>(s, i0)
  hw = Gather<axis = 0>(s, i12)
  st = Constant<value = int64[1] {1}>()
  en = Constant<value = int64[1] {3}>()
  tail = Slice(s, st, en)
  p = ReduceProd<keepdims = 1>(hw)
  n1 = Unsqueeze(n, i0)
  shp = Concat<axis = 0>(n1, p)
  y = Reshape(x, shp)
  full = Shape(x)
}
"""


def test_symbolic_dims_stay_dynamic_static_ones_fold():
    model = parse(DYNAMIC)
    result = apply(model, "fold_constants")
    # the static dims 3 and 4 fold (and their product); the batch dim N is still read at run time
    assert result.records[0].delta == {"Constant": -3, "Gather": -1, "ReduceProd": -1, "Slice": -1}
    assert ops(result.model)["Shape"] == 2 and ops(result.model)["Gather"] == 1
    assert result.model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    for batch in (2, 7):
        feeds = feeds_for(model, seed=batch, dims={"N": batch})
        assert_same_outputs(model, result.model, feeds)


def test_shape_start_and_end_are_respected():
    # regression: gs's shape folding ignored Shape's start/end and folded the full shape
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,3,4] x) => (int64[2] y, int64[1] z) {
          y = Shape<start = 1>(x)
          z = Shape<start = -2, end = -1>(x)
        }
    """)
    result = apply(model, "fold_constants")
    assert result.records[0].delta == {"Shape": -2}
    values = {t.name: onnx.numpy_helper.to_array(t).tolist() for t in result.model.graph.initializer}
    assert values == {"y": [3, 4], "z": [3]}
    assert_same_outputs(model, result.model, feeds_for(model))


def test_int_to_float_to_int_chains_are_not_rewritten_in_integers():
    # regression: gs's "cast elision" turned Cast(int->float) -> Mul(0.5) -> Cast(->int)
    # into an integer Mul by 0.5 cast to int, i.e. by 0
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (int64[3] x) => (int64[3] y) {
          half = Constant<value = float {0.5}>()
          f = Cast<to = 1>(x)
          h = Mul(f, half)
          y = Cast<to = 7>(h)
        }
    """)
    result = apply(model, "fold_constants")
    assert not result.records[0].changed
    assert_same_outputs(model, result.model, {"x": np.array([7, 8, -9], np.int64)})


BIG = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[1] x) => (float[1024,1024] y) {
  one = Constant<value = float {1.0}>()
  shape = Constant<value = int64[2] {1024, 1024}>()
  [expand] e = Expand(one, shape)
  [add] y = Add(x, e)
}
"""


def test_results_over_the_size_limit_stay_computations():
    model = parse(BIG)  # the Expand makes 4 MiB
    kept = apply(model, "fold_constants(size_limit_mb=1)")
    assert not kept.records[0].changed
    assert op_list(kept.model.graph) == ["Constant", "Constant", "Expand", "Add"]
    folded = apply(model, "fold_constants(size_limit_mb=8)")
    assert folded.records[0].delta == {"Expand": -1, "Constant": -1}
    assert_same_outputs(model, folded.model, feeds_for(model))


def test_huge_expand_is_not_even_evaluated():
    # 4 TB: evaluating it would fail (or take the machine's memory); it is refused up front,
    # and the small fold beside it still happens
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y, float z) {
          one = Constant<value = float {1.0}>()
          shape = Constant<value = int64[3] {100000, 100000, 100}>()
          e = Expand(one, shape)
          z = ReduceSum<keepdims = 0>(e)
          k = Constant<value = float[2] {4, 9}>()
          r = Sqrt(k)
          y = Mul(x, r)
        }
    """)
    start = time.perf_counter()
    result = apply(model, "fold_constants")
    assert time.perf_counter() - start < 10
    assert result.records[0].delta == {"Sqrt": -1}
    assert ops(result.model)["Expand"] == 1 and ops(result.model)["ReduceSum"] == 1


@pytest.mark.parametrize(
    "random",
    ["RandomNormal<shape = [2]>()", "RandomUniform<shape = [2]>()", "RandomUniformLike(k)", "Bernoulli(p)"],
    ids=["RandomNormal", "RandomUniform", "RandomUniformLike", "Bernoulli"],
)
def test_random_ops_are_never_folded(random):
    model = parse(f"""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y) {{
          k = Constant<value = float[2] {{1, 2}}>()
          p = Constant<value = float[2] {{0.5, 0.5}}>()
          r = {random}
          s = Add(r, k)
          u = Mul(s, p)
          y = Add(x, u)
        }}
    """)
    result = apply(model, "fold_constants")
    assert not result.records[0].changed
    assert ops(result.model) == ops(model)


IF_MODEL = """
<ir_version: 10, opset_import: ["" : 18]>
g (bool c, float[2] x) => (float[2] y) {
  k = Constant<value_floats = [1.0, 4.0]>()
  y = If(c) <then_branch = g1 () => (float[2] r1) {
      [then_random] q = RandomNormal<shape = [2]>()
      [then_scale] q2 = Mul(q, k)
      [then_add] r1 = Add(q2, x)
  }, else_branch = g2 () => (float[2] r2) {
      [else_sqrt] s = Sqrt(k)
      [else_two] two = Constant<value = float {2.0}>()
      [else_scale] s2 = Mul(s, two)
      [else_mul] r2 = Mul(s2, x)
  }>
}
"""


def test_folds_inside_if_branches_but_never_random_ops():
    # regression: subgraphs were evaluated with a newer IR version than onnxruntime reads,
    # so nothing in a branch folded; and gs did not pass the random-op exclusion down
    model = parse(IF_MODEL)
    result = apply(model, "fold_constants")
    assert result.records[0].delta == {"Sqrt": -1, "Mul": -1}  # two Constants became one
    assert names(branch(result.model, "then_branch", 1)) == ["then_random", "then_scale", "then_add"]
    else_branch = branch(result.model, "else_branch", 1)
    assert op_list(else_branch) == ["Constant", "Mul"]
    assert names(else_branch)[1] == "else_mul"
    assert float_initializers(result.model) == set()
    assert_same_outputs(model, result.model, feeds_for(model) | {"c": np.array(False)})


def test_folds_inside_a_local_function():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
        g (float[2] x) => (float[2] y) { y = local.f(x) }
        <domain: "local", opset_import: ["" : 18]>
        f (a) => (b) {
          two = Constant<value_float = 2.0>()
          s = Sqrt(two)
          b = Mul(a, s)
        }
    """)
    result = apply(model, "fold_constants")
    assert result.records[0].delta == {"Sqrt": -1}
    assert op_list(result.model.functions[0]) == ["Constant", "Mul"]
    assert_same_outputs(model, result.model, feeds_for(model))


MULTI_OUTPUT = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
g (float[2] x) => (float[2] y) {
  a = local.f(x)
  y = local.h(a)
}
<domain: "local", opset_import: ["" : 18]>
f (p) => (q) {
  k = Constant<value = float[3] {3, 1, 2}>()
  two = Constant<value = int64[1] {2}>()
  values, indices = TopK(k, two)
  as_float = Cast<to = 1>(indices)
  scaled = Mul(p, values)
  q = Add(scaled, as_float)
}
<domain: "local", opset_import: ["" : 18]>
h (p) => (q) {
  k = Constant<value = float[2] {4, 9}>()
  r = Sqrt(k)
  q = Mul(p, r)
}
"""


def test_node_with_outputs_folded_separately_goes_away_whole():
    # TopK's values are folded on their own; its indices only through the Cast. The TopK
    # short of one output must not linger (its outputs would shift) while h is folded next.
    model = parse(MULTI_OUTPUT)
    result = apply(model, "fold_constants")
    assert result.records[0].delta == {"TopK": -1, "Cast": -1, "Sqrt": -1}
    assert [op_list(f) for f in result.model.functions] == [["Constant", "Constant", "Mul", "Add"], ["Constant", "Mul"]]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_folded_graph_output_keeps_its_name():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y, float[2] z) {
          k = Constant<value = float[2] {4, 16}>()
          z = Sqrt(k)
          y = Relu(x)
        }
    """)
    result = apply(model, "fold_constants")
    assert result.records[0].delta == {"Sqrt": -1}
    assert [o.name for o in result.model.graph.output] == ["y", "z"]
    assert_same_outputs(model, result.model, feeds_for(model))


def test_removes_dead_nodes_like_dce():
    model = parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2] x) => (float[2] y) {
          dead = Neg(x)
          y = Relu(x)
        }
    """)
    result = apply(model, "fold_constants")
    assert result.records[0].delta == {"Neg": -1}


def test_on_exported_cnn(tmp_path_factory):
    result = check_on_cnn(tmp_path_factory, "fold_constants")
    # only the integer arithmetic of the flattening reshape folds; nothing touches a parameter
    assert set(result.records[0].delta) <= {"Constant", "Unsqueeze"}
    assert ops(result.model)["Shape"] == 1  # the batch dim is still read at run time


#: a folded Unsqueeze that onnxruntime's UnsqueezeElimination warns about in the evaluation session
SHARED_UNSQUEEZE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 4, 4] y, float[4, 1] z) {
  c = Constant <value = float[4] {1.0, 2.0, 3.0, 4.0}> ()
  axes = Constant <value = int64[1] {1}> ()
  u = Unsqueeze(c, axes)
  v = Unsqueeze(c, axes)
  z = Add(u, v)
  xx = Unsqueeze(x, axes)
  w = Unsqueeze(c, axes)
  y = Add(xx, w)
}
"""


def test_evaluation_sessions_print_no_optimizer_warnings(capfd):
    import onnxruntime

    session_class = onnxruntime.InferenceSession
    model = parse(SHARED_UNSQUEEZE)
    capfd.readouterr()
    result = apply(model, "fold_constants")
    assert result.records[0].changed
    out, err = capfd.readouterr()
    assert "onnxruntime" not in out + err, err  # e.g. "[W:onnxruntime:, unsqueeze_elimination.cc:24 ..."
    assert onnxruntime.InferenceSession is session_class, "sessions created after folding are left alone"
    assert_same_outputs(model, result.model, feeds_for(model))


def test_folds_a_model_of_an_opset_newer_than_onnxruntime_reads():
    # regression: gs evaluated opset 28 (onnx 1.23's default) as it was, onnxruntime 1.31 reads
    # at most 26, and the refusal was swallowed: nothing folded, and the pass reported success
    model = parse("""
        <ir_version: 11, opset_import: ["" : 28, "local" : 1]>
        g (bool c, float[2] x) => (float[2] y, float[2] z) {
          k = Constant<value = float[2] {4.0, 9.0}>()
          s = Sqrt(k)
          m = Mul(x, s)
          y = local.f(m)
          z = If(c) <then_branch = t () => (float[2] o) { k2 = Constant<value = float[2] {1.0, 4.0}>()  r = Sqrt(k2)  o = Add(x, r) },
                     else_branch = e () => (float[2] o2) { o2 = Neg(x) }>
        }
        <domain: "local", opset_import: ["" : 28]>
        f (a) => (b) {
          two = Constant<value_float = 2.0>()
          r = Sqrt(two)
          b = Mul(a, r)
        }
    """)
    result = apply(model, "fold_constants")
    (record,) = result.records
    assert record.delta == {"Sqrt": -3} and record.note == ""
    assert [(o.domain, o.version) for o in result.model.opset_import] == [
        ("", 28),
        ("local", 1),
    ]  # only evaluated lower
    for cond in (True, False):
        assert_same_outputs(model, result.model, feeds_for(model) | {"c": np.array(cond)})


UNEVALUABLE = {
    "an op onnxruntime lacks": (
        '["" : 18, "com.example" : 1]',
        "s = com.example.Foo(k)",
        "com.example:Foo(-1) is not a registered function/op",
    ),
    "an opset onnxruntime cannot be given": (
        '["" : 28]',
        "s = SwiGLU(k, k)",
        "the model uses ai.onnx opset 28, onnxruntime reads at most",
    ),
}


@pytest.mark.parametrize("case", UNEVALUABLE)
def test_constants_that_cannot_be_evaluated_are_reported_in_the_note(case):
    opsets, node, reason = UNEVALUABLE[case]
    if "28" in opsets and runtime_limits()[1] >= 28:
        pytest.skip("onnxruntime reads opset 28: SwiGLU needs no conversion")
    model = parse(
        f"""
        <ir_version: 10, opset_import: {opsets}>
        g (float[2, 4] x) => (float[2, 4] y) {{
          k = Constant<value = float[2, 4] {{1, 2, 3, 4, 5, 6, 7, 8}}>()
          {node}
          y = Mul(x, s)
        }}
        """,
        check=False,
    )
    result, proto = run_pass(model, FoldConstants())
    assert not result.changed and op_list(proto.graph) == op_list(model.graph)
    assert result.note.startswith("the constants of graph 'g' were left unevaluated (")
    assert reason in result.note and "\n" not in result.note


@pytest.mark.parametrize(
    ("text", "limit_mb", "expected"),
    [
        (CHAIN, 16, True),  # a constant chain
        (PARAMETER, 16, False),  # its only constant input is a parameter
        (DYNAMIC, 16, True),  # Shape nodes
        (BIG, 1, False),  # the Expand is known to be too big
        (BIG, 8, True),
        (IF_MODEL, 16, True),  # the else branch's Sqrt of an outer Constant
        (MULTI_OUTPUT, 16, True),
    ],
    ids=["chain", "parameter", "shapes", "too-big", "big-enough", "if-branch", "multi-output"],
)
def test_may_fold_says_false_only_where_a_fold_changes_nothing(text, limit_mb, expected):
    """The specialize pass stops its rounds on ``may_fold``'s False: it must never miss a
    fold (checked before and after one fold of each model); after the fold, only a model
    with symbolic Shape nodes left still says True."""
    model = parse(text)
    assert may_fold(infer_shapes(Model.from_proto(model)), limit_mb) is expected
    folded = FoldConstants(size_limit_mb=limit_mb).run(Model.from_proto(model))
    assert folded.changed is expected
    again = FoldConstants(size_limit_mb=limit_mb).run(Model.from_proto(folded.model.to_proto()))
    assert not again.changed
    assert may_fold(infer_shapes(Model.from_proto(folded.model.to_proto())), limit_mb) is (text is DYNAMIC)
