"""The runner's capture-ready mode (graphforge/runtime/capture.py) against the normal mode.

The oracle is the normal mode itself: two Modules from one program and state, one with
``capture=True``, trained alike for 20 steps under a cosine schedule with warm-up, resumed from
a checkpoint halfway, with batches of two sequence lengths (two sets of specialized sessions)
and, where the program accumulates, two micro-batches a step. On the CPU nothing is captured,
so the two must agree bit for bit; with GRAPHFORGE_TEST_DEVICE=cuda the capture-ready side is
captured as CUDA graphs and replayed, and must agree within 1e-6 (the check in
benchmarks/cuda_check.py runs it there)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from _training_models import N_IN, N_OUT, cnn_onnx, dropout_mlp_onnx, mlp_onnx

import graphforge
from graphforge.runtime import CheckpointState, CosineSchedule, Module, Optimizer
from graphforge.runtime import runner as runner_module

pytest.importorskip("torch")

DEVICE = os.environ.get("GRAPHFORGE_TEST_DEVICE", "cpu")
PROVIDER = DEVICE.split(":")[0]
#: a loss scale at which only the batches with labels 1e18 times as large overflow (the CPU
#: computes float16 between casts in float32; a GPU in float16)
HUGE = 2.0**80 if DEVICE == "cpu" else 2.0**10
#: bit for bit on the CPU (nothing captured); on CUDA, the replays against the runs
TOLERANCE = 0.0 if DEVICE == "cpu" else 1e-6
STEPS, RESUME_AT = 20, 10
#: a 2-layer GPT-2 with dynamic batch and sequence, logits [batch, vocab, seq]
GPT2 = Path(__file__).resolve().parents[2] / "golden_models" / "gpt2_tiny" / "model.onnx"
GPT2_LOSS = "loss(kind=cross_entropy, output=logits)"


def _resized(step: int) -> bool:
    """Steps 6 to 12 take batches of other dims: a change of dims, and back."""
    return 6 <= step <= 12


def _gpt2_batch(step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * step + micro)
    ids = rng.integers(0, 128, (3, 12 if _resized(step) else 8), dtype=np.int64)
    return ids, np.roll(ids, -1, axis=1)


def _vector_batch(step: int, micro: int, shape=(N_IN,)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * step + micro)
    batch = 4 if _resized(step) else 6
    return rng.standard_normal((batch, *shape)).astype(np.float32), rng.standard_normal((batch, N_OUT)).astype(
        np.float32
    )


def _overflowing_batch(step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = _vector_batch(step, micro)
    return x, (y * 1e18 if step in (4, 9) else y)


def _train(program, state, batch, steps: range, *, accumulate: bool, **options) -> tuple[Module, list[float]]:
    module = Module(program, state, device=DEVICE, **options)
    optimizer = Optimizer(module)
    schedule = CosineSchedule(optimizer, base_lr=0.02, warmup_steps=3, total_steps=STEPS, last_step=steps.start)
    losses = []
    for step in steps:
        if accumulate:
            losses.append(float(module(*batch(step, 0))) + float(module(*batch(step, 1))))
            optimizer.step()
            module.lazy_reset_grad()
        else:
            losses.append(float(module.train_step(*batch(step, 0))))
        schedule.step()
    return module, losses


CASES = {  # name: (model, loss, optimizer, batches, Module options)
    "gpt2-accumulate": (str(GPT2), GPT2_LOSS, "adamw(lr=0.01, accumulate=true, clip_grad_norm=1.0)", _gpt2_batch,
                        {"update": "onnx"}),
    "gpt2-fused-update": (str(GPT2), GPT2_LOSS, "adamw(lr=0.01, weight_decay=0.1)", _gpt2_batch, {"update": "auto"}),
    # ping-pong buffers: a binding (on CUDA a graph) for each; the dropout key is a fed scalar
    "dropout-two-buffers": (dropout_mlp_onnx, "loss(kind=mse, output=y)", "sgd(lr=0.05, momentum=0.9)",
                            _vector_batch, {"update": "onnx", "in_place": False}),
    # loss scaling: the scale, its growth tracker and the skipped count carried; the batches of
    # steps 4 and 9 overflow the scaled gradients (labels 1e18 times as large) and are skipped
    "mixed-precision": (mlp_onnx, "loss(kind=mse, output=y)",
                        f"adamw(lr=0.01), mixed_precision(dtype=float16, provider={PROVIDER}, init_scale={HUGE}, "
                        "growth_interval=3)", _overflowing_batch, {"update": "auto"}),
    # BatchNorm's running statistics: carried in two buffers beside parameters updated in place
    "batchnorm": (cnn_onnx, "loss(kind=mse, output=y)", "adam(lr=0.01)",
                  lambda step, micro: _vector_batch(step, micro, (2, 5, 5)), {"update": "onnx"}),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_capture_ready_training_equals_the_normal_mode(tmp_path, case):
    source, loss, optimizer, batch, options = CASES[case]
    model = source if isinstance(source, str) else source()
    program = graphforge.compile(model, f"{loss}, autodiff, {optimizer}").model
    accumulate = "accumulate" in optimizer
    runs = {}
    for capture in (False, True):
        first, before = _train(program, None, batch, range(RESUME_AT), accumulate=accumulate, capture=capture,
                               **options)  # fmt: skip
        path = first.state.save(tmp_path / f"half-{capture}.ckpt")
        state = CheckpointState.load(path, program)
        module, after = _train(program, state, batch, range(RESUME_AT, STEPS), accumulate=accumulate,
                               capture=capture, **options)  # fmt: skip
        runs[capture] = (module, before + after)
    (normal, normal_losses), (ready, ready_losses) = runs[False], runs[True]
    np.testing.assert_allclose(ready_losses, normal_losses, rtol=TOLERANCE, atol=0)
    want, got = normal.state.tensors, ready.state.tensors
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=TOLERANCE, atol=TOLERANCE, err_msg=name)
    assert ready.state.step == normal.state.step == STEPS
    if "mixed_precision" in optimizer:
        assert ready.skipped_updates == normal.skipped_updates > 0
    # every training session of the resumed half ran against fixed buffers, one per set of dims
    trained = list(ready.runner._sessions.values())
    assert len(trained) >= 2 and all(b.static_inputs is not None for b in trained)
    assert not ready.runner.capture_refused
    assert all(b.static_inputs is None for b in normal.runner._sessions.values())
    # the update segment reads the gradients in the very buffers the forward/backward wrote them into
    updates = [b for b in trained if b.where == "the program's optimizer segment"]
    assert bool(updates) == (options["update"] == "onnx" and options.get("in_place", True))
    for update in updates:
        shared = [n for n, buffer in ready._grad_buffers.items() if update.static_inputs.get(n) is buffer]
        assert shared and len(shared) == len(ready._grad_buffers)


def test_a_session_without_fixed_shapes_runs_as_fed_and_says_why(monkeypatch):
    """Past the cap on specialized sessions, a batch of yet other dims runs the session for any
    dims: no fixed buffers there (its reason kept), and the same losses as the normal mode."""
    monkeypatch.setattr(runner_module, "MAX_SPECIALIZED", 1)
    program = graphforge.compile(str(GPT2), f"{GPT2_LOSS}, autodiff, sgd(lr=0.1)").model
    losses = {}
    for capture in (False, True):
        module = Module(program, device=DEVICE, capture=capture)
        losses[capture] = [float(module.train_step(*_gpt2_batch(step, 0))) for step in (0, 7, 1)]
    np.testing.assert_allclose(losses[True], losses[False], rtol=TOLERANCE, atol=0)
    (reason,) = module.runner.capture_refused.values()
    assert reason == "no fixed buffers: the shape of 'input_ids' is known only at run time"


def test_undoing_a_forward_backward_drops_the_gradients_its_buffers_held():
    """In the capture-ready mode a forward/backward writes the gradients it sends into the same
    buffers each run: undoing one leaves no stale gradients for optimizer.step() to apply."""
    program = graphforge.compile(str(GPT2), f"{GPT2_LOSS}, autodiff, sgd(lr=0.1)").model
    module = Module(program, device=DEVICE, capture=True)
    optimizer = Optimizer(module)
    module(*_gpt2_batch(0, 0))
    module(*_gpt2_batch(1, 0))
    module.undo_last_run()
    with pytest.raises(graphforge.GraphforgeError, match="no gradients to apply"):
        optimizer.step()


def test_a_capture_that_fails_runs_uncaptured_from_then_on(monkeypatch):
    """A capture onnxruntime cannot make (on a GPU: a kernel waiting for the host while the
    stream records) is no error: that session is made again without capture, keeping its
    buffers, the step runs, and the reason is kept. Here the capture is pretended (on the CPU
    nothing is captured) and its first run fails."""
    monkeypatch.setattr(runner_module.Runner, "_captures", lambda self: True)
    launch = runner_module.Runner._launch
    failed = []

    def failing_once(bound, plan, feeds):
        if bound.captured and not failed:
            failed.append(bound.where)
            raise graphforge.GraphforgeError(f"onnxruntime failed to run {bound.where}: capture went wrong")
        launch(bound, plan, feeds)

    monkeypatch.setattr(runner_module.Runner, "_launch", staticmethod(failing_once))
    program = graphforge.compile(mlp_onnx(), "loss(kind=mse, output=y), autodiff, adamw(lr=0.01)").model
    ready = Module(program, device=DEVICE, capture=True)
    normal = Module(program, device=DEVICE, capture=False)
    for step in range(4):
        batch = _vector_batch(step, 0)
        np.testing.assert_array_equal(ready.train_step(*batch), normal.train_step(*batch))
    assert failed == ["the program's forward/backward segment"]
    assert ready.runner.capture_refused == {failed[0]: f"its capture failed: onnxruntime failed to run {failed[0]}: "
                                                       "capture went wrong"}  # fmt: skip
    (bound,) = ready.runner._sessions.values()
    assert not bound.captured and bound.static_inputs is not None


def test_evaluation_runs_as_fed_in_the_capture_ready_mode():
    """The eval model's session takes batches of any dims off the hot path: it runs as fed,
    without a word about capture."""
    program = graphforge.compile(mlp_onnx(), "loss(kind=mse, output=y), autodiff, sgd(lr=0.1)").model
    ready, normal = Module(program, device=DEVICE, capture=True), Module(program, device=DEVICE)
    for module in (ready, normal):
        module.train_step(*_vector_batch(0, 0))
        module.eval()
    for step in (1, 7):  # two batch sizes
        np.testing.assert_array_equal(ready(*_vector_batch(step, 0)), normal(*_vector_batch(step, 0)))
    assert not ready.runner.capture_refused
    (evaluation,) = [b for b in ready.runner._sessions.values() if b.where == "the eval model"]
    assert evaluation.static_inputs is None
