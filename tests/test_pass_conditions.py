"""Declared pass conditions (requires / refuses / ensures), checked by the PassManager, and the
optimizer's gradient boundary as the named point where a later pass inserts itself."""

from __future__ import annotations

from dataclasses import dataclass

import models
import numpy as np
import onnx_graphsurgeon as gs
import pytest

import graphforge
from graphforge import Model, Pass, PassResult, roles
from graphforge.errors import PipelineError
from graphforge.pass_infra import Fact, PassRegistry, facts_of, unmet_requirement
from graphforge.pass_manager import default_registry
from graphforge.placement.cut import cut
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointState
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.runner import Runner


@dataclass(frozen=True)
class HalveGradients(Pass):
    """What an allreduce or a loss-scale unscale does at the gradient boundary: every reader
    of a boundary tensor reads ``0.5 * g`` instead (the norm, clipping and the update)."""

    name = "halve_gradients"
    requires = (Fact.GRADIENT_BOUNDARY,)

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        tensors = graph.tensors()
        for boundary in roles.get_json(model, roles.GRADIENT_BOUNDARY, {}).values():
            g = tensors[boundary]
            readers = list(g.outputs)
            half = gs.Variable(f"halve::{boundary}", dtype=g.dtype, shape=g.shape)
            graph.nodes.append(
                gs.Node(
                    "Mul", inputs=[g, gs.Constant(f"halve::{boundary}/c", np.array(0.5, np.float32))], outputs=[half]
                )
            )
            for node in readers:
                node.inputs = [half if t is g else t for t in node.inputs]
        graph.toposort()
        return PassResult(model, True)


@dataclass(frozen=True)
class ClaimsAnOptimizer(Pass):
    """Declares it ensures an optimizer step and does not write one."""

    name = "claims_an_optimizer"
    ensures = (Fact.OPTIMIZER,)

    def run(self, model: Model) -> PassResult:
        return PassResult(model, False)


REGISTRY = PassRegistry([*default_registry(), HalveGradients, ClaimsAnOptimizer])


def compile_(text: str, **options):
    return graphforge.PassManager.from_pipeline(text, REGISTRY, **options).run(models.tanh_mlp())


def test_a_pipeline_in_the_wrong_order_is_refused_before_any_pass_runs(tmp_path):
    with pytest.raises(PipelineError) as info:
        compile_("loss(kind=mse, output=y), adamw(lr=0.1), autodiff", dump_dir=tmp_path / "dumps")
    assert str(info.value) == (
        "pass 2 (adamw(lr=0.1)) needs the gradients, which neither the input model nor an earlier pass "
        "provides: put `autodiff` before it in the pipeline"
    )
    assert (info.value.position, info.value.pass_name) == (2, "adamw")
    assert not (tmp_path / "dumps").exists()  # nothing ran, nothing was written
    with pytest.raises(PipelineError, match=r"^pass 1 \(halve_gradients\) needs a gradient boundary, .*optimizer pass"):
        compile_("halve_gradients, loss(kind=mse, output=y), autodiff, sgd")


def test_what_the_input_already_has_counts():
    program = graphforge.compile(models.tanh_mlp(), "loss(kind=mse, output=y), autodiff").model
    assert facts_of(roles.metadata_of(program)) == {Fact.LOSS, Fact.GRADIENTS}
    result = graphforge.compile(program, "sgd(lr=0.1)")  # the gradients come with the input
    assert Fact.OPTIMIZER in facts_of(roles.metadata_of(result.model))


def test_a_second_optimizer_is_refused_naming_the_pass():
    with pytest.raises(PipelineError) as info:
        compile_("loss(kind=mse, output=y), autodiff, sgd(lr=0.1), adam")
    assert str(info.value) == (
        "pass 4 (adam) failed: the model already has an optimizer step, and adam would add another"
    )


def test_a_pass_that_does_not_ensure_what_it_declares_fails():
    with pytest.raises(
        PipelineError, match=r"pass 1 \(claims_an_optimizer\) failed: .*does not record an optimizer step"
    ):
        compile_("claims_an_optimizer")


def test_unmet_requirement_is_a_pure_function_of_the_pipeline():
    sgd, autodiff = REGISTRY.parse("sgd, autodiff")
    assert unmet_requirement([sgd], set()) == (1, sgd, Fact.GRADIENTS)
    assert unmet_requirement([autodiff, sgd], set()) is None
    assert unmet_requirement([sgd], {Fact.GRADIENTS}) is None


def test_the_shipped_passes_declare_their_conditions():
    by_name = {cls.name: cls for cls in default_registry()}
    assert by_name["loss"].ensures == (Fact.LOSS,)
    assert set(by_name["autodiff"].ensures) == {Fact.LOSS, Fact.GRADIENTS}
    for name in ("sgd", "adam", "adamw", "lamb"):
        cls = by_name[name]
        assert (cls.requires, cls.refuses) == ((Fact.GRADIENTS,), (Fact.OPTIMIZER,))
        assert set(cls.ensures) == {Fact.OPTIMIZER, Fact.GRADIENT_BOUNDARY}


@pytest.mark.parametrize("accumulate", [False, True])
def test_everything_after_the_boundary_reads_it(accumulate):
    """The norm, clipping and update read only the boundary tensors, never the gradients or
    the accumulated sums themselves: replacing the boundary's readers reaches all of them."""
    text = (
        f"loss(kind=mse, output=y), autodiff, adamw(lr=0.1, clip_grad_norm=1.0, accumulate={str(accumulate).lower()})"
    )
    program = graphforge.compile(models.tanh_mlp(), text).model
    program_roles = ProgramRoles.read(program)
    boundary = set(program_roles.gradient_boundary.values())
    producers = {out: node for node in program.graph.node for out in node.output}
    before = {producers[b].input[0] for b in boundary}  # what each boundary Identity reads
    for node in program.graph.node:
        if node.name.startswith("optim::") and node.output[0] not in boundary:
            reads_before = set(node.input) & before
            # only the accumulators' next values (their output Identity) read the sums
            assert not reads_before or node.output[0].endswith("_grad_acc_next"), node.name


def test_a_pass_at_the_boundary_reaches_norm_clipping_and_update():
    """Halving every gradient at the boundary equals halving the learning rate for SGD, and
    halves grad_norm: the pass changed what everything after the boundary reads."""
    halved = compile_("loss(kind=mse, output=y), autodiff, sgd(lr=0.2), halve_gradients").model
    reference = compile_("loss(kind=mse, output=y), autodiff, sgd(lr=0.1)").model
    states, norms = [], []
    for program, lr in ((halved, 0.2), (reference, 0.1)):
        module = graphforge.Module(program, device="cpu", update="onnx")
        graphforge.Optimizer(module).set_learning_rate(lr)
        for batch in models.tanh_mlp_batches(3):
            _, norm = module.train_step(**batch, outputs=["grad_norm"])
        states.append(module.parameters)
        norms.append(norm)
    for name, value in states[1].items():
        assert np.array_equal(states[0][name], value), name
    np.testing.assert_allclose(norms[0], norms[1] / 2, rtol=1e-6)


def test_a_runtime_cuts_at_the_boundary():
    """The split path's cut: segment 0 sends exactly the boundary tensors (and what else the
    update reads), and the two segments equal the whole step."""
    program = graphforge.compile(models.tanh_mlp(), "loss(kind=mse, output=y), autodiff, adam(lr=0.1)").model
    program_roles = ProgramRoles.read(program)
    boundary = list(program_roles.gradient_boundary.values())
    segments = cut(program, [boundary])
    assert set(boundary) <= set(segments[0].sends)
    assert not {n for n in segments[1].receives if n.endswith("_grad")}  # the update reads the boundary, not P_grad
    runner = Runner(program_roles.carried, resolve_device("cpu"))
    runner.write_tensors(CheckpointState.from_program(program).tensors)
    runs = [runner.segment(s, fetch=["loss"] if "loss" in s.outputs else []) for s in segments]
    module = graphforge.Module(program, device="cpu", update="onnx")
    for step, batch in enumerate(models.tanh_mlp_batches(2)):
        scalars = {"lr": np.array(0.1, np.float32), "step": np.array(step, np.int64)}
        loss = runner.execute(runs, {**batch, **scalars}).host["loss"]
        assert np.array_equal(loss, module.train_step(**batch))
    for name, value in module.state.tensors.items():
        assert np.array_equal(runner.read_tensors([name])[name], value), name
