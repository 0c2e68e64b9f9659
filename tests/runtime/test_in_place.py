"""Parameters and optimizer states updated in place: the same training as two buffers each,
bit for bit; a step that is not finite is skipped, not applied; what cannot be undone says so.
The proof that a buffer may be shared (analysis.memory.in_place_safety) on its own models."""

from __future__ import annotations

import numpy as np
import pytest
from _training_models import batches, cnn_onnx, compile_program, mlp_onnx
from models import parse

from graphforge.analysis.memory import in_place_safety
from graphforge.errors import GraphforgeError
from graphforge.program import ProgramRoles
from graphforge.runtime import Module, Optimizer

OPTIMIZERS = [
    "sgd(lr=0.1, momentum=0.9, weight_decay=0.01)",
    "adamw(lr=0.01, weight_decay=0.1)",
    "lamb(lr=0.01)",
    "adam(lr=0.01, clip_grad_norm=0.5)",
    "adamw(lr=0.01, accumulate=true, clip_grad_norm=1.0)",
]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_in_place_equals_two_buffers_bit_for_bit(optimizer):
    program = compile_program(mlp_onnx(), optimizer)
    in_place, ping_pong = Module(program, device="cpu", update="onnx"), Module(program, device="cpu", in_place=False)
    for x, target in batches(10):
        assert np.array_equal(in_place.train_step(x, target), ping_pong.train_step(x, target))
        assert in_place.last_grad_norm == ping_pong.last_grad_norm
    _same(in_place.state.tensors, ping_pong.state.tensors)
    assert in_place.runner.in_place_refused == {}


def test_in_place_with_batchnorm_and_accumulation_on_the_split_path():
    program = compile_program(cnn_onnx(), "adamw(lr=0.01, accumulate=true)")
    modules = [Module(program, device="cpu", in_place=flag, update="onnx") for flag in (True, False)]
    for module in modules:
        optimizer = Optimizer(module)
        for step in range(3):
            for x, target in batches(2, batch=4, seed=step, shape=(2, 5, 5)):
                module(x, target)
            optimizer.step()
            module.lazy_reset_grad()
    _same(modules[0].state.tensors, modules[1].state.tensors)
    assert modules[0].buffers and modules[0].state.step == 3


def test_a_step_that_is_not_finite_is_skipped_and_training_goes_on():
    program = compile_program(cnn_onnx(), "adamw(lr=0.01)")
    good = batches(2, batch=4, shape=(2, 5, 5))
    bad_x = good[0][0].copy()
    bad_x[0, 0, 0, 0] = np.nan
    skipping, clean = Module(program, device="cpu"), Module(program, device="cpu")
    skipping.train_step(*good[0])
    clean.train_step(*good[0])
    before = skipping.state.tensors
    loss = skipping.train_step(bad_x, good[0][1])
    assert not np.isfinite(loss) and skipping.last_update_skipped
    after = skipping.state.tensors
    for name, spec in ((s.input, s) for s in skipping.roles.carried):
        if spec.role in ("parameter", "optimizer"):
            assert np.array_equal(after[name], before[name]), name
    assert skipping.state.step == 1
    skipping.undo_last_run()  # the BatchNorm statistics the bad forward wrote go too
    _same(skipping.state.tensors, before)
    skipping.train_step(*good[1])
    clean.train_step(*good[1])
    assert not skipping.last_update_skipped
    _same(skipping.state.tensors, clean.state.tensors)


def test_an_update_made_in_place_cannot_be_undone_and_says_so():
    module = Module(compile_program(mlp_onnx(), "sgd(lr=0.1)"), device="cpu")
    module.train_step(*batches(1)[0])
    with pytest.raises(GraphforgeError, match=r"updated \d+ tensors in place .* cannot be undone.*in_place=False"):
        module.undo_last_run()


def test_the_fused_program_without_clipping_refuses_the_weights_a_later_backward_reads():
    """One session for the whole step: the weight gradient of the last layer is ready before
    backward has read the weight for the layer below, so its update may not overwrite it;
    the optimizer states are read by their update alone."""
    program = compile_program(mlp_onnx(), "adamw(lr=0.01)")
    roles = ProgramRoles.of_proto(program)
    refused = in_place_safety(program, {c.input: c.output for c in roles.carried})
    assert "2.weight" in refused and "need not run before" in refused["2.weight"]
    assert not [c.input for c in roles.carried if c.role == "optimizer" and c.input in refused]


def test_in_place_safety_on_readers_views_and_writers():
    side_reader = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        agraph (float[4] p, float[4] g) => (float[4] p_next, float[4] seen)
        {
            seen = Mul(p, g)
            p_next = Sub(p, g)
        }
        """
    )
    refused = in_place_safety(side_reader, {"p": "p_next"})
    assert "need not run before" in refused["p"]  # Mul reads p and does not feed the Sub
    only_view = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        agraph (float[4] p, float[4] g) => (float[4] p_next, float[2,2] v)
        <int64[2] shape = {2, 2}>
        {
            view = Reshape(p, shape)
            v = Identity(view)
            p_next = Sub(p, g)
        }
        """
    )
    assert "p" in in_place_safety(only_view, {"p": "p_next"})  # a view of p is read too
    writer = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        agraph (float[4] p) => (float[4] p_next)
        {
            p_next = Softmax(p)
        }
        """
    )
    assert "(Softmax) reads it while writing" in in_place_safety(writer, {"p": "p_next"})["p"]
    chained = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        agraph (float[4] p, float[4] g) => (float[4] p_next)
        {
            scaled = Mul(p, g)
            p_next = Sub(p, scaled)
        }
        """
    )
    assert in_place_safety(chained, {"p": "p_next"}) == {}


def test_sessions_of_a_step_of_two_runs_do_not_spin():
    """In place, a step is two runs (forward/backward, then the update): their sessions' threads
    must not spin for work after a run, or they take the cores the other session runs on. One
    run a step (two buffers) keeps onnxruntime's spinning; so does a Module whose in-place
    updates were turned off."""
    program = compile_program(mlp_onnx(), "adamw(lr=0.01)")
    x, target = batches(1)[0]

    def spinning(module) -> set[str]:
        module.train_step(x, target)
        sessions = [bound.session for bound in module.runner._sessions.values()]
        assert sessions
        values = set()
        for session in sessions:
            try:
                values.add(session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning"))
            except RuntimeError:  # not set: onnxruntime's default, spinning
                values.add("default")
        return values

    in_place = Module(program, device="cpu", update="onnx")
    assert not in_place.runner.spin and spinning(in_place) == {"0"}
    two_buffers = Module(program, device="cpu", in_place=False)
    assert two_buffers.runner.spin
    assert spinning(two_buffers) == {"default"}
    in_place.runner.disable_in_place()
    assert in_place.runner.spin and spinning(in_place) == {"default"}
