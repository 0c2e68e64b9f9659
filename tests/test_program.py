"""ProgramRoles: what each input and output of a program is for, read once from its metadata."""

from __future__ import annotations

import json
from pathlib import Path

import models
import numpy as np
import onnx
import pytest

import graphforge
from graphforge import roles
from graphforge.program import CarriedSpec, ProgramRoles

PIPELINE = "loss(kind=mse, output=y), autodiff, adamw(lr=0.01, accumulate=true)"


@pytest.fixture(scope="module")
def program() -> onnx.ModelProto:
    return graphforge.compile(models.tanh_mlp(), PIPELINE).model


def test_a_training_programs_roles(program):
    r = ProgramRoles.read(program)
    assert r.is_training_program and r.accumulates and r.optimizer == "adamw"
    assert r.hyperparameters["lr"] == 0.01 and r.default_lr == 0.01
    assert (r.loss, r.labels, r.grad_norm, r.step_output) == ("loss", "labels", "grad_norm", "step_next")
    assert r.scalar_inputs == ("lr", "step", "lazy_reset_grad")
    assert [b.name for b in r.batch_inputs] == ["x", "labels"]
    x = r.batch_inputs[0]
    assert (x.dtype, x.dims, x.has_default, x.describe_dims()) == (np.dtype(np.float32), ("N", 4), False, "[N, 4]")
    assert r.forward_outputs == ("y",)
    params = ["w1", "b1", "w2", "b2"]
    assert list(r.parameters) == params
    assert r.gradients == {p: f"{p}_grad" for p in params}
    assert r.gradient_boundary == {p: f"optim::boundary/{p}" for p in params}
    # parameters first, in order; then accumulators, then optimizer states
    assert [c.role for c in r.carried] == ["parameter"] * 4 + ["accumulator"] * 4 + ["optimizer"] * 8
    assert [c.input for c in r.carried_with_role("parameter")] == params
    assert r.carried_spec("w1.exp_avg") == CarriedSpec(
        "w1.exp_avg", "w1.exp_avg_next", "optimizer", "float32", (4, 8), "zeros", "w1"
    )
    assert r.carried_spec("w1").init == "initializer" and r.carried_spec("nope") is None
    assert r.update_outputs == {
        *(f"{p}_next" for p in params),
        *(f"{p}.{s}_next" for p in params for s in ("exp_avg", "exp_avg_sq")),
        "grad_norm",
        "step_next",
    }


def test_every_source_reads_the_same_roles(program, tmp_path):
    path = graphforge.save(program, tmp_path / "program.onnx")
    from_proto = ProgramRoles.read(program)
    for source in (path, str(path), program.SerializeToString(), graphforge.Model.from_proto(program)):
        assert ProgramRoles.read(source) == from_proto, type(source)


def test_the_state_entries_round_trip_through_carried_specs(program):
    entries = json.loads(roles.metadata_of(program)[roles.STATE])
    assert [CarriedSpec.from_json(e).to_json() for e in entries] == entries


def test_a_plain_model_has_no_roles_but_its_inputs_and_outputs():
    r = ProgramRoles.read(models.tanh_mlp())
    assert not r.is_training_program and r.loss is None and r.carried == () and r.gradient_boundary == {}
    assert [b.name for b in r.batch_inputs] == ["x"] and r.forward_outputs == ("y",)
    with pytest.raises(
        graphforge.GraphforgeError, match=r"not a training program .* compile it with an optimizer pass"
    ):
        r.require_training_program()


def test_a_gradient_program_without_optimizer():
    program = graphforge.compile(models.tanh_mlp(), "loss(kind=mse, output=y), autodiff").model
    r = ProgramRoles.read(program)
    assert r.forward_outputs == ("y",) and r.loss == "loss" and not r.is_training_program
    assert r.grad_norm is None and r.step_output is None and r.scalar_inputs == ()


def test_metadata_that_is_not_json_is_one_clear_error(program):
    broken = onnx.ModelProto()
    broken.CopyFrom(program)
    entry = next(p for p in broken.metadata_props if p.key == roles.STATE)
    entry.value = "[{not json"
    with pytest.raises(graphforge.GraphforgeError, match=r"metadata 'graphforge.state' is not valid JSON"):
        ProgramRoles.read(broken)


def test_an_optimizer_state_name_the_model_already_uses_is_one_clear_error():
    """The optimizer names W's states ``W.exp_avg`` and ``W.exp_avg_sq``: a model tensor of
    that name makes the pass refuse, naming it (checked against the names the model had, and
    those the pass added, without walking the graph once per state)."""
    model = models.linear_model()
    for node in model.graph.node:
        node.output[:] = ["W.exp_avg" if o == "xw" else o for o in node.output]
        node.input[:] = ["W.exp_avg" if i == "xw" else i for i in node.input]
    with pytest.raises(graphforge.PipelineError, match=r"cannot add input 'W.exp_avg': the model already has a tensor"):
        graphforge.compile(model, "loss(kind=mse, output=y), autodiff, adamw")
    renamed = graphforge.compile(models.linear_model(), "loss(kind=mse, output=y), autodiff, adamw").model
    inputs = {i.name for i in renamed.graph.input}
    assert {"W.exp_avg", "W.exp_avg_sq", "b.exp_avg", "b.exp_avg_sq"} <= inputs


def test_a_program_compiled_before_stages_were_named_so_reads_its_stages():
    """Programs from before the role was renamed hold the stages under graphforge.pipeline:
    they read as they did; one that holds both reads the current key."""
    digits = str(Path(__file__).resolve().parents[1] / "examples" / "digits" / "model.onnx")
    staged = graphforge.compile(
        digits,
        "loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.1, accumulate=true), "
        "pipeline(stages=2, microbatches=2)",
    ).model
    current = ProgramRoles.of_proto(staged).stages
    assert current is not None and current.stages == 2
    older = onnx.ModelProto()
    older.CopyFrom(staged)
    for entry in older.metadata_props:
        if entry.key == roles.STAGES:
            entry.key = roles.STAGES_BEFORE
    assert ProgramRoles.of_proto(older).stages == current
    assert roles.STAGES not in {e.key for e in older.metadata_props}
