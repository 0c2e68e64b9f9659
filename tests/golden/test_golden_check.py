"""`graphforge golden check|update` on damaged copies of the shipped folder: every kind of
regression fails with exit 1 and a line naming model, pipeline and field; update records
and prints the change; expected failures that pass fail; bad input exits 2 with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from graphforge.passes import CommonSubexpressionElimination
from onnx import numpy_helper

from graphforge import PassResult, golden
from graphforge.golden import compare as golden_compare
from graphforge.golden import suite as golden_suite
from graphforge.golden.layout import read_expectation, write_expectation

GRAPHFORGE = Path(sys.executable).parent / "graphforge"


def _perturb_initializer(model_path: Path, name: str, delta: float) -> None:
    proto = onnx.load(model_path)
    tensor = next(t for t in proto.graph.initializer if t.name == name)
    array = numpy_helper.to_array(tensor).copy()
    array.flat[0] += delta
    tensor.CopyFrom(numpy_helper.from_array(array, name))
    onnx.save(proto, model_path)


def _rewrite_value(folder: Path, pipeline: str, name: str, change) -> None:
    expectation = read_expectation(folder, pipeline)
    value = next(v for v in expectation.values if v.name == name)
    value.array = change(value.array)
    write_expectation(folder, expectation)


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def _no_cse(monkeypatch) -> None:
    """A regression in a pass: CSE stops merging duplicates."""
    monkeypatch.setattr(CommonSubexpressionElimination, "run", lambda self, model: PassResult(model, False))


def test_perturbed_model_value_fails_every_case_that_sees_it(golden_copy, run_cli):
    folder = golden_copy("demo_mlp")
    _perturb_initializer(folder / "demo_mlp" / "model.onnx", "fc2.bias", 0.5)
    result = run_cli("golden", "check", folder)
    assert result.code == 1, result.out
    assert "demo_mlp / test_data: output 'logits' (test_data_set_0) value:" in result.out
    assert "demo_mlp / train: output 'fc2.bias_grad' (test_data_set_0) value:" in result.out
    assert "demo_mlp / cleanup: output 'logits' (test_data_set_0) value:" in result.out
    # values, not structure: the fingerprint leaves floating-point values to the numeric check
    assert "fingerprint" not in result.out
    assert result.out.rstrip().splitlines()[-1].startswith("FAILED")


def test_changed_pipeline_result_fails_with_structural_diff(golden_copy, run_cli, monkeypatch):
    folder = golden_copy("demo_mlp")
    _no_cse(monkeypatch)
    result = run_cli("golden", "check", folder, "--pipeline", "cleanup")
    assert result.code == 1, result.out
    assert "demo_mlp / cleanup: op_histogram:" in result.out
    assert "Relu 1 → 2 (+1)" in result.out
    assert "demo_mlp / cleanup: fingerprint:" in result.out
    assert "structural diff of demo_mlp / cleanup (recorded → now):" in result.out


def test_changed_pipeline_text_is_named(golden_copy, run_cli):
    folder = golden_copy("demo_mlp")
    _edit_json(
        folder / "demo_mlp" / "golden.json",
        lambda d: d["pipelines"].update(cleanup="identity_elimination, fold_constants, dce, topo_sort"),
    )
    result = run_cli("golden", "check", folder, "-p", "cleanup")
    assert result.code == 1
    assert "demo_mlp / cleanup: pipeline: golden.json runs 'identity_elimination, fold_constants, dce" in result.out


def test_wrong_dtype_fails(golden_copy, run_cli):
    folder = golden_copy("demo_mlp")
    _rewrite_value(folder / "demo_mlp", "train", "loss", lambda a: a.astype(np.float64))
    result = run_cli("golden", "check", folder, "-p", "train")
    assert result.code == 1
    assert "demo_mlp / train: output 'loss' (test_data_set_0) dtype: expected float64, got float32" in result.out


def test_wrong_shape_fails(golden_copy, run_cli):
    folder = golden_copy("demo_mlp")
    _rewrite_value(folder / "demo_mlp", "train", "fc1.bias_grad", lambda a: a.reshape(1, -1))
    result = run_cli("golden", "check", folder, "-p", "train")
    assert result.code == 1
    assert "demo_mlp / train: output 'fc1.bias_grad' (test_data_set_0) shape: expected [1, 32], got [32]" in result.out


def test_wrong_dtype_in_onnx_test_data_fails(golden_copy, run_cli):
    folder = golden_copy("demo_mlp")
    path = folder / "demo_mlp" / "test_data_set_0" / "output_0.pb"
    tensor = onnx.TensorProto()
    tensor.ParseFromString(path.read_bytes())
    path.write_bytes(
        numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), "logits").SerializeToString()
    )
    result = run_cli("golden", "check", folder, "-p", "test_data")
    assert result.code == 1
    assert "demo_mlp / test_data: output 'logits' (test_data_set_0) dtype: expected float64, got float32" in result.out


def test_update_records_prints_and_then_check_passes(golden_copy, run_cli, monkeypatch):
    folder = golden_copy("demo_mlp")
    expected = folder / "demo_mlp" / "expected"
    before = {p.name: p.read_bytes() for p in expected.iterdir()}
    _no_cse(monkeypatch)
    assert run_cli("golden", "check", folder).code == 1
    update = run_cli("golden", "update", folder)
    assert update.code == 0, update.out
    assert "updated   demo_mlp / cleanup" in update.out
    assert "demo_mlp / cleanup: op_histogram:" in update.out  # the diff it recorded
    assert "unchanged demo_mlp / train" in update.out  # CSE finds nothing there: not rewritten
    after = {p.name: p.read_bytes() for p in expected.iterdir()}
    assert after["train.json"] == before["train.json"] and after["train.npz"] == before["train.npz"]
    assert after["cleanup.json"] != before["cleanup.json"]
    check = run_cli("golden", "check", folder)
    assert check.code == 0, check.out
    # a forced rewrite of an unchanged result writes the same bytes
    assert run_cli("golden", "update", folder, "--force").code == 0
    assert {p.name: p.read_bytes() for p in expected.iterdir()} == after


def test_update_follows_renamed_pipelines(golden_copy, run_cli):
    folder = golden_copy("demo_mlp")
    _edit_json(folder / "demo_mlp" / "golden.json", lambda d: d["pipelines"].update(tidy=d["pipelines"].pop("cleanup")))
    check = run_cli("golden", "check", folder)
    assert check.code == 1
    assert "demo_mlp / tidy: expectations: none recorded" in check.out
    assert "demo_mlp / cleanup: expectations: expected/cleanup.json records a pipeline golden.json no longer has" in (
        check.out
    )
    update = run_cli("golden", "update", folder)
    assert update.code == 0, update.out
    assert "created   demo_mlp / tidy" in update.out and "removed   demo_mlp / cleanup" in update.out
    assert not (folder / "demo_mlp" / "expected" / "cleanup.json").exists()
    assert run_cli("golden", "check", folder).code == 0


def _expect_failure(folder: Path, model: str, *pipelines: str, reason: str = "tracked in issue 42") -> None:
    entries = [{"model": model, "pipeline": p, "reason": reason} for p in pipelines]
    (folder / "expected_failures.json").write_text(json.dumps({"expected_failures": entries}))


def test_expected_failure_that_fails_passes_the_check(golden_copy, run_cli, monkeypatch):
    folder = golden_copy("demo_mlp")
    _expect_failure(folder, "demo_mlp", "cleanup", "demo", reason="CSE is off until issue 42 is fixed")
    _no_cse(monkeypatch)
    result = run_cli("golden", "check", folder)
    assert result.code == 0, result.out
    assert "xfail     demo_mlp / cleanup  (expected to fail: CSE is off until issue 42 is fixed)" in result.out
    # update leaves it alone: recording the broken result would turn it into a pass
    update = run_cli("golden", "update", folder)
    assert update.code == 0 and "unchanged demo_mlp / train" in update.out
    assert run_cli("golden", "check", folder).code == 0


def test_unexpected_pass_fails(golden_copy, run_cli):
    folder = golden_copy("demo_mlp")
    _expect_failure(folder, "demo_mlp", "train")
    result = run_cli("golden", "check", folder)
    assert result.code == 1
    assert "XPASS     demo_mlp / train  (expected to fail: tracked in issue 42)" in result.out
    assert "demo_mlp / train: expected failure: it passes now: remove its entry from expected_failures.json" in (
        result.out
    )


def test_expected_failure_of_a_pipeline_that_does_not_compile(golden_copy, run_cli):
    folder = golden_copy("demo_mlp")
    _edit_json(
        folder / "demo_mlp" / "golden.json",
        lambda d: d["pipelines"].update(broken="loss(kind=cross_entropy, output=missing), autodiff"),
    )
    assert run_cli("golden", "check", folder, "-p", "broken").code == 1
    _expect_failure(folder, "demo_mlp", "broken", reason="no such output yet")
    result = run_cli("golden", "check", folder)
    assert result.code == 0, result.out
    assert "demo_mlp / broken: compile:" in result.out and "the model has no output 'missing'" in result.out
    assert run_cli("golden", "update", folder).code == 0
    assert not (folder / "demo_mlp" / "expected" / "broken.json").exists()
    # once it compiles, with nothing recorded, the entry must go: an unexpected pass
    _edit_json(
        folder / "demo_mlp" / "golden.json",
        lambda d: d["pipelines"].update(broken="loss(kind=cross_entropy, output=logits)"),
    )
    result = run_cli("golden", "check", folder)
    assert result.code == 1
    assert "demo_mlp / broken: expected failure: it compiles and runs now, with no expectations recorded" in result.out


def test_api_report(golden_copy, monkeypatch):
    folder = golden_copy("demo_mlp")
    _no_cse(monkeypatch)
    report = golden.check(folder, pipelines=["cleanup"])
    assert not report.ok
    (case,) = report.cases
    assert (case.model, case.pipeline, case.status) == ("demo_mlp", "cleanup", "FAIL")
    assert {p.field for p in case.problems} == {"op_histogram", "fingerprint"}
    assert case.diff


# --------------------------------------------------------------------------- bad input: exit 2


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x08\x96\x01 not what it should be \xff\xfe")


CORRUPTIONS = {
    "missing model.onnx": lambda f: (f / "demo_mlp" / "model.onnx").unlink(),
    "corrupt model.onnx": lambda f: _garbage(f / "demo_mlp" / "model.onnx"),
    "corrupt golden.json": lambda f: (f / "demo_mlp" / "golden.json").write_text("{ not json"),
    "unknown pass in golden.json": lambda f: _edit_json(
        f / "demo_mlp" / "golden.json", lambda d: d["pipelines"].update(cleanup="no_such_pass")
    ),
    "corrupt expectation json": lambda f: (f / "demo_mlp" / "expected" / "train.json").write_text("[1, 2"),
    "corrupt expectation values": lambda f: _garbage(f / "demo_mlp" / "expected" / "train.npz"),
    "corrupt test data": lambda f: _garbage(f / "demo_mlp" / "test_data_set_0" / "input_0.pb"),
    "corrupt expected-failure table": lambda f: (f / "expected_failures.json").write_text('{"expected_failures": [1]}'),
    "unknown model in expected-failure table": lambda f: _expect_failure(f, "no_such_model", "train"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.parametrize("command", ["check", "update"])
def test_bad_input_exits_2_with_one_line(golden_copy, run_cli, corruption, command):
    folder = golden_copy("demo_mlp")
    CORRUPTIONS[corruption](folder)
    result = run_cli("golden", command, folder)
    assert result.code == 2, (result.out, result.err)
    assert result.out == ""
    assert len(result.err.strip().splitlines()) == 1, result.err
    assert result.err.startswith("error: ") and str(folder) in result.err


def test_missing_or_empty_folder_exits_2(tmp_path, run_cli):
    result = run_cli("golden", "check", tmp_path / "nowhere")
    assert (result.code, result.err.strip()) == (2, f"error: {tmp_path / 'nowhere'}: no such folder")
    result = run_cli("golden", "check", tmp_path)
    assert result.code == 2 and "no golden models here" in result.err


def test_real_process_exit_codes(golden_copy):
    """The installed console script, as CI runs it: 0 when all pass, 2 with one line on bad input."""
    folder = golden_copy("demo_mlp")
    ok = subprocess.run([GRAPHFORGE, "golden", "check", folder], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stderr == ""  # onnxruntime's optimizer warnings are silenced
    _garbage(folder / "demo_mlp" / "expected" / "cleanup.npz")
    bad = subprocess.run([GRAPHFORGE, "golden", "check", folder], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1 and "cleanup.npz" in bad.stderr


def test_structural_diff_when_the_diff_engine_fails(golden_copy, monkeypatch):
    """Should the diff engine fail, the diff says so and lists the op signatures added and removed."""
    folder = golden_copy("demo_mlp")
    _no_cse(monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(golden_compare, "diff_models", broken)
    (case,) = golden.check(folder, pipelines=["cleanup"]).cases
    assert case.diff == (
        "(graphforge.diff failed: RuntimeError: boom; showing op signatures instead)\n"
        "nodes by op and attributes (- recorded, + now):\n+ Relu()  ×1"
    )


def test_expectation_with_an_unknown_stage_is_refused(golden_copy, run_cli):
    """An older checkout must not silently skip values a newer graphforge recorded."""
    folder = golden_copy("demo_mlp")
    expectation = read_expectation(folder / "demo_mlp", "train")
    expectation.values[0].stage = "distill_steps"
    write_expectation(folder / "demo_mlp", expectation)
    result = run_cli("golden", "check", folder)
    assert result.code == 2 and "records stage(s) distill_steps, which this graphforge does not know" in result.err


def test_a_wrong_optimizer_update_fails_the_training_stages(golden_copy, run_cli, monkeypatch):
    """The optimizer's arithmetic is checked too: one step more changes every trained
    parameter and the trained inference model's outputs, and nothing else."""
    folder = golden_copy("demo_mlp")
    monkeypatch.setattr(golden_suite, "TRAIN_STEPS", golden_suite.TRAIN_STEPS + 1)
    result = run_cli("golden", "check", folder)
    assert result.code == 1, result.out
    assert "demo_mlp / train_adamw: train_steps 'fc1.weight' (test_data_set_0) value:" in result.out
    assert "demo_mlp / train_adamw: inference_export 'logits' (test_data_set_0) value:" in result.out
    for unaffected in ("test_data", "cleanup", "train", "demo"):
        assert f"ok        demo_mlp / {unaffected}\n" in result.out
