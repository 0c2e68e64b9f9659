"""The prune pass: a training program back to a plain inference model, against torch in eval mode."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from _training_programs import (
    CASES,
    batch_norm_in_training_mode,
    dim_params,
    dropout_in_training_mode,
    initializers,
    metadata,
    plain_session,
)
from graphforge.passes.prune import Prune

import graphforge
from graphforge import roles
from graphforge.errors import PipelineError, PipelineSpecError
from graphforge.graph import Model
from graphforge.pass_manager import parse_pipeline

pytest.importorskip("torch")

TRAINING_PREFIXES = ("grad::", "optim::", "loss::")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    return CASES[request.param]()


@pytest.fixture(scope="module")
def pruned(case):
    result = graphforge.compile(case.program, "prune(outputs=logits)")
    return result


def test_pruned_program_matches_torch_eval_at_two_batch_sizes(case, pruned):
    session = plain_session(pruned.model)
    for batch in (2, 5):
        x = case.make_input(batch, batch)
        (logits,) = session.run(["logits"], {case.input_name: x})
        np.testing.assert_allclose(logits, case.torch_logits(x), rtol=1e-5, atol=case.atol)
    (optimized,) = plain_session(pruned.model, optimized=True).run(["logits"], {case.input_name: x})
    np.testing.assert_allclose(optimized, logits, rtol=1e-5, atol=case.atol)
    # the dynamic dims stay dynamic
    assert dim_params(pruned.model.graph.input[0]) == dim_params(case.forward.graph.input[0])
    assert dim_params(pruned.model.graph.output[0]) == dim_params(case.forward.graph.output[0])


def test_pruned_program_has_nothing_of_training(case, pruned):
    model = pruned.model
    assert [i.name for i in model.graph.input] == [case.input_name]  # no labels, lr, step, states
    assert [o.name for o in model.graph.output] == ["logits"]
    assert not [n.name for n in model.graph.node if n.name.startswith(TRAINING_PREFIXES)]
    assert not dropout_in_training_mode(model)
    assert not batch_norm_in_training_mode(model)
    assert "Dropout" not in {n.op_type for n in model.graph.node}  # inference-mode Dropout is the identity
    # parameters are plain initializers again, under their own names, with the program's values
    program_values = initializers(case.program)
    for name, value in initializers(model).items():
        if name in program_values:
            np.testing.assert_array_equal(value, program_values[name])
    parameters = json.loads(metadata(case.program)[roles.PARAMETERS])
    assert set(parameters) <= set(initializers(model))
    # training roles go, the optimizer is recorded
    meta = metadata(model)
    assert [k for k in meta if k.startswith("graphforge.")] == [roles.EXPORTED_FROM]
    assert json.loads(meta[roles.EXPORTED_FROM])["optimizer"]["kind"] == "adamw"


def test_pruned_program_is_smaller(case, pruned):
    model = pruned.model
    assert len(model.graph.node) < len(case.program.graph.node)
    assert model.ByteSize() < case.program.ByteSize()
    record = pruned.records[0]
    assert record.nodes_after < record.nodes_before
    assert f"nodes {record.nodes_before} → {record.nodes_after}" in record.note


def test_pruned_maxpool_writes_no_indices():
    """Case 10: autodiff has MaxPool write its indices for the gradient; the export does not
    (onnxruntime's CPU MaxPool is several times slower writing them), as torch's did not."""
    case = CASES["cnn_batchnorm"]()
    model = graphforge.compile(case.program, "prune(outputs=logits)").model
    for source, outputs in ((case.forward, 1), (case.program, 2), (model, 1)):
        assert [len(n.output) for n in source.graph.node if n.op_type == "MaxPool"] == [outputs]


def test_prune_keeps_the_interface_and_parameters_of_the_export(case, pruned):
    """The inputs are the export's; its floating-point initializers (the parameters) are
    the pruned model's, none folded away or added."""
    assert [i.name for i in pruned.model.graph.input] == [i.name for i in case.forward.graph.input]

    def floats(model):
        return {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}

    assert floats(pruned.model) == floats(case.forward)


def test_prune_on_autodiff_only_and_loss_only_models(case):
    for pipeline in ("loss(kind=mse, output=logits)", "loss(kind=mse, output=logits), autodiff"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            partial = graphforge.compile(case.forward, pipeline).model
        model = graphforge.compile(partial, "prune(outputs=logits)").model
        assert [i.name for i in model.graph.input] == [case.input_name]
        assert not metadata(model)  # no optimizer: nothing to record
        x = case.make_input(3, 0)
        (logits,) = plain_session(model).run(["logits"], {case.input_name: x})
        np.testing.assert_allclose(logits, case.torch_logits(x), rtol=1e-5, atol=case.atol)


def test_prune_can_keep_the_loss_and_labels(case):
    model = graphforge.compile(case.program, "prune(outputs=[logits, loss])").model
    assert [i.name for i in model.graph.input] == [case.input_name, "labels"]
    assert metadata(model)[roles.LOSS] == "loss" and metadata(model)[roles.LABELS] == "labels"
    x = case.make_input(4, 1)
    logits = case.torch_logits(x)
    labels = case.make_labels(logits, 1)
    loss = plain_session(model).run(["loss"], {case.input_name: x, "labels": labels})[0]
    np.testing.assert_allclose(loss, case.torch_eval_loss(x, labels), rtol=1e-5, atol=case.atol)


def test_inference_false_keeps_training_mode(case):
    """Must not fire: with inference=false Dropout and BatchNorm stay as they were."""
    model = graphforge.compile(case.program, "prune(outputs=logits, inference=false)").model
    training_nodes = dropout_in_training_mode(model) + batch_norm_in_training_mode(model)
    assert training_nodes == dropout_in_training_mode(case.forward) + batch_norm_in_training_mode(case.forward)
    assert [i.name for i in model.graph.input] == [case.input_name]
    # case 10: the masks nothing reads are not written (torch's training-mode export writes them)
    assert all(len(n.output) == 1 for n in model.graph.node if n.op_type == "Dropout")


# --------------------------------------------------------------------------- forward-only models


def test_prune_of_a_clean_forward_model_to_all_outputs_is_a_no_op(mlp_path):
    source = graphforge.load(mlp_path)
    result = graphforge.compile(source, "prune(outputs=y)")
    assert not result.records[0].changed
    model = result.model
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in source.graph.node]
    assert [i.name for i in model.graph.input] == [i.name for i in source.graph.input]
    assert [o.name for o in model.graph.output] == [o.name for o in source.graph.output]
    assert initializers(model).keys() == initializers(source).keys()
    models.assert_same_outputs(source, model, dims={"batch": 4})


def test_prune_of_a_forward_transformer_only_cleans_up(transformer_path):
    source = graphforge.load(transformer_path)
    model = graphforge.compile(source, "prune(outputs=logits)").model
    assert [i.name for i in model.graph.input] == ["input_ids"]
    assert [o.name for o in model.graph.output] == ["logits"]
    assert len(model.graph.node) <= len(source.graph.node)
    assert set(initializers(source)) - set(initializers(model)) == set()  # no parameter folded away
    for batch, seq in ((1, 5), (3, 9)):
        models.assert_same_outputs(source, model, dims={"batch": batch, "seq": seq}, seeds=(batch,))


def test_program_without_dropout_or_batchnorm(mlp_path):
    """An MLP with neither: prune of its training program is the exported forward model again."""
    source = graphforge.load(mlp_path)
    program = graphforge.compile(source, "loss(kind=mse, output=y), autodiff, sgd(lr=0.1, momentum=0.9)").model
    model = graphforge.compile(program, "prune(outputs=y)").model
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in source.graph.node]
    assert [i.name for i in model.graph.input] == ["x"]
    assert json.loads(metadata(model)[roles.EXPORTED_FROM])["optimizer"]["kind"] == "sgd"
    models.assert_same_outputs(source, model, dims={"batch": 6})


def test_prune_keeps_an_unread_input_when_asked(mlp_path):
    program = graphforge.compile(graphforge.load(mlp_path), "loss(kind=mse, output=y), autodiff, adamw").model
    model = graphforge.compile(program, "prune(outputs=y, keep_inputs=[labels, lr])").model
    assert [i.name for i in model.graph.input] == ["x", "labels", "lr"]
    assert roles.LABELS in metadata(model) and roles.LR not in metadata(model)


# --------------------------------------------------------------------------- errors and parameters


def test_unknown_output_lists_the_available_ones(mlp_path):
    program = graphforge.compile(graphforge.load(mlp_path), "loss(kind=mse, output=y), autodiff, adamw").model
    with pytest.raises(PipelineError) as failure:
        graphforge.compile(program, "prune(outputs=logits)")
    message = str(failure.value)
    assert "no output 'logits'" in message
    assert "its outputs are: y, loss, " in message and "grad_norm" in message


def test_unknown_keep_input_lists_the_inputs(mlp_path):
    with pytest.raises(PipelineError, match=r"keep_inputs names 'labels'.*its inputs are: x"):
        graphforge.compile(graphforge.load(mlp_path), "prune(outputs=y, keep_inputs=labels)")


def test_batchnorm_statistics_cannot_be_kept_in_inference_mode():
    from _training_programs import cnn_with_batchnorm

    program = cnn_with_batchnorm().program
    with pytest.raises(PipelineError, match="inference=false"):
        graphforge.compile(program, "prune(outputs=[logits, bn.running_mean_next])")
    model = graphforge.compile(program, "prune(outputs=[logits, bn.running_mean_next], inference=false)").model
    assert [o.name for o in model.graph.output] == ["logits", "bn.running_mean_next"]


@pytest.mark.parametrize("text", ["prune", "prune(outputs=[])"])
def test_outputs_must_be_named(mlp_path, text):
    with pytest.raises(
        PipelineError, match=re.escape("name the outputs to keep with outputs=NAME or outputs=[A, B] (outputs: y)")
    ):
        graphforge.compile(graphforge.load(mlp_path), text)


def test_an_output_named_twice_is_refused():
    with pytest.raises(PipelineSpecError, match="outputs names 'y' more than once"):
        parse_pipeline("prune(outputs=[y, y])")


def test_spec_round_trips():
    (pass_,) = parse_pipeline("prune(outputs=logits, keep_inputs=[a, b], inference=false)")
    assert pass_ == Prune(outputs="logits", keep_inputs=["a", "b"], inference=False)
    assert parse_pipeline(pass_.spec()) == [pass_]


def test_run_directly_reports_the_size():
    source = models.linear_model()  # has an Identity the cleanup removes
    result = Prune(outputs=("y",)).run(Model.from_proto(source))
    assert result.changed
    assert result.note.startswith("nodes 4 → 3, inputs 1 → 1, outputs 1 → 1")


def test_cli_prints_the_size_report(tmp_path, mlp_path):
    program = graphforge.compile(graphforge.load(mlp_path), "loss(kind=mse, output=y), autodiff, adamw").model
    graphforge.save(program, tmp_path / "program.onnx")
    done = subprocess.run(
        [Path(sys.executable).parent / "graphforge", "compile", tmp_path / "program.onnx",
         "-p", "prune(outputs=y)", "-o", tmp_path / "model.onnx"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert re.search(r"prune\(outputs=\[y\]\): nodes \d+ → 5, inputs 22 → 1, outputs 28 → 1", done.stdout)
    assert [i.name for i in onnx.load(tmp_path / "model.onnx").graph.input] == ["x"]
