"""The allreduce pass: marker calls between the gradient boundary and its readers, buckets in
the order backward makes the gradients, a program that still runs unchanged on one process,
and prune inlining the calls away."""

from __future__ import annotations

from pathlib import Path

import models
import numpy as np
import onnx
import pytest

import graphforge
from graphforge import roles
from graphforge.program import ProgramRoles
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.runner import Runner, SegmentRun
from graphforge.runtime.sessions import check_loads

PREFIX = "loss(kind=mse, output=y), autodiff"


def compile_mlp(optimizer: str, allreduce: str | None = "allreduce") -> onnx.ModelProto:
    pipeline = f"{PREFIX}, {optimizer}" + (f", {allreduce}" if allreduce else "")
    return graphforge.compile(models.tanh_mlp(), pipeline).model


def calls(program: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in program.graph.node if n.domain == roles.MARKER_DOMAIN]


def producer_positions(program: onnx.ModelProto) -> dict[str, int]:
    return {out: i for i, node in enumerate(program.graph.node) for out in node.output}


@pytest.mark.parametrize("optimizer", ["sgd(lr=0.1, momentum=0.9, clip_grad_norm=1.0)", "adamw(accumulate=true)"])
def test_every_reader_of_a_boundary_gradient_reads_its_reduced_value(optimizer):
    program = compile_mlp(optimizer)
    program_roles = ProgramRoles.of_proto(program)
    role = program_roles.allreduce
    assert role is not None and role.average and role.bucket_mb == 25.0
    assert sorted(role.reduced) == sorted(program_roles.gradient_boundary) == ["b1", "b2", "w1", "w2"]
    by_output = {n.output[0]: n for n in calls(program)}
    for p, boundary in program_roles.gradient_boundary.items():
        call = by_output[role.reduced[p]]
        assert list(call.input) == [boundary] and call.op_type == roles.ALLREDUCE_OP
        readers = [n for n in program.graph.node if boundary in n.input]
        assert readers == [call], p  # clipping, grad_norm and the update read the reduced value
        assert any(role.reduced[p] in n.input for n in program.graph.node if n is not call)
    function = {(f.domain, f.name): f for f in program.functions}[(roles.MARKER_DOMAIN, roles.ALLREDUCE_OP)]
    assert [n.op_type for n in function.node] == ["Identity"]
    assert roles.MARKER_DOMAIN in {o.domain for o in program.opset_import}
    onnx.checker.check_model(program, full_check=True)


def test_buckets_hold_gradients_in_the_order_backward_makes_them():
    program = compile_mlp("sgd(lr=0.1)")
    role = ProgramRoles.of_proto(program).allreduce
    assert len(role.buckets) == 1  # 4 small gradients fit one 25 MiB bucket
    made_at = producer_positions(program)  # the program's node order is the one backward runs in
    gradients = ProgramRoles.of_proto(program).gradients
    order = [made_at[gradients[p]] for p in role.buckets[0]]
    assert order == sorted(order)
    assert set(role.buckets[0][:2]) == {"w2", "b2"}  # the last layer's first, as DDP's reducer

    tiny = compile_mlp("sgd(lr=0.1)", "allreduce(bucket_mb=0.0001)")  # 104 bytes: w1 (128 B) alone
    tiny_role = ProgramRoles.of_proto(tiny).allreduce
    assert [p for bucket in tiny_role.buckets for p in bucket] == list(role.buckets[0])
    assert all(len(b) == 1 for b in tiny_role.buckets if "w1" in b or "w2" in b)
    for node in calls(tiny):
        (attribute,) = node.attribute
        parameter = node.output[0].removeprefix(roles.ALLREDUCE_PREFIX)
        assert parameter in tiny_role.buckets[attribute.i]


def _train(program: onnx.ModelProto, steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    program_roles = ProgramRoles.of_proto(program)
    runner = Runner(program_roles.carried, resolve_device("cpu"))
    runner.write_tensors(graphforge.CheckpointState.from_program(program).tensors)
    run = [SegmentRun(runner.session("whole", lambda: program, "the program"), ["loss"])]
    losses = []
    for step, batch in enumerate(models.tanh_mlp_batches(steps)):
        feeds = {**batch, program_roles.lr_input: np.array(0.05, np.float32)}
        feeds[program_roles.step_input] = np.array(step, np.int64)
        if program_roles.reset_input is not None:
            feeds[program_roles.reset_input] = np.array(step % 2 == 0)
        losses.append(float(runner.execute(run, feeds).host["loss"]))
    return losses, runner.read_tensors()


@pytest.mark.parametrize("optimizer", ["sgd(lr=0.1, momentum=0.9)", "adamw(clip_grad_norm=0.5, accumulate=true)"])
def test_on_one_process_the_program_trains_exactly_as_without_the_pass(optimizer):
    plain_losses, plain_state = _train(compile_mlp(optimizer, None), 6)
    marked_losses, marked_state = _train(compile_mlp(optimizer), 6)
    assert plain_losses == marked_losses
    assert sorted(plain_state) == sorted(marked_state)
    for name, value in plain_state.items():
        assert np.array_equal(value, marked_state[name]), name


def test_verify_passes_and_prune_inlines_the_calls_away():
    program = compile_mlp("adamw(clip_grad_norm=1.0)")
    graphforge.verify_model(program)
    check_loads(program, where="the program")  # stock onnxruntime runs it as it is
    keep = "prune(outputs=[y, grad_norm], inference=false)"  # grad_norm reads the reduced gradients
    pruned = graphforge.compile(program, keep).model
    assert not calls(pruned) and not pruned.functions
    assert roles.MARKER_DOMAIN not in {o.domain for o in pruned.opset_import}
    assert not any(p.key.startswith(roles.ALLREDUCE) for p in pruned.metadata_props)
    feeds = models.tanh_mlp_batches(1)[0]
    plain = graphforge.compile(compile_mlp("adamw(clip_grad_norm=1.0)", None), keep).model
    a, b = models.run(pruned, feeds), models.run(plain, feeds)
    assert sorted(a) == ["grad_norm", "y"]
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_the_pass_needs_an_optimizer_and_runs_once():
    with pytest.raises(graphforge.GraphforgeError, match=r"\(allreduce\) needs a gradient boundary.*optimizer pass"):
        graphforge.compile(models.tanh_mlp(), f"{PREFIX}, allreduce")
    with pytest.raises(graphforge.GraphforgeError, match="already has the gradients' allreduce"):
        graphforge.compile(models.tanh_mlp(), f"{PREFIX}, sgd, allreduce, allreduce")
    with pytest.raises(graphforge.GraphforgeError, match="bucket_mb"):
        graphforge.compile(models.tanh_mlp(), f"{PREFIX}, sgd, allreduce(bucket_mb=0)")


def test_the_golden_of_the_marked_program_records_the_plain_programs_values():
    """golden_models/demo_mlp trains with and without the pass (3 AdamW steps, the export):
    at world size 1 every recorded value is the same, bit for bit."""
    expected = Path(__file__).resolve().parents[2] / "golden_models" / "demo_mlp" / "expected"
    plain, marked = np.load(expected / "train_adamw.npz"), np.load(expected / "train_adamw_allreduce.npz")
    assert sorted(plain.files) == sorted(marked.files) and plain.files
    for name in plain.files:
        assert np.array_equal(plain[name], marked[name]), name
