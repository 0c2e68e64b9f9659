"""Several steps in one run (the steps pass, Module.train_steps): k steps in one onnxruntime run
equal k single steps bit for bit, and where they cannot apply they say why in one line.

The oracle is the unwrapped program: k ``train_step`` calls of a Module running the program's
own ONNX update (``update="onnx"``), and for the pass alone k runs of an unmodified
onnxruntime session of the program, each fed the state the one before returned.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _pages import page_block
from _training_models import batches, compile_program, dropout_mlp_onnx, mlp_onnx
from graphforge.passes.steps import Steps

import graphforge
from graphforge.errors import GraphforgeError
from graphforge.graph import Model
from graphforge.pass_spec import ParameterValueError
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointState, Module
from graphforge.runtime.lr_schedules import make_schedule

pytest.importorskip("torch")

K = 3
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dropout_onnx() -> bytes:
    return dropout_mlp_onnx()


def _module(program, **options) -> Module:
    state = CheckpointState.from_program(program)
    state.seeds["dropout"] = 7
    return Module(program, state, device="cpu", update="onnx", **options)


def _stacked(chunk):
    return np.stack([x for x, _ in chunk]), np.stack([y for _, y in chunk])


@pytest.mark.parametrize("optimizer", ["sgd(lr=0.1, momentum=0.9)", "adamw(lr=0.01, weight_decay=0.1)"])
def test_k_steps_in_one_run_equal_k_single_steps(dropout_onnx, optimizer):
    """Dropout masks, a warmup + cosine schedule, two runs of K steps: the losses, every carried
    tensor, the step count and the last gradient norm are the single steps' own."""
    program = compile_program(dropout_onnx, optimizer)
    data = batches(2 * K)
    single, one_by_one = _module(program), []
    schedule = make_schedule("cosine", base_lr=0.05, warmup_steps=2, total_steps=6)
    for x, y in data:
        single.state.learning_rate = schedule.lr_at(schedule.last_step)
        one_by_one.append(single.train_step(x, y))
        schedule.step()

    wrapped, in_runs = _module(program), []
    schedule = make_schedule("cosine", base_lr=0.05, warmup_steps=2, total_steps=6)
    for start in (0, K):
        losses = wrapped.train_steps(*_stacked(data[start : start + K]), lr=schedule.next_rates(K))
        assert losses.shape == (K,)
        in_runs += list(losses)
        for _ in range(K):
            schedule.step()

    np.testing.assert_array_equal(np.array(in_runs), np.array(one_by_one))
    expected, got = single.state.tensors, wrapped.state.tensors
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert wrapped.state.step == single.state.step == 2 * K
    assert wrapped.last_grad_norm == single.last_grad_norm
    # the whole run of K steps is undone at once: the state after the first run comes back
    wrapped.undo_last_run()
    assert wrapped.state.step == K


def test_the_pass_in_a_pipeline_equals_k_unmodified_runs():
    """``steps(k=...)`` written in a pipeline: the program it writes, run by onnxruntime once,
    computes what k runs of the program without it compute (an accumulating program's reset
    flag stacked true, as each single step feeds it)."""
    text = "loss(kind=mse, output=y), autodiff, sgd(lr=0.1, accumulate=true)"
    forward = mlp_onnx()
    program = graphforge.compile(forward, text).model
    wrapped = graphforge.compile(forward, f"{text}, steps(k={K})").model
    roles = ProgramRoles.of_proto(program)
    state = {n: v for n, v in CheckpointState.from_program(program).tensors.items()}
    data = batches(K)
    session = ort.InferenceSession(program.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    losses = []
    for i, (x, y) in enumerate(data):
        feeds = {"x": x, "labels": y, "lr": np.array(0.1 * (i + 1), np.float32), "step": np.array(i, np.int64)}
        feeds[roles.reset_input] = np.array(True)
        out = dict(zip(names, session.run(None, {**feeds, **state}), strict=True))
        losses.append(out["loss"])
        state = {c.input: out[c.output] for c in roles.carried}

    session = ort.InferenceSession(wrapped.SerializeToString(), providers=["CPUExecutionProvider"])
    initial = CheckpointState.from_program(program).tensors
    feeds = dict(zip(("x", "labels"), _stacked(data), strict=True))
    feeds.update(lr=np.array([0.1, 0.2, 0.3], np.float32), step=np.arange(K, dtype=np.int64))
    feeds[roles.reset_input] = np.ones(K, np.bool_)
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, {**feeds, **initial}), strict=True))
    np.testing.assert_array_equal(out["loss"], np.array(losses))
    for c in roles.carried:
        np.testing.assert_array_equal(out[c.output], state[c.input], err_msg=c.input)
    assert json_steps(wrapped)["k"] == K


def json_steps(model: onnx.ModelProto) -> dict:
    import json

    return json.loads({p.key: p.value for p in model.metadata_props}["graphforge.steps"])


def test_where_several_steps_cannot_apply_they_say_why(dropout_onnx):
    program = compile_program(dropout_onnx, "sgd(lr=0.1, accumulate=true)")
    module = _module(program)
    x, y = _stacked(batches(K))
    with pytest.raises(GraphforgeError, match="data that is not stacked"):
        module.train_steps(x, y[:2])
    with pytest.raises(GraphforgeError, match="not stacked"):
        module.train_steps(x[0, 0], y[0, 0])
    module(x[0], y[0])  # a micro-batch accumulated: the next update is optimizer.step()'s
    with pytest.raises(GraphforgeError, match="accumulation across runs"):
        module.train_steps(x, y)
    module.lazy_reset_grad()  # what optimizer.step() leaves, as far as train_steps goes
    module.state.micro_batch = 0
    module.eval()
    with pytest.raises(GraphforgeError, match="evaluation every step"):
        module.train_steps(x, y)
    module.train()
    with pytest.raises(GraphforgeError, match="learning rates"):
        module.train_steps(x, y, lr=[0.1, 0.2])

    with pytest.raises(GraphforgeError, match="allreduce or zero pass"):
        graphforge.compile(mlp_onnx(), "loss(kind=mse, output=y), autodiff, sgd(lr=0.1), allreduce, steps")
    wrapped = Steps(k=2).run(Model.from_proto(program)).model.to_proto()
    with pytest.raises(GraphforgeError, match="before steps"):
        Module(wrapped, device="cpu")
    with pytest.raises(ParameterValueError, match="'k'"):
        Steps(k=0)


def test_the_on_device_pages_python_block_trains_in_runs_of_k():
    """docs/on-device/training.md: the digits in 4 runs of 8 steps, run as written from the repository's root."""
    block = page_block("docs/on-device/training.md", "python", "module.train_steps(")
    done = subprocess.run([sys.executable, "-c", block], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    step, loss = done.stdout.split()
    assert step == "32" and 0.0 < float(loss) < 2.0  # (it starts at 2.3, ln 10)
