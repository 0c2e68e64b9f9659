"""A frozen weight stays a constant of every session the runner makes (an initializer that is
no input), so that onnxruntime may prepack it; training leaves it as it was."""

from __future__ import annotations

from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import graphforge
from graphforge.placement.lean import lean_model
from graphforge.program import ProgramRoles
from graphforge.runtime import Module

DIGITS = Path(__file__).resolve().parents[2] / "examples/digits/model.onnx"
PIPELINES = {
    "autodiff": "loss(kind=mse, output=y), autodiff(frozen=[w1, b1]), adamw(lr=0.1)",
    "lora": "lora(r=2, alpha=4, targets=[fc1, fc2]), loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=0.1)",
}


def _trained(name: str) -> tuple[onnx.ModelProto, Module, list[dict]]:
    if name == "lora":
        rng = np.random.default_rng(0)
        source = onnx.load(DIGITS)
        batches = [{"images": rng.integers(0, 17, (8, 8, 8), dtype=np.uint8),
                    "labels": rng.integers(0, 10, 8).astype(np.int64)} for _ in range(3)]  # fmt: skip
    else:
        source, batches = models.tanh_mlp(), models.tanh_mlp_batches(3)
    program = graphforge.compile(source, PIPELINES[name]).model
    module = Module(program, device="cpu")
    for batch in batches:
        module.train_step(**batch)
    return program, module, batches


@pytest.mark.parametrize("name", PIPELINES)
def test_a_frozen_weight_is_a_constant_of_every_session(name):
    program, module, _ = _trained(name)
    frozen = set(ProgramRoles.read(program).frozen)
    assert frozen  # the base (lora), w1 and b1 (autodiff)
    sessions = list(module.runner._sessions.values())
    assert sessions
    for bound in sessions:
        fed = {i.name for i in bound.session.get_inputs()}
        overridable = {i.name for i in bound.session.get_overridable_initializers()}
        assert not frozen & (fed | overridable | set(bound.defaults)), bound.where
    lean = lean_model(program, bound=module.runner.carried)
    kept = {t.name for t in lean.graph.initializer}
    assert frozen <= kept and not frozen & {i.name for i in lean.graph.input}


@pytest.mark.parametrize("name", PIPELINES)
def test_training_leaves_the_frozen_weights_as_they_were(name, tmp_path):
    program, module, _ = _trained(name)
    frozen = ProgramRoles.read(program).frozen
    start = {t.name: numpy_helper.to_array(t) for t in program.graph.initializer if t.name in frozen}
    output = "y" if name == "autodiff" else "logits"
    exported = onnx.load(module.export_model_for_inferencing(tmp_path / "inference.onnx", [output]))
    after = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer if t.name in frozen}
    assert after.keys() == start.keys()
    for key, value in start.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)
    initial = {t.name: numpy_helper.to_array(t) for t in program.graph.initializer}
    trained = module.parameters
    assert trained and not frozen.keys() & trained.keys()
    assert any(not np.array_equal(value, initial[key]) for key, value in trained.items())  # the rest trained
