"""eval_model and export_inference_model: inference models cut from a training program, against torch."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from _training_programs import (
    CASES,
    batch_norm_in_training_mode,
    dropout_in_training_mode,
    initializers,
    metadata,
    plain_session,
)

import graphforge
from graphforge import roles
from graphforge.errors import GraphforgeError
from graphforge.program import ProgramRoles
from graphforge.runtime.inference import eval_model, export_inference_model

pytest.importorskip("torch")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    return CASES[request.param]()


def trained(program: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The parameters and buffers of a program, by name, with their values."""
    meta = metadata(program)
    names = json.loads(meta[roles.PARAMETERS])
    names += [s["input"] for s in json.loads(meta[roles.STATE]) if s["role"] == "buffer"]
    values = initializers(program)
    return {name: values[name] for name in names}


def modified(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Parameters doubled; a BatchNorm's running statistics shifted and scaled (kept positive)."""
    out = {}
    for name, value in values.items():
        if name.endswith("running_mean"):
            out[name] = value + np.float32(0.25)
        elif name.endswith("running_var"):
            out[name] = value * np.float32(1.5)
        else:
            out[name] = value * np.float32(2)
    return out


def test_forward_outputs(case):
    assert list(ProgramRoles.read(case.program).forward_outputs) == ["logits"]


def test_eval_model_loss_matches_torch_eval_loss(case):
    model = eval_model(case.program, ["logits"])
    assert [o.name for o in model.graph.output] == ["logits", "loss"]
    session = plain_session(model)
    for batch in (2, 5):
        x = case.make_input(batch, batch)
        labels = case.make_labels(case.torch_logits(x), batch)
        logits, loss = session.run(["logits", "loss"], {case.input_name: x, "labels": labels})
        np.testing.assert_allclose(logits, case.torch_logits(x), rtol=1e-5, atol=case.atol)
        np.testing.assert_allclose(loss, case.torch_eval_loss(x, labels), rtol=1e-5, atol=case.atol)


def test_eval_model_keeps_parameters_and_buffers_as_overridable_inputs(case):
    model = eval_model(case.program, ["logits"])
    state = trained(case.program)
    inputs = [i.name for i in model.graph.input]
    assert inputs[:2] == [case.input_name, "labels"]
    assert set(inputs[2:]) == set(state)  # the same names, nothing else (no lr, step, optimizer states)
    assert set(state) <= set(initializers(model))  # defaults: the program's values
    assert not dropout_in_training_mode(model) and not batch_norm_in_training_mode(model)
    meta = metadata(model)
    assert meta[roles.LOSS] == "loss" and meta[roles.LABELS] == "labels"
    assert roles.OPTIMIZER not in meta and roles.STATE not in meta
    assert not [n.name for n in model.graph.node if n.name.startswith(("grad::", "optim::"))]

    # a runtime binds its current values: the result is torch's with those values
    values = modified(state)
    x = case.make_input(3, 7)
    labels = case.make_labels(case.torch_logits(x), 7)
    logits, loss = plain_session(model).run(["logits", "loss"], {case.input_name: x, "labels": labels, **values})
    np.testing.assert_allclose(logits, case.torch_logits(x, values), rtol=1e-5, atol=case.atol)
    np.testing.assert_allclose(loss, case.torch_eval_loss(x, labels, values), rtol=1e-5, atol=case.atol)


def test_export_inference_model_embeds_the_given_values(case):
    values = modified(trained(case.program))
    before = case.program.SerializeToString()
    model = export_inference_model(case.program, values, ["logits"])
    assert case.program.SerializeToString() == before  # the program is never modified
    assert [i.name for i in model.graph.input] == [case.input_name]
    embedded = initializers(model)
    for name, value in values.items():
        np.testing.assert_array_equal(embedded[name], value)
    session = plain_session(model)
    for batch in (2, 5):
        x = case.make_input(batch, batch)
        (logits,) = session.run(["logits"], {case.input_name: x})
        np.testing.assert_allclose(logits, case.torch_logits(x, values), rtol=1e-5, atol=case.atol)


def test_export_inference_model_without_values_is_prune(case):
    exported = export_inference_model(case.program, None)  # outputs default to the forward ones
    pruned = graphforge.compile(case.program, "prune(outputs=logits)").model
    assert exported.SerializeToString() == pruned.SerializeToString()


def test_optimizer_state_values_are_ignored(case):
    """A runtime may pass its whole state: the optimizer's part has no place in inference."""
    state = trained(case.program)
    name = next(iter(state))
    extra = {f"{name}.exp_avg": np.zeros_like(state[name]), f"{name}.exp_avg_sq": np.zeros_like(state[name])}
    model = export_inference_model(case.program, {**state, **extra}, ["logits"])
    assert set(initializers(model)) >= set(state)


def test_bad_values_are_refused():
    case = CASES["mlp_dropout"]()
    with pytest.raises(GraphforgeError, match=r"no initializer 'nope'; its initializers are: .*0\.weight"):
        export_inference_model(case.program, {"nope": np.zeros(3, np.float32)}, ["logits"])
    with pytest.raises(GraphforgeError, match=r"'0\.bias' is float32\[3\], the program's initializer is float\[32\]"):
        export_inference_model(case.program, {"0.bias": np.zeros(3, np.float32)}, ["logits"])
    with pytest.raises(GraphforgeError, match=r"'0\.bias' is float64\[32\]"):
        export_inference_model(case.program, {"0.bias": np.zeros(32)}, ["logits"])


def test_unknown_output_is_refused():
    case = CASES["mlp_dropout"]()
    with pytest.raises(GraphforgeError, match=r"no output 'probs'; its outputs are: logits, loss"):
        eval_model(case.program, ["probs"])
