"""``graphforge export``: the inference model with a checkpoint's trained values computes what
the trained program computes in eval mode; its errors are one line and write nothing."""

from __future__ import annotations

import _train_helpers as th
import numpy as np
import onnxruntime as ort
import pytest

import graphforge.train
from graphforge import CheckpointError, CheckpointState, Module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = th.workspace(tmp_path_factory.mktemp("export"))
    config = th.write_config(folder, th.base_config(train={"steps": 8}, checkpoint={"every": 4}))
    result = graphforge.train.run(config, out=folder / "run", quiet=True)
    # a second program (sgd) whose checkpoint does not fit the first one
    other = th.base_config(model={"pipeline": "loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.1)"})
    graphforge.train.run(th.write_config(folder, other, "sgd.toml"), out=folder / "sgd", steps=2, quiet=True)
    return folder, result


def test_export_equals_the_trained_programs_eval_forward(trained):
    folder, result = trained
    proc = th.cli("export", "run/program.onnx", "--checkpoint", "run", "-o", "model.onnx", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    assert (
        "wrote model.onnx (outputs: logits) with the values of run/checkpoints/checkpoint-00000008.safetensors (step 8)"
        in proc.stdout
    )
    for row in ("nodes", "inputs", "outputs", "stored tensors", "file"):
        assert row in proc.stdout
    x = np.random.default_rng(7).standard_normal((5, th.N_IN)).astype(np.float32)
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["x"] and [o.name for o in session.get_outputs()] == ["logits"]
    (exported,) = session.run(None, {"x": x})
    module = Module(result.program, CheckpointState.load(result.checkpoint), device="cpu").eval()
    _, expected = module(x, np.zeros(5, np.int64), outputs=["logits"])
    np.testing.assert_allclose(exported, expected, atol=1e-5)
    # the program's own (initial) values give another function: the checkpoint really was used
    report = graphforge.train.export(result.program, folder / "initial.onnx", outputs=["logits"])
    (initial,) = ort.InferenceSession(str(report.path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert report.checkpoint is None and not np.allclose(initial, exported)


def test_export_an_older_checkpoint_file(trained):
    folder, _ = trained
    report = graphforge.train.export(
        folder / "run/program.onnx",
        folder / "step4.onnx",
        checkpoint=folder / "run/checkpoints/checkpoint-00000004.safetensors",
    )
    assert report.step == 4 and report.outputs == ["logits"]
    assert report.exported_size.nodes < report.program_size.nodes and report.exported_bytes < report.program_bytes


def test_export_errors_are_one_line_and_write_nothing(trained):
    folder, _ = trained
    (folder / "empty").mkdir()
    cases = {
        "no program": (["export", "nope.onnx", "-o", "out.onnx"], ["nope.onnx"]),
        "no checkpoint": (
            ["export", "run/program.onnx", "--checkpoint", "empty", "-o", "out.onnx"],
            ["empty: no checkpoint in this folder"],
        ),
        "unknown output": (
            ["export", "run/program.onnx", "--output", "probs", "-o", "out.onnx"],
            ["no output 'probs'", "logits"],
        ),
        "other program": (
            ["export", "run/program.onnx", "--checkpoint", "sgd", "-o", "out.onnx"],
            ["does not match the program"],
        ),
    }
    done = th.cli_many({key: (args, folder) for key, (args, _) in cases.items()})
    for key, (_, fragments) in cases.items():
        th.assert_one_line_error(done[key], "error:", *fragments)
    assert not (folder / "out.onnx").exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_find_checkpoint_refuses_what_is_not_there(trained):
    folder, result = trained
    assert graphforge.train.find_checkpoint(folder / "run") == result.checkpoint
    assert graphforge.train.find_checkpoint(folder / "run/checkpoints") == result.checkpoint
    with pytest.raises(CheckpointError, match=r"gone.safetensors: no such checkpoint file or folder"):
        graphforge.train.export(result.program, folder / "x.onnx", checkpoint=folder / "gone.safetensors")
    assert not (folder / "x.onnx").exists()
