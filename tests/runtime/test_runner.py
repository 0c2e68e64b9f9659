"""The runner's N-segment executor: segments run in sequence equal the uncut program exactly,
carried state included; a hook between segments replaces what crosses (or hands back a
pending result, waited on only when a later segment reads it)."""

from __future__ import annotations

import models
import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest

import graphforge
from graphforge.placement.cut import cut
from graphforge.program import ProgramRoles
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.runner import Runner, SegmentRun


def mlp_program(pipeline: str) -> onnx.ModelProto:
    return graphforge.compile(models.tanh_mlp(), f"loss(kind=mse, output=y), autodiff, {pipeline}").model


def batches(count: int):
    return models.tanh_mlp_batches(count)


def make_runner(program: onnx.ModelProto) -> tuple[Runner, ProgramRoles]:
    roles = ProgramRoles.of_proto(program)
    runner = Runner(roles.carried, resolve_device("cpu"))
    runner.write_tensors(graphforge.CheckpointState.from_program(program).tensors)
    return runner, roles


def scalars(roles: ProgramRoles, step: int, lr: float = 0.05) -> dict[str, np.ndarray]:
    feeds = {roles.lr_input: np.array(lr, np.float32), roles.step_input: np.array(step, np.int64)}
    if roles.reset_input is not None:
        feeds[roles.reset_input] = np.array(True)
    return feeds


def whole(runner: Runner, program: onnx.ModelProto) -> list[SegmentRun]:
    """The uncut program as the one segment of an execution, fetching the loss."""
    return [SegmentRun(runner.session("whole", lambda: program, "the program"), ["loss"])]


def segment_runs(runner: Runner, program: onnx.ModelProto, boundaries, fetch=("loss",)) -> list[SegmentRun]:
    """The program cut at ``boundaries``, each segment fetching what of ``fetch`` it outputs."""
    return [runner.segment(s, fetch=[n for n in fetch if n in s.outputs]) for s in cut(program, boundaries)]


def test_three_segments_in_sequence_equal_the_uncut_program_with_carried_state():
    program = mlp_program("adamw(lr=0.05, clip_grad_norm=0.5, accumulate=true)")
    uncut, roles = make_runner(program)
    split, _ = make_runner(program)
    fused = whole(uncut, program)
    boundary = list(roles.gradient_boundary.values())
    not_update = [o for o in roles.outputs if o not in roles.update_outputs]
    pieces = segment_runs(split, program, [["hidden"], [*boundary, *not_update]])
    assert len(pieces) == 3
    for step, feeds in enumerate(batches(4)):
        a = uncut.execute(fused, {**feeds, **scalars(roles, step)})
        b = split.execute(pieces, {**feeds, **scalars(roles, step)})
        assert np.array_equal(a.host["loss"], b.host["loss"]), step
        assert {c.name for c in a.written} == {c.name for c in b.written} == set(uncut.carried)
    after_whole, after_split = uncut.read_tensors(), split.read_tensors()
    assert sorted(after_whole) == sorted(after_split)
    for name, value in after_whole.items():
        assert np.array_equal(value, after_split[name]), name
    initial = graphforge.CheckpointState.from_program(program).tensors
    assert not np.array_equal(after_whole["w1"], initial["w1"])  # it trained


def test_a_hook_that_doubles_the_gradients_equals_doubling_the_learning_rate():
    """SGD: p - lr * (2 g) == p - (2 lr) * g exactly (scaling by 2 is exact in floating point)."""
    program = mlp_program("sgd(lr=0.05)")
    doubled_lr, roles = make_runner(program)
    hooked, _ = make_runner(program)
    fused = whole(doubled_lr, program)
    boundary = set(roles.gradient_boundary.values())
    pieces = segment_runs(hooked, program, [sorted(boundary)])
    seen = []

    def double(index, sent):  # replaces the gradients only; the rest that crosses stays
        seen.append((index, set(sent)))
        return {
            n: ort.OrtValue.ortvalue_from_numpy(np.asarray(v.numpy() * 2)) for n, v in sent.items() if n in boundary
        }

    for step, feeds in enumerate(batches(3)):
        doubled_lr.execute(fused, {**feeds, **scalars(roles, step, lr=0.1)})
        hooked.execute(pieces, {**feeds, **scalars(roles, step, lr=0.05)}, hook=double)
    assert seen[0][0] == 0 and boundary <= seen[0][1]
    for name, value in doubled_lr.read_tensors().items():
        assert np.array_equal(value, hooked.read_tensors([name])[name]), name
    plain, _ = make_runner(program)
    plain.execute(
        segment_runs(plain, program, [list(roles.gradient_boundary.values())]), {**batches(1)[0], **scalars(roles, 0)}
    )
    assert not np.array_equal(plain.read_tensors(["w1"])["w1"], doubled_lr.read_tensors(["w1"])["w1"])


DIAMOND = onnx.parser.parse_model("""
<ir_version: 8, opset_import: ["" : 17]>
diamond (float[N] x) => (float[N] c)
<float[1] w = {3.0}, float[1] one = {1.0}>
{
    a = Mul(x, w)
    b = Add(x, one)
    c = Add(a, b)
}
""")


class _Later:
    """A pending result: records when it is waited on, then doubles what was sent."""

    def __init__(self, sent, events):
        self.sent, self.events = sent, events
        self.covers = set(sent)

    def wait(self):
        self.events.append("wait")
        return {n: ort.OrtValue.ortvalue_from_numpy(np.asarray(v.numpy() * 2)) for n, v in self.sent.items()}


def test_a_pending_hook_result_is_waited_on_when_a_later_segment_reads_it():
    runner = Runner([], resolve_device("cpu"))
    runs = segment_runs(runner, DIAMOND, [["a"], ["b"]], fetch=["c"])
    events = []

    def hook(index, sent):
        events.append(f"sent {index}: {','.join(sorted(sent))}")
        return _Later(sent, events) if index == 0 else None

    x = np.array([1.0, -2.0, 0.5], np.float32)
    done = runner.execute(runs, {"x": x}, hook=hook)
    # segment 1 (b) does not read a: it runs while a's result is pending; segment 2 waits first
    assert events == ["sent 0: a", "sent 1: b", "wait"]
    np.testing.assert_allclose(done.host["c"], 2 * (3 * x) + (x + 1), rtol=1e-6)
    np.testing.assert_allclose(done.device["a"].numpy(), 6 * x, rtol=1e-6)


def test_hook_mistakes_and_stale_reads_are_refused():
    runner = Runner([], resolve_device("cpu"))
    runs = segment_runs(runner, DIAMOND, [["a"], ["b"]], fetch=["c"])
    x = np.ones(2, np.float32)
    with pytest.raises(
        graphforge.GraphforgeError, match="a hook replaced 'nope', which the segment before it did not send"
    ):
        runner.execute(runs, {"x": x}, hook=lambda k, sent: {"nope": sent[next(iter(sent))]})
    with pytest.raises(graphforge.GraphforgeError, match="missing batch input 'x'"):
        runner.execute(runs, {})

    program = mlp_program("sgd(lr=0.05)")
    trained, roles = make_runner(program)
    (once,) = whole(trained, program)
    feeds = {**batches(1)[0], **scalars(roles, 0)}
    with pytest.raises(graphforge.GraphforgeError, match="reads 'w1', which an earlier segment of this execution"):
        trained.execute([once, once], feeds)


def test_restore_takes_back_what_an_execution_wrote():
    program = mlp_program("adam(lr=0.05)")
    runner, roles = make_runner(program)
    before = runner.read_tensors()
    done = runner.execute(whole(runner, program), {**batches(1)[0], **scalars(roles, 0)})
    assert not np.array_equal(runner.read_tensors(["w1"])["w1"], before["w1"])
    Runner.restore(done.written)
    for name, value in runner.read_tensors().items():
        assert np.array_equal(value, before[name]), name


def test_a_failure_between_segments_leaves_the_carried_state_as_before():
    """Segment 0 writes the accumulators; a hook (or a pending collective) that fails after it
    must not leave them half-updated."""
    program = mlp_program("sgd(lr=0.05, accumulate=true)")
    runner, roles = make_runner(program)
    boundary = list(roles.gradient_boundary.values())
    runs = segment_runs(runner, program, [[*boundary, *(f"{p}_grad_acc_next" for p in roles.gradient_boundary)]])
    assert any(c.spec.role == "accumulator" for c in runs[0].session.carried_out)
    feeds = {**batches(1)[0], **scalars(roles, 0)}
    before = runner.read_tensors()

    class Broken:
        covers = boundary

        def wait(self):
            raise RuntimeError("the collective failed")

    def raising(index, sent):
        raise RuntimeError("the send failed")

    for hook, message in ((raising, "the send failed"), (lambda k, sent: Broken(), "the collective failed")):
        with pytest.raises(RuntimeError, match=message):
            runner.execute(runs, feeds, hook=hook)
        for name, value in runner.read_tensors().items():
            assert np.array_equal(value, before[name]), (message, name)
    done = runner.execute(runs, feeds)  # and it still runs
    assert {c.spec.role for c in done.written} == {"accumulator", "parameter"}
