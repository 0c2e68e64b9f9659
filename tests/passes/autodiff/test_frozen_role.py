"""The frozen role (``graphforge.frozen``): every way to freeze a weight lands on it, and a
frozen weight gets no gradient, no optimizer state, no reduction or shard, and stays an
initializer of the program (the runner's side is tests/runtime/test_frozen_constants.py)."""

from __future__ import annotations

import models
import onnx
import pytest

import graphforge
from graphforge import roles
from graphforge.ondevice.artifacts import LossType, pipeline_for
from graphforge.program import ProgramRoles

LOSS = "loss(kind=mse, output=y)"
WEIGHTS = ["w1", "b1", "w2", "b2"]


def _frozen(pipeline: str, model=None) -> dict[str, str]:
    program = graphforge.compile(models.tanh_mlp() if model is None else model, pipeline).model
    return {name: f.by for name, f in ProgramRoles.read(program).frozen.items()}


@pytest.mark.parametrize(
    ("autodiff", "frozen"),
    [
        ("autodiff", {}),
        ("autodiff(frozen=[w1])", {"w1": "autodiff"}),
        ("autodiff(frozen=['b*'])", {"b1": "autodiff", "b2": "autodiff"}),
        ("autodiff(trainable=[w2, b2])", {"w1": "autodiff", "b1": "autodiff"}),
        ("autodiff(trainable=['w*'], frozen=[w1])", {"w1": "autodiff", "b1": "autodiff", "b2": "autodiff"}),
    ],
)
def test_autodiffs_patterns_land_on_the_role(autodiff, frozen):
    """Left out by ``trainable`` or taken out by ``frozen``: frozen, by autodiff; no frozen
    weight: no key at all, so such a program is as it was."""
    program = graphforge.compile(models.tanh_mlp(), f"{LOSS}, {autodiff}").model
    program_roles = ProgramRoles.read(program)
    assert {n: f.by for n, f in program_roles.frozen.items()} == frozen
    assert (roles.FROZEN in program_roles.metadata) == bool(frozen)
    assert set(program_roles.parameters) == set(WEIGHTS) - set(frozen)


def test_generate_artifacts_frozen_params_land_on_the_role():
    """The pipeline ``generate_artifacts(frozen_params=...)`` compiles with freezes through autodiff."""
    pipeline = pipeline_for(models.tanh_mlp(), frozen_params=["w1", "b1"], loss=LossType.MSELoss)
    assert _frozen(pipeline) == {"w1": "autodiff", "b1": "autodiff"}


def test_the_lora_passs_freezing_lands_on_the_role_and_a_named_weight_trains():
    """lora freezes the whole base; autodiff keeps that, and trains a weight its ``trainable``
    names without a wildcard (as it does a weight torch froze)."""
    lora = "lora(r=2, targets=[w1]), " + LOSS
    assert _frozen(f"{lora}, autodiff") == dict.fromkeys(WEIGHTS, "lora")
    frozen = _frozen(f"{lora}, autodiff(trainable=['w1.lora_*', b2])")
    assert frozen == {"w1": "lora", "b1": "lora", "w2": "lora"}


@pytest.fixture(scope="module")
def program():
    """w1 and b1 frozen; AdamW accumulating (so every kind of carried tensor is made)."""
    return graphforge.compile(models.tanh_mlp(), f"{LOSS}, autodiff(frozen=[w1, b1]), adamw(lr=0.1, accumulate=true)")


def test_a_frozen_weight_has_no_gradient_state_or_input(program):
    model = program.model
    program_roles = ProgramRoles.read(model)
    assert set(program_roles.frozen) == {"w1", "b1"}
    carried = {c.input for c in program_roles.carried} | {c.like for c in program_roles.carried if c.like}
    assert not carried & {"w1", "b1"}  # no parameter slot, accumulator or moment
    assert not {roles.grad_name("w1"), roles.grad_name("b1")} & {o.name for o in model.graph.output}
    assert set(program_roles.gradient_boundary) == {"w2", "b2"}
    assert {"w1", "b1"} <= {t.name for t in model.graph.initializer}
    assert not {"w1", "b1"} & {i.name for i in model.graph.input}  # a constant, not an overridable input


@pytest.mark.parametrize("reduction", ["allreduce(bucket_mb=0.0001)", "zero(stage=1, bucket_mb=0.0001)"])
def test_allreduce_and_zero_reduce_and_shard_no_frozen_weight(program, reduction):
    reduced = graphforge.compile(program.model, reduction).model
    role = ProgramRoles.read(reduced).allreduce
    assert sorted(p for bucket in role.buckets for p in bucket) == ["b2", "w2"]
    assert set(role.reduced) == {"w2", "b2"} and set(role.gathered) <= {"w2", "b2"}
    read = [i for n in reduced.graph.node if n.domain == roles.MARKER_DOMAIN for i in n.input]
    assert read and not [i for i in read if "w1" in i or "b1" in i]  # the collectives read w2's and b2's alone


def test_a_frozen_weight_the_model_lists_as_an_input_becomes_a_constant():
    """torch.onnx.export(keep_initializers_as_inputs=True) lists every initializer as an input
    too (an overridable default, which a runner binds): a frozen one is an input no more."""
    model = models.tanh_mlp()
    model.graph.input.extend(
        onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in model.graph.initializer
    )
    program = graphforge.compile(model, f"{LOSS}, autodiff(frozen=[w1, b1]), sgd(lr=0.1)").model
    inputs = {i.name for i in program.graph.input}
    assert {"w2", "b2"} <= inputs and not {"w1", "b1"} & inputs
    assert {"w1", "b1"} <= {t.name for t in program.graph.initializer}
