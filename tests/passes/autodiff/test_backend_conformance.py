"""Gradient conformance on every case of onnx's backend node tests (tests/passes/autodiff/conformance.py
has the method): each case matches central differences in float64, or is refused with a clear
error, or is skipped for a stated reason; never a mismatch, never an internal error. Each outcome
must be the one docs/ops-conformance.json records (and docs/ops.md reports), so the report
cannot drift: run ``python tests/passes/autodiff/conformance.py`` to record a change."""

from __future__ import annotations

import json

import conformance
import onnx
import onnxruntime as ort
import pytest

RECORDED = json.loads(conformance.RESULTS.read_text())
#: statuses are compared only against what the same onnx and onnxruntime recorded: another
#: version brings other cases and kernels (every case must still be ok)
SAME_VERSIONS = (RECORDED["onnx"], RECORDED["onnxruntime"]) == (onnx.__version__, ort.__version__)


#: the cases whose oracle is onnx's reference evaluator over a [1, 3, 32, 32, 32] input, a
#: few Python-looped runs of 2.5 s each: 20 s a case, a fortieth of the suite for two cases
#: (and 10 s more for every test process that collects them, where onnx makes their data).
#: ``make conformance`` checks them with every other case; here their recorded outcome is
#: held to (test_the_slowest_cases_stay_recorded_as_matched), and the other 3-D pooling
#: cases (dilations, pads, ceil mode; smaller inputs) run
FULL_RUN_ONLY = ("test_averagepool_3d_default", "test_lppool_3d_default")


@pytest.mark.parametrize("name", sorted(conformance.cases(without=FULL_RUN_ONLY)))
def test_backend_node_case(name):
    outcome = conformance.check_case(name)
    assert outcome.ok, f"{outcome.status}: {outcome.reason}"
    if SAME_VERSIONS:
        recorded = RECORDED["cases"].get(name)
        assert recorded is not None, f"not recorded; run {conformance.COMMAND}"
        assert (outcome.status, conformance.short(outcome.reason) if outcome.status != "matched" else "") == (
            recorded["status"],
            recorded.get("reason", ""),
        ), f"the recorded outcome changed; run {conformance.COMMAND} and review docs/ops.md"


def test_every_recorded_case_still_exists():
    if not SAME_VERSIONS:
        pytest.skip(f"recorded with onnx {RECORDED['onnx']}, onnxruntime {RECORDED['onnxruntime']}")
    assert set(RECORDED["cases"]) == set(conformance.cases(without=FULL_RUN_ONLY)) | set(FULL_RUN_ONLY)


def test_the_slowest_cases_stay_recorded_as_matched():
    """(Not even made here: onnx computes their expected outputs as it collects them; onnx must
    still define them.)"""
    conformance.cases(without=FULL_RUN_ONLY)
    for name in FULL_RUN_ONLY:
        assert conformance.defines(name), name
        assert RECORDED["cases"][name]["status"] == "matched", name


def test_the_bugs_the_conformance_run_found_stay_fixed():
    """The issue's three (Swish through its function body, 3-D MaxPool with dilations, LSTM
    without Y) and what the first full run found (RMSNormalization, LayerNormalization's
    statistics outputs, Clip's bounds, Pad's value, a zero-size Reshape)."""
    for name in (
        "test_swish",
        "test_maxpool_3d_dilations",
        "test_lstm_defaults",
        "test_lstm_with_initial_bias",
        "test_lstm_with_peepholes",
        "test_rms_normalization_2d_axis0",
        "test_layer_normalization_2d_axis0",
        "test_clip",
        "test_clip_min_greater_than_max",
        "test_constant_pad",
        "test_reshape_zero_dim",
    ):
        outcome = conformance.check_case(name, coordinates=64)
        assert outcome.status == "matched" and outcome.checked > 0, (name, outcome.status, outcome.reason)


def test_the_oracle_refuses_an_evaluator_computing_in_float32():
    """onnx's reference Erf computes in float32 whatever its input: its float64 copy is no
    float64 oracle, and the case falls back to onnxruntime in the model's own type."""
    outcome = conformance.check_case("test_erf")
    assert outcome.status == "matched" and outcome.oracle == "onnxruntime"


def test_a_rules_setting_without_gradient_is_reported_not_compared():
    outcome = conformance.check_case("test_batchnorm_example")
    assert outcome.status == "matched"
    assert [note.split(":")[0] for note in outcome.by_design] == ["input mean", "input var"]
