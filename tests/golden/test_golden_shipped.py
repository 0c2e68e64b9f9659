"""The shipped golden_models/ folder: it passes its own check, has the promised layout and
stays small; its builder still reproduces the model that needs no torch."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import onnx
from conftest import GOLDEN
from onnx import numpy_helper

from graphforge import golden
from graphforge.golden.layout import read_expectation

MODELS = {"demo_mlp", "squeezenet_mini", "gpt2_tiny", "dynamic_attention"}


def _builder():
    spec = importlib.util.spec_from_file_location("golden_build", GOLDEN / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_shipped_folder_passes():
    report = golden.check(GOLDEN)
    assert report.ok, report.to_text()
    cases = {(c.model, c.pipeline): c.status for c in report.cases}
    for model in MODELS:
        assert cases[(model, "test_data")] == "ok"
        assert cases[(model, "cleanup")] == "ok"
        assert cases[(model, "train")] == "ok"


def test_layout_is_the_onnx_test_directory_layout():
    for model in MODELS:
        folder = GOLDEN / model
        proto = onnx.load(folder / "model.onnx")
        data_sets = sorted(folder.glob("test_data_set_*"))
        assert data_sets, model
        for data_set in data_sets:
            inputs = sorted(data_set.glob("input_*.pb"))
            outputs = sorted(data_set.glob("output_*.pb"))
            initializers = {t.name for t in proto.graph.initializer}
            assert len(inputs) == len([v for v in proto.graph.input if v.name not in initializers])
            assert len(outputs) == len(proto.graph.output)
            first = onnx.TensorProto()
            first.ParseFromString(inputs[0].read_bytes())
            assert first.name == proto.graph.input[0].name


def test_dynamic_dims_stay_dynamic_in_every_program():
    """The golden programs keep the symbolic batch/sequence dims of their models."""
    for model in ("gpt2_tiny", "dynamic_attention"):
        for pipeline in ("cleanup", "train"):
            expectation = read_expectation(GOLDEN / model, pipeline)
            first_input = expectation.structure["inputs"][0]
            assert first_input["shape"][:2] == ["batch", "seq"], (model, pipeline, first_input)
    sets = {len(read_expectation(GOLDEN / "dynamic_attention", "train").values)}
    assert sets and len(list((GOLDEN / "dynamic_attention").glob("test_data_set_*"))) == 2


def test_train_expectations_hold_loss_and_every_gradient():
    for model in MODELS:
        expectation = read_expectation(GOLDEN / model, "train")
        metadata = expectation.structure["metadata"]
        gradients = json.loads(metadata["graphforge.gradients"])
        names = {v.name for v in expectation.values}
        assert "loss" in names
        assert set(gradients.values()) <= names, model
        assert len(gradients) == len(json.loads(metadata["graphforge.parameters"])), model


def test_folder_stays_small():
    size = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert size < 4 * 2**20, f"golden_models/ is {size / 2**20:.2f} MiB"


def test_builder_lists_every_shipped_model_and_reproduces_demo_mlp():
    builder = _builder()
    shipped = {p.parent.name for p in GOLDEN.glob("*/golden.json")}
    assert set(builder.MODELS) == shipped == MODELS
    assert builder.main(["--check", "demo_mlp"]) == 0


def test_expected_failure_table_is_shipped_and_valid():
    data = json.loads((GOLDEN / "expected_failures.json").read_text())
    assert isinstance(data["expected_failures"], list)


def test_builder_check_allows_rounding_in_expected_outputs_only(tmp_path):
    builder = _builder()
    values = np.array([1.0, -2.5, 3.25], np.float32)
    shipped = numpy_helper.from_array(values, "logits").SerializeToString()
    nudged = numpy_helper.from_array(np.nextafter(values, np.float32(np.inf)), "logits").SerializeToString()
    moved = numpy_helper.from_array(values + np.float32(1e-3), "logits").SerializeToString()
    for name in ("output_0.pb", "input_0.pb"):
        (tmp_path / name).write_bytes(shipped)
    assert builder._same_file(tmp_path / "output_0.pb", nudged)  # an ulp: another CPU's BLAS
    assert not builder._same_file(tmp_path / "output_0.pb", moved)
    assert not builder._same_file(tmp_path / "input_0.pb", nudged)  # inputs are exact
