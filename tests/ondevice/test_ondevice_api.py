"""graphforge.ondevice as onnxruntime-training's on-device API: a script written for it runs
with its import lines changed and gives the losses onnxruntime-training 1.19.2 gave (recorded
by record_ort_losses.py: ort_1.19.2_losses.json); the classes' other methods do what
onnxruntime-training's do, on graphforge's artifacts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import graphforge
from graphforge import artifacts
from graphforge.errors import GraphforgeError
from graphforge.ondevice import CheckpointState, LinearLRScheduler, Module, Optimizer
from graphforge.ondevice.manifest import ManifestError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DIGITS = REPO / "examples" / "digits" / "model.onnx"
DATA = np.load(REPO / "data" / "digits" / "train.npz")
RECORD = json.loads((HERE / "ort_1.19.2_losses.json").read_text())


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_an_onnxruntime_training_script_gives_its_losses(tmp_path, kind):
    """ort_style_training.py (TrainStep, OptimizerStep, LazyResetGrad, a LinearLRScheduler and
    an EvalStep an epoch) on graphforge: every loss within float32 rounding of onnxruntime-training
    1.19.2's on the same model and batches, the evaluations and the last rate equal."""
    done = subprocess.run(
        [sys.executable, str(HERE / "ort_style_training.py"), str(tmp_path / kind), kind],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = json.loads(done.stdout.strip().splitlines()[-1]), RECORD["runs"][kind]
    assert len(ours["losses"]) == len(theirs["losses"]) == 30
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=2e-6)
    np.testing.assert_allclose(ours["eval_losses"], theirs["eval_losses"], rtol=2e-6)
    assert ours["learning_rate"] == theirs["learning_rate"]


@pytest.fixture
def session(tmp_path):
    model = onnx.load(DIGITS)
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
        artifact_directory=tmp_path, additional_output_names=["logits"],
    )  # fmt: skip
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    return tmp_path, state, module, Optimizer(tmp_path / "optimizer_model.onnx", module)


def test_gradients_accumulate_until_lazy_reset_grad(session):
    """Two calls then a step update with the sum of both batches' gradients: the step a
    Module on the doubled batch takes (the loss is a mean, so each half's gradient is half)."""
    _folder, state, module, optimizer = session
    x, y = DATA["images"][:16], DATA["labels"][:16]
    module(x[:8], y[:8])
    module(x[8:], y[8:])
    accumulated = state.parameters["fc1.weight"].grad.copy()
    module.lazy_reset_grad()
    module(x, y)
    np.testing.assert_allclose(state.parameters["fc1.weight"].grad * 2, accumulated, rtol=1e-5, atol=1e-7)
    before = state.parameters["fc1.weight"].data.copy()
    optimizer.set_learning_rate(0.5)
    optimizer.step()
    np.testing.assert_array_equal(
        state.parameters["fc1.weight"].data, (before - np.float32(0.5) * state.parameters["fc1.weight"].grad)
    )
    assert state._state.step == 1 and optimizer.get_learning_rate() == 0.5


def test_outputs_names_and_eval(session):
    _folder, state, module, _optimizer = session
    x, y = DATA["images"][:8], DATA["labels"][:8]
    _loss, logits = module(x, y)
    assert logits.shape == (8, 10) and module.input_names() == ["images", "labels"]
    assert module.output_names() == ["loss", "logits"]
    module.eval()
    _eval_loss, eval_logits = module(x, y)
    np.testing.assert_allclose(eval_logits, logits, rtol=1e-6)  # (no dropout or BatchNorm here)
    assert state._state.step == 0  # evaluation touches no state


def test_parameters_buffers_and_the_exported_model(session, tmp_path):
    """A parameter's data and grad; the contiguous parameters as federated averaging uses
    them (round trip); export_model_for_inferencing with the current weights."""
    folder, state, module, _optimizer = session
    assert list(state.parameters) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert all(state.parameters[n].requires_grad for n in state.parameters)
    flat = module.get_contiguous_parameters()
    assert flat.shape == (module.get_parameters_size(),) == (64 * 64 + 64 + 10 * 64 + 10,)
    module.copy_buffer_to_parameters(flat * 2)
    np.testing.assert_array_equal(state.parameters["fc2.bias"].data, flat[-10:] * 2)
    with pytest.raises(GraphforgeError, match="the parameters hold 4810 elements, the buffer 3"):
        module.copy_buffer_to_parameters(np.zeros(3, np.float32))
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["logits"])
    x = DATA["images"][:4]
    (logits,) = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"images": x}
    )
    module.eval()
    np.testing.assert_allclose(module(x, DATA["labels"][:4])[1], logits, rtol=1e-6)
    CheckpointState.save_checkpoint(state, folder / "saved")
    again = CheckpointState.load_checkpoint(folder / "saved")
    np.testing.assert_array_equal(again.parameters["fc1.weight"].data, state.parameters["fc1.weight"].data)


def test_the_linear_schedule_as_onnxruntime_training_computes_it(session):
    """onnxruntime-training's Python class swaps its two counts (see LinearLRScheduler);
    as_documented=True warms up for warmup_step_count steps."""
    _folder, state, _module, optimizer = session
    swapped = LinearLRScheduler(optimizer, warmup_step_count=2, total_step_count=10, initial_lr=0.1)
    assert optimizer.get_learning_rate() == 0.0
    state._state.step = 5
    swapped.step()
    assert optimizer.get_learning_rate() == float(np.float32(0.1) * (np.float32(5) / np.float32(10)))
    documented = LinearLRScheduler(optimizer, 2, 10, 0.1, as_documented=True)
    expected = np.float32(0.1) * (np.float32(10 - 5) / np.float32(8))
    assert optimizer.get_learning_rate() == float(expected)
    state._state.step = 1
    documented.step()
    assert optimizer.get_learning_rate() == float(np.float32(0.1) * np.float32(0.5))


def test_mistakes_are_one_clear_error(session, tmp_path):
    folder, state, module, _optimizer = session
    with pytest.raises(GraphforgeError, match=r"the training model takes 2 inputs \(images, labels\), got 1"):
        module(DATA["images"][:4])
    with pytest.raises(GraphforgeError, match=r"this Module already has an Optimizer"):
        Optimizer(folder / "optimizer_model.onnx", module)
    with pytest.raises(GraphforgeError, match=r"parameter 'fc1.bias' is float32\[64\], got float32\[3\]"):
        state.parameters["fc1.bias"] = np.zeros(3, np.float32)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "training_model.onnx").write_bytes((folder / "training_model.onnx").read_bytes())
    with pytest.raises(ManifestError, match=r"no manifest\.json beside it names it"):
        Module(alone / "training_model.onnx", state)
    no_eval = Module(folder / "training_model.onnx", CheckpointState.load_checkpoint(folder / "checkpoint"))
    no_eval.eval()
    with pytest.raises(GraphforgeError, match="no eval model: give eval_model_uri"):
        no_eval(DATA["images"][:4], DATA["labels"][:4])


def test_the_drop_in_trains_as_graphforges_module(session):
    """The same program run by graphforge's Module (its ONNX update) and by the drop-in on its
    artifacts: 20 steps bit for bit, loss and every tensor."""
    _folder, state, module, optimizer = session
    pipeline = artifacts.pipeline_for(
        onnx.load(DIGITS), loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD
    )
    program = graphforge.compile(DIGITS, pipeline).model
    reference = graphforge.Module(program, device="cpu", update="onnx")
    reference_optimizer = graphforge.Optimizer(reference)
    for i in range(20):
        x, y = DATA["images"][i * 16 : (i + 1) * 16], DATA["labels"][i * 16 : (i + 1) * 16]
        ours = module(x, y)[0]
        optimizer.step()
        module.lazy_reset_grad()
        theirs = reference(x, y)
        reference_optimizer.step()
        reference.lazy_reset_grad()
        assert float(ours) == float(theirs)
    for name, value in reference.state.tensors.items():
        assert np.array_equal(state._state.tensors[name], value), name


def test_frozen_parameters_are_read_never_trained(tmp_path):
    """frozen_params: the state lists them (requires_grad false, no grad); a step trains the
    others as graphforge's Module trains the program, bit for bit, and leaves them as they
    were; the trainable buffer leaves them out, trainable_only=False sets them (fc1 zero: every
    row's logits are fc2's bias)."""
    model = onnx.load(DIGITS)
    options = {
        "frozen_params": ["fc1.weight", "fc1.bias"],
        "loss": artifacts.LossType.CrossEntropyLoss,
        "optimizer": artifacts.OptimType.SGD,
    }
    artifacts.generate_artifacts(model, artifact_directory=tmp_path, additional_output_names=["logits"], **options)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    assert [(n, p.requires_grad) for n, p in state.parameters.items()] == [
        ("fc2.weight", True),
        ("fc2.bias", True),
        ("fc1.weight", False),
        ("fc1.bias", False),
    ]
    assert state.parameters["fc1.weight"].grad is None
    assert (module.get_parameters_size(), module.get_parameters_size(False)) == (650, 4810)
    reference = graphforge.Module(
        graphforge.compile(DIGITS, artifacts.pipeline_for(model, **options)).model, device="cpu", update="onnx"
    )
    reference_optimizer = graphforge.Optimizer(reference)
    frozen = state.parameters["fc1.weight"].data.copy()
    for i in range(5):
        x, y = DATA["images"][i * 16 : (i + 1) * 16], DATA["labels"][i * 16 : (i + 1) * 16]
        assert float(module(x, y)[0]) == float(reference(x, y))
        optimizer.step()
        module.lazy_reset_grad()
        reference_optimizer.step()
        reference.lazy_reset_grad()
    for name, value in reference.state.tensors.items():
        assert np.array_equal(state._state.tensors[name], value), name
    np.testing.assert_array_equal(state.parameters["fc1.weight"].data, frozen)
    assert module.get_contiguous_parameters(trainable_only=True).size == 650
    everything = np.zeros(4810, np.float32)
    bias = np.linspace(-0.5, 0.5, 10, dtype=np.float32)
    everything[640:650] = bias  # fc2.bias, after fc2.weight; fc1 (after them) zero
    module.copy_buffer_to_parameters(everything, trainable_only=False)
    module.eval()
    _loss, logits = module(DATA["images"][:4], DATA["labels"][:4])
    np.testing.assert_array_equal(logits, np.tile(bias, (4, 1)))
