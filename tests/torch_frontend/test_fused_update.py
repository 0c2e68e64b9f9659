"""The update run by torch's fused kernels (graphforge/runtime/fused_update.py) against its
definition, the program's ONNX update: two Modules from one program and state, one updating
through each, equal over 20 steps (every parameter and optimizer state within 1e-6 of its
norm or of its movement, whichever is larger: a parameter that passes near zero, the losses
within 1e-6) for SGD, Adam, AdamW and LAMB with their settings, clipping, accumulation and
loss scaling (skipped steps, the scale's backoff and growth); and the programs whose update it
does not know keep their ONNX one, saying why."""

from __future__ import annotations

import os

import models
import numpy as np
import pytest

import graphforge
from graphforge.errors import GraphforgeError

torch = pytest.importorskip("torch")

from graphforge.runtime.fused_update import refusal  # noqa: E402
from graphforge.torch import FusedUpdate, use_fused_update  # noqa: E402  (needs torch)

STEPS = 20
TOLERANCE = 1e-6
LOSS = "loss(kind=mse, output=y), autodiff"
UPDATES = [
    "sgd(lr=0.1)",
    "sgd(lr=0.05, momentum=0.9, weight_decay=0.01)",
    "sgd(lr=0.05, momentum=0.9, dampening=0.1)",
    "sgd(lr=0.05, momentum=0.9, nesterov=true, clip_grad_norm=0.5)",
    "adam(lr=0.01, weight_decay=0.01)",
    "adamw(lr=0.01, weight_decay=0.05)",
    "adamw(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, clip_grad_norm=0.5)",
    "adamw(lr=0.01, accumulate=true)",
    "lamb(lr=0.01)",
    "lamb(lr=0.02, weight_decay=0.0, clip_grad_norm=1.0)",
]


def _modules(program) -> tuple[graphforge.Module, graphforge.Module]:
    onnx_update = graphforge.Module(program, device=DEVICE, update="onnx")
    fused = graphforge.Module(program, device=DEVICE, update="torch")  # LAMB too, in foreach kernels
    for module in (onnx_update, fused):
        graphforge.Optimizer(module)
    assert fused.update_note.startswith("update: torch")
    assert onnx_update.update_kernel is None and isinstance(fused.update_kernel, FusedUpdate)
    return onnx_update, fused


def _close(ours: np.ndarray, theirs: np.ndarray, initial: np.ndarray) -> bool:
    scale = max(np.linalg.norm(theirs), np.linalg.norm((theirs - initial).astype(np.float64)), 1e-12)
    return np.linalg.norm((ours - theirs).astype(np.float64)) <= TOLERANCE * scale


@pytest.mark.parametrize("update", UPDATES)
def test_the_fused_update_equals_the_programs_own_over_20_steps(update):
    program = graphforge.compile(models.tanh_mlp(scalar_scale=True), f"{LOSS}, {update}").model
    onnx_update, fused = _modules(program)
    initial = fused.runner.read_tensors()
    accumulate = "accumulate=true" in update
    batches = models.tanh_mlp_batches(2 * STEPS if accumulate else STEPS)
    losses = {id(onnx_update): [], id(fused): []}
    for module in (onnx_update, fused):
        optimizer = module._optimizer
        base = optimizer.get_learning_rate()
        for i in range(STEPS):
            # a falling lr: the kernels read it from a device tensor written before each update
            optimizer.set_learning_rate(base * (1.0 - i / (2 * STEPS)))
            if accumulate:  # two micro-batches, then the update
                loss = float(module(**batches[2 * i])) + float(module(**batches[2 * i + 1]))
                optimizer.step()
            else:
                loss = float(module.train_step(**batches[i]))
            losses[id(module)].append(loss)
    np.testing.assert_allclose(losses[id(fused)], losses[id(onnx_update)], rtol=TOLERANCE)
    want, got = onnx_update.runner.read_tensors(), fused.runner.read_tensors()
    assert set(got) == set(want)
    for name, value in want.items():
        assert _close(got[name], value, initial[name]), (name, float(np.abs(got[name] - value).max()))
    assert fused.state.step == onnx_update.state.step == STEPS
    kernel = fused.update_kernel
    if PROVIDER == "cuda" and kernel.device_scalars:  # the last steps replayed the captured update
        assert kernel._graph._graph is not None and kernel._graph.stopped is None


#: where the Modules run: the CPU here and in CI; GRAPHFORGE_TEST_DEVICE=cuda runs the same tests on a GPU
DEVICE = os.environ.get("GRAPHFORGE_TEST_DEVICE", "cpu")
PROVIDER = DEVICE.split(":")[0]
#: float16 programs that scale their loss, from a scale at which only the batches with labels
#: 1e18 times as large overflow: on the CPU, which computes float16 between casts, in float32;
#: on a GPU in float16 itself
HUGE = 2.0**80 if DEVICE == "cpu" else 2.0**10
SCALED = [
    ("adamw(lr=0.01, clip_grad_norm=0.5)", f"init_scale={HUGE}, growth_interval=3"),
    ("sgd(lr=0.05, momentum=0.9)", f"init_scale={HUGE}, growth_interval=4"),
    ("adam(lr=0.01, weight_decay=0.01, accumulate=true)", f"init_scale={HUGE}, growth_interval=3"),
    ("lamb(lr=0.01)", "loss_scale=1000.0"),
    ("adamw(lr=0.01)", "loss_scale=none"),
]


@pytest.mark.parametrize(("update", "scaling"), SCALED)
def test_the_fused_update_of_a_scaled_program_equals_the_programs_own(update, scaling):
    """Steps 4, 9 and 10 overflow the scaled gradients (their loss stays finite): both
    Modules skip the same updates and end with the same scale, skipped count and state."""
    pipeline = f"{LOSS}, {update}, mixed_precision(dtype=float16, provider={PROVIDER}, {scaling})"
    program = graphforge.compile(models.tanh_mlp(scalar_scale=True), pipeline).model
    onnx_update, fused = _modules(program)
    initial = fused.runner.read_tensors()
    accumulate = "accumulate=true" in update
    batches = models.tanh_mlp_batches(2 * STEPS)
    for i in (4, 9, 10):  # a micro-batch of steps 2, 4 and 5 when accumulating
        batches[i] = {**batches[i], "labels": batches[i]["labels"] * 1e18}
    runs = {}
    for module in (onnx_update, fused):
        skipped = []
        for i in range(STEPS):
            if accumulate:
                module(**batches[2 * i])
                module(**batches[2 * i + 1])
                module._optimizer.step()
                module.lazy_reset_grad()
            else:
                module.train_step(**batches[i])
            skipped.append(module.last_update_skipped)
        runs[id(module)] = (skipped, module.loss_scale, module.skipped_updates)
    assert runs[id(fused)] == runs[id(onnx_update)]
    skipped, scale, count = runs[id(fused)]
    if "init_scale" in scaling:  # torch.amp.GradScaler's rule, step by step
        interval, want_scale, tracker = int(scaling.rsplit("=", 1)[1]), HUGE, 0
        for skip in skipped:
            tracker = 0 if skip else tracker + 1
            want_scale *= 0.5 if skip else 2.0 if tracker == interval else 1.0
            tracker %= interval
        assert sum(skipped) == count == 3 and scale == want_scale
    want, got = onnx_update.runner.read_tensors(), fused.runner.read_tensors()
    assert set(got) == set(want)
    for name, value in want.items():
        assert _close(got[name], value, initial[name]), (name, float(np.abs(got[name] - value).max()))


def test_a_transformers_updates_step_by_step():
    """GPT-2's 1-layer export (embeddings, a tied head, LayerNorm): tensors of every rank, AdamW
    with clipping. Each of the 20 steps starts the fused Module from the ONNX one's state: this
    export's loss takes its classes along the sequence axis, which softmax makes blind to the
    final LayerNorm's bias and the attention's key bias, whose gradients are then rounding that
    Adam turns into full steps, so two runs that round apart at all drift apart there whatever
    their kernels (a one-ulp nudge of one weight in the ONNX run drifted as far)."""
    pytest.importorskip("transformers")
    import tempfile
    from pathlib import Path

    path = models.export_transformer(Path(tempfile.mkdtemp()) / "gpt2.onnx")
    pipeline = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=3e-3, clip_grad_norm=0.25)"
    program = graphforge.compile(path, pipeline).model
    onnx_update, fused = _modules(program)
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        before = onnx_update.runner.read_tensors()
        fused.runner.write_tensors(before)
        ids, labels = rng.integers(0, 64, (2, 8)), rng.integers(0, 8, (2, 64))
        assert float(fused.train_step(ids, labels)) == float(onnx_update.train_step(ids, labels))
        assert fused.last_grad_norm == onnx_update.last_grad_norm
        want, got = onnx_update.runner.read_tensors(), fused.runner.read_tensors()
        for name, value in want.items():
            assert _close(got[name], value, before[name]), name


def test_programs_the_kernels_do_not_know_keep_their_onnx_update():
    base = graphforge.compile(models.tanh_mlp(), f"{LOSS}, adamw(lr=0.01)").model
    dp = graphforge.compile(models.tanh_mlp(), f"{LOSS}, adamw(lr=0.01), allreduce").model
    hf = graphforge.compile(models.tanh_mlp(), f"{LOSS}, adamw(lr=0.01, mode=hf)").model
    two_buffers = graphforge.Module(base, device="cpu", in_place=False)
    cases = {
        graphforge.Module(dp, device="cpu"): "a data-parallel program",
        graphforge.Module(hf, device="cpu"): "torch's adamw kernel computes torch's update, not mode=hf's",
        two_buffers: "the Module updates with two buffers (in_place=False)",
    }
    for module, reason in cases.items():
        assert reason in refusal(module)
        assert module.update_note.startswith(f"update: the program's ONNX update ({reason}")
        line = use_fused_update(module)
        assert line.startswith("update: the program's ONNX update (") and reason in line
        assert module.update_kernel is None
        with pytest.raises(GraphforgeError, match="cannot run this Module's update with torch's kernels"):
            FusedUpdate(module)
    with pytest.raises(GraphforgeError, match=r"updates with two buffers \(in_place=False\)"):
        two_buffers.use_update_kernel(FusedUpdate(graphforge.Module(base, device="cpu")))


def test_a_pass_between_the_gradients_and_the_update_keeps_the_onnx_update():
    """A node the optimizer did not write reads a gradient (a pass scaling it, say): the kernels
    would update from the gradient itself, so the Module keeps the program's update, saying why."""
    from test_pass_conditions import compile_

    program = compile_("loss(kind=mse, output=y), autodiff, sgd(lr=0.2), halve_gradients").model
    module = graphforge.Module(program, device="cpu")
    assert module.update_kernel is None
    assert "which the optimizer did not write, reads the gradient 'optim::boundary/" in module.update_note
    with pytest.raises(GraphforgeError, match="the kernels would leave out what it does"):
        graphforge.Module(program, device="cpu", update="torch")


def test_a_torch_build_without_the_kernel_keeps_the_onnx_update(monkeypatch):
    program = graphforge.compile(models.tanh_mlp(), f"{LOSS}, adamw(lr=0.01)").model
    monkeypatch.delattr(torch, "_fused_adamw_")
    module = graphforge.Module(program, device="cpu")
    assert use_fused_update(module) == "update: the program's ONNX update (this torch build has no torch._fused_adamw_)"


def test_the_segments_own_outputs_still_come_from_the_segment():
    """A train_step asking for an output only the ONNX update makes runs it, that once."""
    program = graphforge.compile(models.tanh_mlp(), f"{LOSS}, sgd(lr=0.1)").model
    onnx_update, fused = _modules(program)
    batch = models.tanh_mlp_batches(1)[0]
    want = onnx_update.train_step(**batch, outputs=["step_next"])
    got = fused.train_step(**batch, outputs=["step_next"])
    assert int(got[1]) == int(want[1]) == 1
    for name, value in onnx_update.parameters.items():
        np.testing.assert_array_equal(fused.parameters[name], value)


def test_the_modules_default_update_is_torchs_kernel_where_it_computes_the_programs():
    """update="auto" (the default) picks the fused kernel, says why where it does not, and gives
    it up (saying so) once the Module becomes data-parallel; update="torch" insists."""
    program = graphforge.compile(models.tanh_mlp(), f"{LOSS}, adamw(lr=0.01)").model
    module = graphforge.Module(program, device="cpu")
    assert isinstance(module.update_kernel, FusedUpdate)
    assert module.update_note.startswith("update: torch._fused_adamw_ (adamw) over 4 parameters")
    onnx = graphforge.Module(program, device="cpu", update="onnx")
    assert onnx.update_kernel is None and onnx.update_note == "update: the program's ONNX update (update='onnx')"
    lamb = graphforge.compile(models.tanh_mlp(), f"{LOSS}, lamb(lr=0.01)").model
    assert "torch has no fused lamb kernel" in graphforge.Module(lamb, device="cpu").update_note
    assert graphforge.Module(lamb, device="cpu", update="torch").update_note.startswith("update: torch's foreach")
    with pytest.raises(GraphforgeError, match=r"updates with two buffers \(in_place=False\)"):
        graphforge.Module(program, device="cpu", in_place=False, update="torch")
    with pytest.raises(GraphforgeError, match="update='fast': use one of 'auto', 'torch', 'onnx'"):
        graphforge.Module(program, device="cpu", update="fast")

    class Reducer:  # what DataParallel attaches (tests/distributed run the real one)
        shards_update = False

    module.attach_reducer(Reducer(), 0)
    assert module.update_kernel is None and "a data-parallel program" in module.update_note
    insisted = graphforge.Module(program, device="cpu", update="torch")
    with pytest.raises(GraphforgeError, match="made with update='torch'"):
        insisted.attach_reducer(Reducer(), 0)


def test_lamb_runs_in_foreach_kernels_only_when_asked():
    """torch has no fused LAMB; its foreach kernels measured no clear winner over the ONNX update."""
    program = graphforge.compile(models.tanh_mlp(), f"{LOSS}, lamb(lr=0.01)").model
    module = graphforge.Module(program, device="cpu")
    assert use_fused_update(module) == (
        "update: the program's ONNX update (torch has no fused lamb kernel; its foreach kernels run it only "
        "when asked (foreach=True))"
    )
    assert use_fused_update(module, foreach=True).startswith("update: torch's foreach kernels (lamb)")
