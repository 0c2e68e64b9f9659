"""Numeric mode: both models run on the same inputs; the first diverging tensor is named."""

from __future__ import annotations

import numpy as np
import pytest
from _diff_fixtures import constants_mid_graph, perturb_initializer, scale_constant

import graphforge
from graphforge.diff import diff_models
from graphforge.diff.numeric import DEFAULT_DIM
from graphforge.errors import GraphforgeError


def test_a_perturbed_constant_mid_graph_is_the_first_divergence(transformer_path):
    before = graphforge.load(transformer_path)
    target = constants_mid_graph(before)[0].name
    after = scale_constant(before, target, 1.5)
    diff = diff_models(before, after, numeric=True)
    (change,) = diff.graph.changed  # structurally: the constant's value attribute
    assert change.a.name == target and change.fields == ["attributes"]
    report = diff.numeric
    first = report.first_divergence
    assert first is not None and first.node.name == target and first.status == "differs"
    position = report.tensors.index(first)
    assert position > 0 and all(t.status == "same" for t in report.tensors[:position])
    assert first.stats.max_rel == pytest.approx(1 / 3, rel=1e-5)  # |x - 1.5x| / |1.5x|
    assert report.inputs["input_ids"]["generated"] and report.inputs["input_ids"]["shape"] == [DEFAULT_DIM] * 2
    assert "numeric: " in diff.to_text(brief=True) and repr(first.a) in diff.to_text(brief=True)


def test_a_perturbed_initializer_diverges_first_at_its_reader(mlp_path):
    before = graphforge.load(mlp_path)
    after = perturb_initializer(before, "2.bias", (3,), 0.5)
    diff = diff_models(before, after, numeric=True)
    first = diff.numeric.first_divergence
    assert first.node.name == "/2/Gemm" and first.stats.differing == DEFAULT_DIM  # one column, whole batch
    assert first.stats.max_abs == pytest.approx(0.5, rel=1e-5)
    statuses = [t.status for t in diff.numeric.tensors]
    assert statuses[0] == "same"  # /0/Gemm and /1/Relu do not read it


def test_given_inputs_are_used_and_identical_models_agree(mlp_path, tmp_path):
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    npz = tmp_path / "inputs.npz"
    np.savez(npz, x=x)
    for inputs in ({"x": x}, npz, str(npz)):
        diff = diff_models(mlp_path, mlp_path, inputs=inputs)
        report = diff.numeric
        assert report.inputs == {"x": {"dtype": "float32", "shape": [5, 16], "generated": False}}
        assert report.first_divergence is None and {t.status for t in report.tensors} == {"same"}
        assert len(report.tensors) == 5


def test_inputs_that_name_nothing_are_refused(mlp_path):
    with pytest.raises(GraphforgeError, match="'nope', which neither model reads"):
        diff_models(mlp_path, mlp_path, inputs={"nope": np.zeros(1)})


def test_a_missing_inputs_file_is_refused(mlp_path, tmp_path):
    with pytest.raises(GraphforgeError, match="no such inputs file"):
        diff_models(mlp_path, mlp_path, inputs=tmp_path / "missing.npz")


@pytest.mark.parametrize(
    "content, fragment",
    [(b"x = 1\n", "not an .npz file"), (b"\x93NUMPY\x01\x00", "a single .npy array has no input name")],
)
def test_an_inputs_file_that_is_not_an_npz_is_one_clear_line(mlp_path, tmp_path, content, fragment):
    path = tmp_path / "inputs.npz"
    path.write_bytes(content)
    with pytest.raises(GraphforgeError, match=fragment) as info:
        diff_models(mlp_path, mlp_path, inputs=path)
    assert "\n" not in str(info.value) and "pickle" not in str(info.value)


#: y = Relu(x) * w with a one-element x: at a negative x, w never shows
MASKED = """
<ir_version: 8, opset_import: ["" : 17]>
masked (float[1] x) => (float[4] y) <float[4] w = {1.0, 2.0, 3.0, 4.0}> {
    r = Relu(x)
    y = Mul(r, w)
}
"""


def _masked_pair():
    from _diff_fixtures import parse

    a = parse(MASKED)
    return a, perturb_initializer(a, "w", (2,), 1.0)


def test_a_weight_the_inputs_never_reach_is_a_warning_not_all_agree():
    a, b = _masked_pair()
    by_seed = {seed: diff_models(a, b, numeric=True, seed=seed).numeric for seed in range(8)}
    masked = [seed for seed, report in by_seed.items() if report.first_divergence is None]
    shown = [seed for seed, report in by_seed.items() if report.first_divergence is not None]
    assert masked and shown  # the seed decides: negative x masks w
    report = by_seed[masked[0]]
    assert report.seed == masked[0] and report.to_json()["seed"] == masked[0]
    assert report.warnings == [
        "initializer 'w' differs but no compared tensor does at these inputs; try other --seed/--inputs"
    ]
    text = diff_models(a, b, numeric=True, seed=masked[0]).to_text()
    assert "all 2 matched tensors agree at these inputs, but 1 changed initializer(s) never showed" in text
    assert "warning: initializer 'w' differs but no compared tensor does" in text
    assert by_seed[shown[0]].warnings == []


def test_dim_sizes_the_symbolic_dimensions_of_generated_inputs(mlp_path):
    diff = diff_models(mlp_path, mlp_path, numeric=True)
    (name,) = diff.numeric.dims  # the exporter's batch dimension
    assert diff.numeric.dims == {name: DEFAULT_DIM} and diff.numeric.inputs["x"]["shape"] == [DEFAULT_DIM, 16]
    report = diff_models(mlp_path, mlp_path, dims={name: 3}).numeric
    assert report.inputs["x"]["shape"] == [3, 16] and report.to_json()["dims"] == {name: 3}
    with pytest.raises(
        GraphforgeError,
        match=f"--dim nope: no input of either model has a dimension named 'nope' "
        rf"\(symbolic dimensions: {name}\)",
    ):
        diff_models(mlp_path, mlp_path, dims={"nope": 3})
