"""The diff engine on real pairs: generic passes, autodiff, two opsets, renamed copies,
subgraphs, functions, initializer values; the JSON schema and determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from _diff_fixtures import (
    FOLDABLE,
    FUNCTION_MODEL,
    IF_MODEL,
    STATUS_A,
    STATUS_B,
    copy,
    export_norm_block,
    parse,
    perturb_initializer,
    set_attribute,
)

import graphforge
from graphforge.diff import SCHEMA_VERSION, assert_models_equal, diff_models, origin_of
from graphforge.diff.rename import rename_all
from graphforge.diff.source import open_side
from graphforge.errors import InvalidModelError
from graphforge.ir import op_histogram

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden_small_pair.json"
AUTODIFF = "loss(kind=cross_entropy, output={output}), autodiff"


def names(nodes) -> list[str]:
    return [n.name for n in nodes]


def ops(nodes) -> Counter:
    return Counter(n.op_type for n in nodes)


def histogram_delta(diff) -> dict[str, int]:
    return {c.op: c.b - c.a for c in diff.histogram}


def check_counts(diff) -> None:
    """Every node is matched, added or removed, exactly once."""
    g = diff.graph
    assert g.matched + len(g.removed) == g.nodes_a
    assert g.matched + len(g.added) == g.nodes_b


# --------------------------------------------------------------------------- generic passes


def test_dce_shows_the_dead_node_removed_and_nothing_else():
    before = models.dead_and_duplicate()
    diff = diff_models(before, graphforge.compile(before, "dce").model)
    check_counts(diff)
    assert ops(diff.graph.removed) == {"Neg": 1}
    assert not diff.graph.added and not diff.graph.changed
    assert histogram_delta(diff) == {"Neg": -1}


def test_cse_shows_one_relu_gone_and_the_add_reading_the_other():
    before = models.dead_and_duplicate()
    result = graphforge.compile(before, "cse")
    diff = diff_models(before, result.model)
    check_counts(diff)
    assert ops(diff.graph.removed) == {"Relu": 1}  # the Neg that was dead already is left for dce
    assert histogram_delta(diff) == result.records[0].delta
    (change,) = diff.graph.changed
    assert change.a.op_type == "Add" and change.fields == ["inputs"]
    (wiring,) = change.inputs
    assert wiring.slot == 1 and wiring.a["tensor"] == "b" and wiring.b["tensor"] == "a"


def test_identity_elimination_shows_the_chain_gone_and_relu_reading_x():
    before = models.identity_chain()
    diff = diff_models(before, graphforge.compile(before, "identity_elimination").model)
    check_counts(diff)
    assert ops(diff.graph.removed) == {"Identity": 3}
    (change,) = diff.graph.changed
    assert change.a.op_type == "Relu"
    assert change.inputs[0].a["from"] == "node" and change.inputs[0].b == {"tensor": "x", "from": "input"}
    (group,) = diff.graph.groups  # the chain is one region, replaced by nothing
    assert group.kind == "region" and len(group.a) == 3 and not group.b


def test_fold_constants_shows_a_region_replaced_by_one_constant():
    before = parse(FOLDABLE)
    diff = diff_models(before, graphforge.compile(before, "fold_constants").model)
    check_counts(diff)
    assert names(diff.graph.removed) == ["k", "sqrt", "two", "scale"]
    (group,) = diff.graph.groups
    assert ops(group.a) == {"Constant": 2, "Sqrt": 1, "Mul": 1} and ops(group.b) == {"Constant": 1}
    assert not diff.graph.changed  # Mul reads the replacement: the group says so, Mul did not change
    assert histogram_delta(diff) == {"Constant": -1, "Mul": -1, "Sqrt": -1}


def test_generic_pipeline_on_gpt2_agrees_with_the_pass_manager_counts(transformer_path):
    result = graphforge.compile(transformer_path, "identity_elimination, fold_constants, cse, dce")
    diff = diff_models(transformer_path, result.model)
    check_counts(diff)
    expected = Counter()
    for record in result.records:
        expected.update(record.delta)
    assert histogram_delta(diff) == {op: n for op, n in sorted(expected.items()) if n}
    removed = ops(diff.graph.removed) - ops(diff.graph.added)
    assert removed == Counter({op: -n for op, n in expected.items() if n < 0})


# --------------------------------------------------------------------------- autodiff


def test_autodiff_groups_every_gradient_node_with_its_forward_node(mlp_path):
    forward = graphforge.compile(mlp_path, "loss(kind=cross_entropy, output=y)").model
    trained = graphforge.compile(mlp_path, AUTODIFF.format(output="y")).model
    diff = diff_models(forward, trained)
    check_counts(diff)
    assert diff.graph.matched == len(forward.graph.node)  # the forward graph is all there
    assert not diff.graph.removed and not diff.graph.changed
    groups = diff.graph.groups
    assert {g.kind for g in groups} == {"origin"} and {g.role for g in groups} == {"grad"}
    assert sum(len(g.b) for g in groups) == len(diff.graph.added)  # every backward node grouped
    for group in groups:  # n:m: 1 forward node (in both models) -> its backward nodes
        assert group.anchor_a is not None and group.anchor_b is not None
        assert group.anchor_a.name == group.anchor_b.name == group.origin
        assert all(origin_of(n.name) == ("grad", group.origin) for n in group.b)
    gemms = {g.origin for g in groups if g.anchor_a.op_type == "Gemm"}
    assert gemms == {"/0/Gemm", "/2/Gemm", "/4/Gemm"}
    added_outputs = {c.b["name"] for c in diff.graph.outputs if c.status == "added"}
    assert added_outputs == {f"{p}_grad" for p in ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias")}


def test_autodiff_on_gpt2_matches_the_whole_forward_graph(transformer_path):
    forward = graphforge.compile(transformer_path, "loss(kind=cross_entropy, output=logits)").model
    trained = graphforge.compile(forward, "autodiff").model
    diff = diff_models(forward, trained)
    check_counts(diff)
    assert diff.graph.matched == len(forward.graph.node)
    assert not diff.graph.removed and not diff.graph.changed
    grouped = {n.index for g in diff.graph.groups if g.role == "grad" for n in g.b}
    assert grouped == {n.index for n in diff.graph.added}


def test_origin_names():
    assert origin_of("grad::/h.0/attn/MatMul/Mul_12") == ("grad", "/h.0/attn/MatMul")
    assert origin_of("loss::cross_entropy/LogSoftmax_1") == ("loss", "cross_entropy")
    assert origin_of("loss::output") == ("loss", None)
    assert origin_of("/h.0/attn/MatMul") is None
    assert origin_of("onnx::Add_3") is None  # a TorchScript tensor-style name, not an origin


# --------------------------------------------------------------------------- exports and renames


def test_two_opsets_of_one_module_match_and_compute_the_same(tmp_path):
    a = export_norm_block(tmp_path / "opset14.onnx", 14)
    b = export_norm_block(tmp_path / "opset17.onnx", 17)
    diff = diff_models(a, b, numeric=True)
    check_counts(diff)
    fields = {(f.field, f.key): (f.a, f.b) for f in diff.model}
    assert fields[("opset", "ai.onnx")] == (14, 17)
    (group,) = diff.graph.groups  # LayerNorm written out at 14, one LayerNormalization at 17
    assert group.kind == "region"
    assert ops(group.b) == {"LayerNormalization": 1}
    assert {"ReduceMean", "Sqrt", "Div"} <= set(ops(group.a))
    assert {n.op_type for n in diff.graph.removed + diff.graph.added} <= set(ops(group.a)) | {"LayerNormalization"}
    assert diff.numeric is not None and diff.numeric.first_divergence is None
    assert len(diff.numeric.tensors) == diff.graph.matched  # one output each


def test_renamed_copy_is_structurally_identical(transformer_path):
    original = graphforge.load(transformer_path)
    renamed = rename_all(original)
    diff = diff_models(original, renamed)
    assert diff.structurally_identical and not diff.identical
    g = diff.graph
    assert g.matched == g.nodes_a == g.nodes_b
    kinds = Counter(r.kind for r in g.renamed)
    assert kinds["node"] == len(original.graph.node)
    tensors = {t for n in original.graph.node for t in n.output if t}
    tensors |= {t.name for t in original.graph.initializer} | {v.name for v in original.graph.input}
    assert len(g.renamed) - kinds["node"] == len(tensors)
    assert_models_equal(original, renamed, structural=True)


def test_renamed_copy_with_one_changed_attribute_names_that_node(transformer_path):
    original = graphforge.load(transformer_path)
    norms = [n.name for n in original.graph.node if n.op_type == "LayerNormalization"]
    target = norms[len(norms) // 2]
    changed = rename_all(set_attribute(original, target, "epsilon", 1e-3))
    diff = diff_models(original, changed)
    assert not diff.structurally_identical
    (change,) = diff.graph.changed
    assert change.a.name == target and change.b.name.startswith("node_")
    assert change.fields == ["attributes"]
    (attr,) = change.attributes
    assert (attr.name, attr.a, attr.b) == ("epsilon", 1e-5, 1e-3)
    with pytest.raises(AssertionError, match=r"attribute epsilon: 1e-05 → 0\.001"):
        assert_models_equal(original, changed, structural=True)


def test_statuses_added_removed_changed():
    diff = diff_models(parse(STATUS_A), parse(STATUS_B))
    assert names(diff.graph.removed) == ["neg"] and names(diff.graph.added) == ["sig"]
    changed = {c.a.name: c for c in diff.graph.changed}
    assert set(changed) == {"leaky", "add"}
    assert [(a.name, a.a, a.b) for a in changed["leaky"].attributes] == [("alpha", 0.1, 0.2)]


# --------------------------------------------------------------------------- subgraphs and functions


def test_a_change_inside_an_if_branch_is_found_and_located():
    before = parse(IF_MODEL)
    after = parse(IF_MODEL.replace("t = Neg(z)", "t = Sigmoid(z)"))
    diff = diff_models(before, after)
    assert not diff.structurally_identical
    (change,) = diff.graph.changed
    assert change.a.op_type == "If" and change.fields == ["subgraphs"]
    (path,) = change.subgraphs
    assert path.endswith(".then_branch")
    branch = next(g for g in diff.all_graphs() if g.path == path)
    (inner,) = branch.changed
    assert (inner.a.op_type, inner.b.op_type, inner.fields) == ("Neg", "Sigmoid", ["op_type"])
    assert next(g for g in diff.all_graphs() if g.path.endswith(".else_branch")).identical
    assert histogram_delta(diff) == {"Neg": -1, "Sigmoid": 1}


def test_subgraphs_follow_the_enclosing_match_when_everything_is_renamed():
    before = parse(IF_MODEL)
    diff = diff_models(before, rename_all(before))
    assert diff.structurally_identical and not diff.identical
    assert len(diff.graph.subgraphs) == 2 and all(g.structurally_identical for g in diff.graph.subgraphs)


def test_a_change_in_a_local_function_body():
    before = parse(FUNCTION_MODEL)
    after = parse(FUNCTION_MODEL.replace("b = Relu(c)", "b = LeakyRelu<alpha = 0.2>(c)"))
    diff = diff_models(before, after)
    (function,) = diff.functions
    assert (function.domain, function.name, function.status, function.fields) == ("local", "twice", "changed", ["body"])
    (change,) = function.graph.changed
    assert (change.a.op_type, change.b.op_type) == ("Relu", "LeakyRelu")
    assert not diff.structurally_identical
    assert diff_models(before, copy(before)).identical


# --------------------------------------------------------------------------- values, inputs, sources


def test_changed_initializer_values_report_max_abs_and_rel(tmp_path):
    before = models.linear_model(64, 64)  # W holds 16 KiB: read from the file, not parsed
    after = perturb_initializer(before, "W", (3, 5), 0.25)
    path_a = graphforge.save(before, tmp_path / "a.onnx")
    path_b = graphforge.save(after, tmp_path / "b.onnx")
    assert open_side(path_a).stripped
    w = onnx.numpy_helper.to_array(before.graph.initializer[0])[3, 5]
    for a, b in ((path_a, path_b), (before, after), (before.SerializeToString(), after.SerializeToString())):
        diff = diff_models(a, b)
        assert diff.structurally_identical and not diff.identical
        (change,) = diff.graph.initializers
        assert change.status == "changed" and change.fields == ["values"] and change.a["name"] == "W"
        stats = change.values
        assert stats.differing == 1 and stats.elements == 64 * 64
        assert stats.max_abs == pytest.approx(0.25, rel=1e-6)
        assert stats.max_rel == pytest.approx(0.25 / max(abs(w), abs(w + 0.25)), rel=1e-5)
    text = diff.to_text()
    assert "initializer 'W': values differ in 1 of 4096 elements: max abs 0.25" in text


def test_input_shape_and_dtype_changes():
    before = models.dead_and_duplicate()
    after = copy(before)
    after.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 8
    after.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    diff = diff_models(before, after, allow_invalid=True)  # a double output of a float Add: invalid
    (inp,) = diff.graph.inputs
    assert inp.fields == ["shape"] and inp.a["shape"] == ["N", 4] and inp.b["shape"] == ["N", 8]
    (out,) = diff.graph.outputs
    assert out.fields == ["dtype"] and (out.a["dtype"], out.b["dtype"]) == ("float", "double")
    assert not diff.structurally_identical


def test_model_fields_and_metadata():
    before = models.dead_and_duplicate()
    after = copy(before)
    after.producer_name = "elsewhere"
    after.metadata_props.add(key="graphforge.loss", value="loss")
    diff = diff_models(before, after)
    assert diff.structurally_identical and not diff.identical
    assert [(f.field, f.key, f.a, f.b) for f in diff.model] == [
        ("producer_name", None, "", "elsewhere"),
        ("metadata", "graphforge.loss", None, "loss"),
    ]


def test_an_invalid_model_is_refused_unless_allowed_then_reported():
    """A cycle fails the checker: refused in one line naming it, or (allowed, as dump folders
    are, where a failed pass leaves its invalid input) diffed and reported invalid."""
    cyclic = models.cyclic_model()
    with pytest.raises(InvalidModelError, match=r"^<ModelProto>: not a valid ONNX model: .*topologically") as info:
        diff_models(cyclic, copy(cyclic))
    assert "\n" not in str(info.value)
    diff = diff_models(cyclic, copy(cyclic), allow_invalid=True)
    assert diff.identical and not diff.valid
    assert "topologically sorted" in diff.problems["a"] and "topologically sorted" in diff.problems["b"]
    report = diff.to_json()
    assert report["valid"] is False and report["problems"]["a"] == diff.problems["a"]
    assert "warning: a (<ModelProto>) is not a valid ONNX model: Nodes in a graph" in diff.to_text(brief=True)
    assert diff_models(parse(STATUS_A), parse(STATUS_A)).to_json()["valid"] is True


def test_a_name_nothing_defines_is_undefined_not_outer():
    before = parse(STATUS_A)
    broken = copy(before)
    broken.graph.node[1].input[0] = "nowhere"
    diff = diff_models(before, broken, allow_invalid=True)
    (change,) = diff.graph.changed
    (wiring,) = change.inputs
    assert wiring.b == {"tensor": "nowhere", "from": "undefined"}
    assert "'nowhere' (undefined)" in diff.to_text()


# --------------------------------------------------------------------------- JSON and determinism


def small_pair() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """One of everything: nodes added, removed and changed, initializers added and changed, a model field."""
    before = parse(STATUS_A)
    after = parse(STATUS_B)
    before.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1.0, 2.0, 4.0], np.float32), "scale"))
    after.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1.0, 2.5, 4.0], np.float32), "scale"))
    after.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(2, np.float32), "unused"))
    after.producer_name = "graphforge"
    return before, after


def test_json_matches_the_golden_file():
    """The schema is stable: a change to it must update docs/diff-json.md, the version, and this file
    (regenerate with GRAPHFORGE_UPDATE_GOLDEN=1)."""
    got = diff_models(*small_pair()).to_json()
    assert got["schema"] == "graphforge.diff" and got["version"] == SCHEMA_VERSION == 1
    text = json.dumps(got, indent=2, ensure_ascii=False) + "\n"
    if os.environ.get("GRAPHFORGE_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "JSON changed: see docs/diff-json.md; regenerate with GRAPHFORGE_UPDATE_GOLDEN=1"


def test_json_top_level_fields_are_documented(repo_root):
    doc = (repo_root / "docs" / "diff-json.md").read_text()
    got = diff_models(*small_pair()).to_json()
    for key in [*got, *got["graph"], *got["summary"]]:
        assert f"`{key}`" in doc, f"{key!r} is not documented in docs/diff-json.md"


_REPORT = """
import hashlib, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import graphforge
from graphforge.diff import diff_models
forward = graphforge.compile(sys.argv[3], "loss(kind=cross_entropy, output=y)").model
trained = graphforge.compile(forward, "autodiff").model
diff = diff_models(forward, trained)
print(hashlib.sha256(json.dumps(diff.to_json()).encode() + diff.to_text().encode()).hexdigest())
"""


def test_reports_are_byte_identical_across_processes_and_hash_seeds(mlp_path):
    digests = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "GRAPHFORGE_PROVIDERS": "cpu"}
        args = [sys.executable, "-c", _REPORT, str(HERE.parent), str(HERE), str(mlp_path)]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        digests.add(proc.stdout.strip())
    assert len(digests) == 1


def test_same_diff_twice_in_one_process_is_identical(transformer_path):
    forward = graphforge.load(transformer_path)
    renamed = rename_all(forward)
    first = diff_models(forward, renamed)
    second = diff_models(forward, renamed)
    assert first.to_text() == second.to_text()
    assert json.dumps(first.to_json()) == json.dumps(second.to_json())


def test_histogram_counts_subgraph_nodes_like_the_pass_manager():
    before = parse(IF_MODEL)
    after = parse(IF_MODEL.replace("e = Abs(z)", "e = Abs(z)\n f = Neg(e)").replace("(float[N] e) {", "(float[N] f) {"))
    diff = diff_models(before, after)
    counted = Counter(op_histogram(after))
    counted.subtract(op_histogram(before))
    assert histogram_delta(diff) == {op: n for op, n in counted.items() if n}


# --------------------------------------------------------------------------- value statistics


def _reference_stats(x: np.ndarray, y: np.ndarray) -> tuple[float, float, int]:
    """The definition, in float64 over whole tensors."""
    xs, ys = x.astype(np.float64).reshape(-1), y.astype(np.float64).reshape(-1)
    equal = (xs == ys) | (np.isnan(xs) & np.isnan(ys))
    if equal.all():
        return 0.0, 0.0, 0
    with np.errstate(all="ignore"):
        delta = np.where(equal, 0.0, np.abs(xs - ys))
        scale = np.maximum(np.abs(xs), np.abs(ys))
        rel = np.where(scale > 0, delta / np.where(scale > 0, scale, 1.0), 0.0)
    if np.isnan(delta).any():
        return float("nan"), float("nan"), int((~equal).sum())
    return float(delta.max()), float(rel.max()), int((~equal).sum())


@pytest.mark.parametrize(
    "dtype, size, edit",
    [
        (np.float32, 5_000_000, "scale"),  # threaded, every element differs
        (np.float32, 100_000, "nan"),  # a NaN against a number; NaN against NaN is equal
        (np.float32, 1000, "overflow"),  # the float32 difference overflows: redone in float64
        (np.float16, 70_000, "some"),
        (np.float64, 70_000, "some"),
        (np.int64, 70_000, "some"),
    ],
)
def test_value_stats_agree_with_the_float64_definition(dtype, size, edit):
    from graphforge.diff.stats import value_stats

    rng = np.random.default_rng(1)
    x = (rng.standard_normal(size) * 100).astype(dtype)
    y = x.copy()
    if edit == "scale":
        y = (x * 1.001).astype(dtype)
    elif edit == "nan":
        x[[10, 50_000]] = np.nan
        y[[50_000, 99_999]] = np.nan
    elif edit == "overflow":
        x[3], y[3] = 3e38, -3e38
    else:
        picked = rng.integers(0, size, 500)
        y[picked] = (rng.standard_normal(500) * 100).astype(dtype)
    got = value_stats(x, y)
    want = _reference_stats(x, y)
    assert got.differing == want[2] and got.elements == size
    np.testing.assert_allclose([got.max_abs, got.max_rel], want[:2], rtol=1e-6, equal_nan=True)


def test_float8_and_string_initializers_get_counts_not_nan():
    """float8 values are numbers (compared through float32); strings have no distance."""
    a = parse("""
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[4] x) => (float[4] y) { y = Identity(x) }
    """)
    a.graph.initializer.append(onnx.helper.make_tensor("f8", onnx.TensorProto.FLOAT8E4M3FN, [4], [1.0, 2.0, 3.0, 4.0]))
    a.graph.initializer.append(onnx.helper.make_tensor("s", onnx.TensorProto.STRING, [2], [b"a", b"b"]))
    b = copy(a)
    b.graph.initializer[0].CopyFrom(
        onnx.helper.make_tensor("f8", onnx.TensorProto.FLOAT8E4M3FN, [4], [1.0, 2.0, 3.0, 4.5])
    )
    b.graph.initializer[1].CopyFrom(onnx.helper.make_tensor("s", onnx.TensorProto.STRING, [2], [b"a", b"c"]))
    diff = diff_models(a, b)
    f8, s = diff.graph.initializers
    assert (f8.values.max_abs, f8.values.differing) == (0.5, 1)
    assert s.values.max_abs is None and s.values.max_rel is None and s.values.differing == 1
    text = diff.to_text()
    assert "initializer 's': values differ in 1 of 2 elements\n" in text and "nan" not in text
    assert s.to_json()["values"] == {"max_abs": None, "max_rel": None, "differing": 1, "elements": 2}


def test_weights_kept_in_the_file_are_read_without_a_copy(tmp_path):
    from graphforge.diff.source import tensor_array

    model = models.linear_model(64, 64)
    side = open_side(graphforge.save(model, tmp_path / "m.onnx"))
    assert side.stripped
    (position,) = [k for k, t in enumerate(side.proto.graph.initializer) if t.name == "W"]
    values = tensor_array(side, position, side.proto.graph.initializer[position])
    assert np.shares_memory(values, side.payload(position)) and not values.flags.writeable  # the read-only map
    np.testing.assert_array_equal(values, onnx.numpy_helper.to_array(model.graph.initializer[position]))


# --------------------------------------------------------------------------- attribute defaults

_DEFAULTS = """
<ir_version: 8, opset_import: ["" : 18, "custom" : 1]>
g (float[N, 4] x, float[4, 4] w) => (float[N, 4] y, float[N, 4] z) {
    [gemm] h = Gemm ATTRS_GEMM (x, w)
    [norm] y = LayerNormalization ATTRS_NORM (h, w)
    [mine] z = custom.Thing ATTRS_CUSTOM (h)
}
"""


def _defaults_model(gemm: str = "", norm: str = "", custom: str = "") -> onnx.ModelProto:
    text = _DEFAULTS.replace("ATTRS_GEMM", gemm).replace("ATTRS_NORM", norm).replace("ATTRS_CUSTOM", custom)
    return onnx.parser.parse_model(text.replace(" ()", "()").replace("  (", " ("))


def test_attributes_written_at_their_schema_default_are_no_change():
    """TorchScript leaves transA and stash_type out, the dynamo exporter writes them out: same node."""
    plain = _defaults_model()
    spelled = _defaults_model(gemm="<transA = 0, alpha = 1.0>", norm="<stash_type = 1, axis = -1>")
    diff = diff_models(plain, spelled)
    assert diff.identical, diff.to_text()


def test_a_value_other_than_the_default_shows_the_default_on_the_other_side():
    diff = diff_models(_defaults_model(), _defaults_model(gemm="<transB = 1>", custom="<k = 0>"))
    changes = {c.a.name: [(a.name, a.a, a.b) for a in c.attributes] for c in diff.graph.changed}
    assert changes == {"gemm": [("transB", 0, 1)], "mine": [("k", None, 0)]}  # custom ops: as written


# --------------------------------------------------------------------------- n:m groups with origins


def test_a_fusion_named_after_its_origin_is_one_group_of_two_to_one():
    from _diff_fixtures import FUSE_A, FUSE_B, named

    a = parse(FUSE_A)
    for name in ("fuse::mm/Gemm_1", "fuse::add/Gemm_1"):  # named after either fused node
        diff = diff_models(a, named(FUSE_B, GEMM=name))
        check_counts(diff)
        (group,) = diff.graph.groups
        assert (group.kind, group.role, group.origin) == ("origin", "fuse", name.split("::")[1].split("/")[0])
        assert names(group.a) == ["mm", "add"] and names(group.b) == [name]
        assert not diff.graph.changed  # Relu reads the fused output: the group says so
        assert "⇄ fuse:: nodes for" in diff.to_text() and "- Add" not in diff.to_text()


def test_a_recomputed_node_groups_its_copies_with_the_node_one_to_n():
    from _diff_fixtures import RECOMPUTE_A, RECOMPUTE_B, named

    diff = diff_models(
        parse(RECOMPUTE_A), named(RECOMPUTE_B, COPY_PRE="recompute::pre/Sigmoid_1", COPY_R="recompute::r/Tanh_1")
    )
    check_counts(diff)
    assert not diff.graph.removed and not diff.graph.changed  # use2 reads the copy of r: explained
    by_origin = {g.origin: g for g in diff.graph.groups}
    assert set(by_origin) == {"pre", "r"} and all(g.kind == "origin" for g in by_origin.values())
    for origin, copy_name in (("pre", "recompute::pre/Sigmoid_1"), ("r", "recompute::r/Tanh_1")):
        group = by_origin[origin]
        assert group.anchor_a.name == group.anchor_b.name == origin  # matched on both sides
        assert not group.a and names(group.b) == [copy_name]
