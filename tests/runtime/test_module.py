"""Module mechanics: the fused train_step equals module(...) + optimizer.step(), state stays
inside onnxruntime (ping-pong buffers), inputs and outputs are checked and named."""

from __future__ import annotations

import _training_models as tm
import numpy as np
import pytest

from graphforge import CheckpointState, GraphforgeError, Module, Optimizer
from graphforge.errors import DeviceError
from graphforge.runtime import CosineSchedule
from graphforge.runtime.sessions import CUDA, provider_works

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def program():
    return tm.compile_program(tm.mlp_onnx(), "adamw(lr=0.01, weight_decay=0.1, clip_grad_norm=1.0)")


def test_train_step_equals_call_then_step(program):
    split, fused = Module(program, device="cpu"), Module(program, device="cpu")
    split_optimizer, fused_optimizer = Optimizer(split), Optimizer(fused)
    for schedule_owner in (split_optimizer, fused_optimizer):
        CosineSchedule(schedule_owner, warmup_steps=3, total_steps=30)
    for x, target in tm.batches(30):
        split_loss = split(x, target)
        split_optimizer.step()
        split_optimizer_lr = split_optimizer.get_learning_rate()
        fused_loss = fused.train_step(x, target)
        assert fused_optimizer.get_learning_rate() == split_optimizer_lr
        assert np.array_equal(split_loss, fused_loss)
        assert split.last_grad_norm == fused.last_grad_norm
    assert split.state.step == fused.state.step == 30
    split_state, fused_state = split.state.tensors, fused.state.tensors
    assert sorted(split_state) == sorted(fused_state)
    for name, value in split_state.items():
        assert np.array_equal(value, fused_state[name]), name


def test_forward_outputs_and_gradients_on_request(program):
    module = Module(program, device="cpu")
    x, target = tm.batches(1)[0]
    loss, y = module(x, target, outputs=["y"])
    assert y.shape == (6, tm.N_OUT) and loss.shape == ()
    np.testing.assert_allclose(loss, np.mean((y - target) ** 2), rtol=1e-6)
    loss2, norm, grad = module.train_step(x=x, labels=target, outputs=["grad_norm", "0.weight_grad"])
    assert np.array_equal(loss, loss2)  # the same parameters: module(...) did not update them
    assert grad.shape == (tm.N_HIDDEN, tm.N_IN) and norm > 0
    assert module.input_names == ["x", "labels"] and module.output_names == ["y"]


def test_parameters_stay_in_onnxruntime_and_are_read_back_as_copies(program):
    state = CheckpointState.from_program(program)
    initial = state.tensors["0.weight"].copy()
    module = Module(program, state, device="cpu", in_place=False)
    assert np.array_equal(state.tensors["0.weight"], initial)
    snapshot = module.parameters["0.weight"]
    x, target = tm.batches(1)[0]
    module.train_step(x, target)
    buffers = [list(c.slots) for c in module.runner.carried.values()]
    assert all(len(pair) == 2 for pair in buffers)
    for _ in range(3):
        module.train_step(x, target)
    # the same two buffers per carried tensor, swapping roles: no per-step allocation or copy
    for pair, carried in zip(buffers, module.runner.carried.values(), strict=True):
        assert pair[0] is carried.slots[0] and pair[1] is carried.slots[1]
    assert np.array_equal(snapshot, initial)  # a read-back is a copy, not a view of a live buffer
    assert not np.array_equal(module.parameters["0.weight"], initial)
    assert not np.array_equal(state.tensors["0.weight"], initial)  # the state is live
    (session,) = module.runner._sessions.values()  # the one session, for this batch's dims
    assert len(session.bindings) == 2  # one IOBinding per ping-pong parity, reused


def test_in_place_holds_parameters_and_states_once(program):
    module = Module(program, device="cpu")
    x, target = tm.batches(1)[0]
    module.train_step(x, target)
    slots = {name: list(c.slots) for name, c in module.runner.carried.items()}
    for _ in range(3):
        module.train_step(x, target)
    for name, c in module.runner.carried.items():
        expected = 1 if c.spec.role in ("parameter", "optimizer") else 2
        assert len(c.slots) == expected, name
        assert all(a is b for a, b in zip(slots[name], c.slots, strict=True)), name  # nothing allocated per step
    assert module.runner.in_place_refused == {}


def test_batch_size_may_change_between_steps(program):
    module = Module(program, device="cpu")
    for batch in (2, 7, 3):
        x, target = tm.batches(1, batch=batch)[0]
        _, y = module.train_step(x, target, outputs=["y"])
        assert y.shape == (batch, tm.N_OUT)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, x, t: m(x), "missing batch input 'labels'"),
        (lambda m, x, t: m(x, t, t), "3 batch inputs given, the program takes 2: x, labels"),
        (lambda m, x, t: m(x, t, z=x), "unknown batch input 'z'"),
        (lambda m, x, t: m(x, t, x=x), "'x' given twice"),
        (
            lambda m, x, t: m(x.astype(np.float64), t),
            r"batch input 'x' must be float32 \(or a type that converts to it without loss\), got float64",
        ),
        (lambda m, x, t: m(x, t, outputs=["nope"]), "output 'nope' is not available"),
        (lambda m, x, t: m(x, t, outputs=["0.weight_next"]), "output '0.weight_next' is not available"),
        (lambda m, x, t: m(x[:, :3], t), "onnxruntime failed to run the program"),
    ],
)
def test_bad_calls_are_refused_with_a_clear_message(program, call, message):
    module = Module(program, device="cpu")
    x, target = tm.batches(1)[0]
    before = module.state.tensors
    with pytest.raises(GraphforgeError, match=message):
        call(module, x, target)
    for name, value in module.state.tensors.items():  # a failed run changes nothing
        assert np.array_equal(value, before[name]), name


def test_step_without_gradients_and_double_attach_are_refused(program):
    state = CheckpointState.from_program(program)
    module = Module(program, state, device="cpu")
    optimizer = Optimizer(module)
    with pytest.raises(GraphforgeError, match="no gradients to apply"):
        optimizer.step()
    with pytest.raises(GraphforgeError, match="already belongs to a Module"):
        Module(program, state, device="cpu")
    Module(program, state.copy(), device="cpu")
    with pytest.raises(GraphforgeError, match="already has an Optimizer"):
        Optimizer(module)
    with pytest.raises(GraphforgeError, match="learning rate must be a finite number"):
        optimizer.set_learning_rate(float("nan"))
    with pytest.raises(GraphforgeError, match="unknown device 'tpu'"):
        Module(program, device="tpu")


def test_not_a_training_program_is_refused():
    with pytest.raises(GraphforgeError, match="not a training program"):
        Module(tm.mlp_onnx(), device="cpu")


def test_learning_rate_defaults_to_the_programs_and_is_settable(program):
    module = Module(program, device="cpu")
    optimizer = Optimizer(module)
    assert optimizer.get_learning_rate() == 0.01 == module.state.learning_rate
    optimizer.set_learning_rate(0.0)
    x, target = tm.batches(1)[0]
    before = module.parameters
    module.train_step(x, target)
    # lr 0: adamw's decay (1 - lr * wd) and the update both vanish
    for name, value in module.parameters.items():
        assert np.array_equal(value, before[name]), name


def test_a_gradient_requested_from_module_call_also_reaches_the_optimizer(program):
    """The gradient output is also sent on to the optimizer segment: bound once, read twice."""
    split, fused = Module(program, device="cpu"), Module(program, device="cpu")
    split_optimizer = Optimizer(split)
    Optimizer(fused)
    for x, target in tm.batches(3):
        loss, grad = split(x, target, outputs=["0.weight_grad"])
        split_optimizer.step()
        fused_loss, fused_grad = fused.train_step(x, target, outputs=["0.weight_grad"])
        assert np.array_equal(loss, fused_loss) and np.array_equal(grad, fused_grad)
        assert grad.shape == (tm.N_HIDDEN, tm.N_IN)
    for name, value in split.parameters.items():
        assert np.array_equal(value, fused.parameters[name]), name


def test_inputs_are_widened_without_loss_and_narrowing_is_refused(program):
    module, reference = Module(program, device="cpu"), Module(program, device="cpu")
    x, target = tm.batches(1)[0]
    x16 = x.astype(np.float16)
    assert np.array_equal(module(x16, target), reference(x16.astype(np.float32), target))
    with pytest.raises(GraphforgeError, match="must be float32"):
        module(x.astype(np.float64), target)


def test_eval_mode_needs_no_labels_for_outputs_only(program):
    module = Module(program, device="cpu").eval()
    x, target = tm.batches(1)[0]
    _, y = module(x, target, outputs=["y"])
    no_loss, y_only = module(x, outputs=["y"])
    assert no_loss is None and np.array_equal(y, y_only)
    with pytest.raises(GraphforgeError, match="missing batch input 'labels'"):
        module(x)  # the loss needs them


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name, value in a.items():
        assert np.array_equal(value, b[name]), name


def test_undo_last_run_restores_the_state_before_it(program):
    module = Module(program, device="cpu", in_place=False)
    Optimizer(module)
    x, target = tm.batches(1)[0]
    module.train_step(x, target)
    before, step, norm = module.state.tensors, module.state.step, module.last_grad_norm
    module.train_step(*tm.batches(1, seed=1)[0])
    undone = module.state.tensors
    module.eval()(x, target)  # an eval run changes nothing and leaves the record alone
    module.train().undo_last_run()
    assert module.state.step == step and module.last_grad_norm == norm
    _assert_same_tensors(module.state.tensors, before)
    with pytest.raises(GraphforgeError, match="nothing to undo"):
        module.undo_last_run()
    module.train_step(*tm.batches(1, seed=1)[0])  # and training goes on from there, as before the undo
    assert module.state.step == step + 1
    _assert_same_tensors(module.state.tensors, undone)


def test_undo_of_the_split_path_restores_counters_and_gradients():
    """An accumulating program: undoing optimizer.step() keeps the accumulated gradients and
    micro-batch count, so the step runs again to the same result; undoing a module(...) call
    takes its gradients out of the accumulators."""
    program = tm.compile_program(tm.mlp_onnx(), "adamw(lr=0.01, accumulate=true)")
    module = Module(program, device="cpu", in_place=False)
    optimizer = Optimizer(module)
    (x, target), (x2, target2) = tm.batches(2)
    module(x, target)
    once = module.state.tensors
    module(x2, target2)
    assert module.state.micro_batch == 2 and not module.state.grad_reset_pending
    module.undo_last_run()  # the second micro-batch
    assert module.state.micro_batch == 1
    _assert_same_tensors(module.state.tensors, once)
    module(x2, target2)
    optimizer.step()
    stepped, norm = module.state.tensors, module.last_grad_norm
    module.undo_last_run()  # the update
    assert (module.state.step, module.state.micro_batch) == (0, 2) and module.last_grad_norm is None
    optimizer.step()
    assert module.state.step == 1 and module.last_grad_norm == norm
    _assert_same_tensors(module.state.tensors, stepped)


@pytest.mark.skipif(provider_works(CUDA), reason="a CUDA device works here")
def test_cuda_without_a_usable_gpu_is_one_clear_error(program):
    with pytest.raises(DeviceError, match=r"device 'cuda' asks for CUDA, but .*use device 'cpu'"):
        Module(program, device="cuda")
    with pytest.raises(DeviceError, match="device 'cuda:1'"):
        Module(program, state=CheckpointState.from_program(program), device="cuda:1")


@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "two buffers"])
def test_sessions_are_specialized_to_the_batch_dims_up_to_a_cap(program, in_place, monkeypatch):
    """Each batch size gets a session made for its dims (onnxruntime folds the shape
    computations), up to MAX_SPECIALIZED sizes; further sizes share the session for any
    dims. The oracle: a Module whose every run is that session for any dims."""
    from graphforge.runtime import runner as runner_module

    sizes = [2, 3, 4, 5, 6, 7, 2, 7]
    data = [tm.batches(1, batch=n, seed=i)[0] for i, n in enumerate(sizes)]
    specialized = Module(program, device="cpu", in_place=in_place)
    specialized_losses = [float(specialized.train_step(x, t)) for x, t in data]
    monkeypatch.setattr(runner_module, "MAX_SPECIALIZED", 0)
    generic = Module(program, device="cpu", in_place=in_place)
    generic_losses = [float(generic.train_step(x, t)) for x, t in data]
    np.testing.assert_allclose(specialized_losses, generic_losses, rtol=1e-6)
    for name, value in generic.state.tensors.items():
        np.testing.assert_allclose(specialized.state.tensors[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    keys = [key for key in specialized.runner._sessions if key[0] in (("segment", 0, ()), ("fused", ()))]
    dims = sorted(dict(key[1])["batch"] for key in keys if isinstance(key[1], tuple) and key[1])
    assert dims == [2, 3, 4, 5]  # the first MAX_SPECIALIZED (4) sizes; 6 and 7 ran the session for any dims
    assert any(key in (("segment", 0, ()), ("fused", ())) for key in specialized.runner._sessions)


def test_batch_dims_reads_the_symbolic_dims_from_the_feeds():
    import onnx.parser

    from graphforge.runtime.runner import batch_dims

    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[batch, 3] x, int64[batch] y, float[2] w) => (float[batch, 3] z) { z = Identity(x) }
    """)
    x, w = np.zeros((5, 3), np.float32), np.zeros(2, np.float32)
    assert batch_dims(model, {"x": x, "y": np.zeros(5, np.int64), "w": w}) == {"batch": 5}
    assert batch_dims(model, {"x": x, "y": np.zeros(4, np.int64)}) is None  # the feeds disagree
    assert batch_dims(model, {"w": w}) is None  # no symbolic dim fed


def test_a_second_module_on_the_program_finds_its_split_made(program, monkeypatch):
    """The forward/backward and update segments are cut once per program and ``norm_first``
    in a process; a second Module on the program (a resume, an evaluation copy) trains on the
    same cut, and equals the first step for step. Another program is cut afresh."""
    from graphforge.placement import step

    monkeypatch.setattr(step, "_splits", type(step._splits)())
    cuts = []
    real = step._cut_in_two
    monkeypatch.setattr(step, "_cut_in_two", lambda *a, **k: cuts.append(k["norm_first"]) or real(*a, **k))
    first, second = Module(program, device="cpu"), Module(program, device="cpu")
    for x, target in tm.batches(3):
        assert np.array_equal(first.train_step(x, target), second.train_step(x, target))
    assert cuts == [True]
    assert first._split_models() is second._split_models()
    Module(program, device="cpu", in_place=False).train_step(*tm.batches(1)[0])  # one whole-step session: no cut
    other = tm.compile_program(tm.mlp_onnx(), "sgd(lr=0.1)")
    Module(other, device="cpu").train_step(*tm.batches(1)[0])
    assert cuts == [True, True]
