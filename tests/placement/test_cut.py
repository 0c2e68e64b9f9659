"""Cutting a program into segments: the segments run in sequence (by the runner's executor)
equal the uncut program."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import graphforge
from graphforge.placement.cut import cut
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.runner import Runner


@pytest.fixture(scope="module")
def program(mlp_path):
    """Forward + loss + backward of the torch MLP from conftest, as one program."""
    return graphforge.compile(mlp_path, "loss(kind=mse, output=y), autodiff").model


def _feeds(program, batch=5, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    inits = {t.name for t in program.graph.initializer}
    for v in program.graph.input:
        if v.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else batch for d in v.type.tensor_type.shape.dim]
        if v.name == "labels":  # mse targets are shaped like the MLP's output y [batch, 4]
            dims = [batch, 4]
        feeds[v.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _run_whole(program, feeds):
    session = graphforge.create_session(program)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _run_cut(segments, feeds, between=None):
    """Every program output of the segments, run in order with ``between`` as the hook."""
    runner = Runner([], resolve_device("cpu"))
    return runner.execute([runner.segment(s) for s in segments], feeds, hook=between).host


def test_cut_at_gradients_equals_the_whole_program(program):
    grads = [o.name for o in program.graph.output if o.name.endswith("_grad")]
    segments = cut(program, [grads])
    assert len(segments) == 2
    assert segments[0].sends[: len(grads)] == grads  # the boundary first, then other crossing tensors
    feeds = _feeds(program)
    whole, pieces = _run_whole(program, feeds), _run_cut(segments, feeds)
    assert sorted(pieces) == sorted(whole)
    for name, value in whole.items():
        np.testing.assert_array_equal(pieces[name], value, err_msg=name)


def test_cut_mid_forward_names_every_crossing_tensor(program):
    """A boundary inside the forward pass: the backward half needs forward activations too,
    and they cross the cut, named explicitly."""
    first_matmul = next(n for n in program.graph.node if n.op_type in ("Gemm", "MatMul"))
    segments = cut(program, [[first_matmul.output[0]]])
    assert first_matmul.output[0] in segments[0].sends
    assert set(segments[1].receives) == set(segments[0].sends)
    feeds = _feeds(program, batch=3)
    whole, pieces = _run_whole(program, feeds), _run_cut(segments, feeds)
    for name, value in whole.items():
        np.testing.assert_array_equal(pieces[name], value, err_msg=name)


def test_between_hook_replaces_what_crosses(program):
    grads = [o.name for o in program.graph.output if o.name.endswith("_grad")]
    segments = cut(program, [grads])
    feeds = _feeds(program)
    seen = []

    def halve(index, sent):
        seen.append((index, sorted(sent)))
        return {name: ort.OrtValue.ortvalue_from_numpy(np.asarray(value.numpy() / 2)) for name, value in sent.items()}

    pieces = _run_cut(segments, feeds, between=halve)
    whole = _run_whole(program, feeds)
    assert seen[0][0] == 0 and set(grads) <= set(seen[0][1])
    for g in grads:  # program outputs come from the segment itself, before the hook
        np.testing.assert_array_equal(pieces[g], whole[g])
    # the loss value crosses to the last segment (which writes the output `loss`): halved
    np.testing.assert_allclose(pieces["loss"], whole["loss"] / 2, rtol=1e-6)


def test_three_segments_and_pass_through_output():
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["a"]),
            helper.make_node("Tanh", ["a"], ["b"]),
            helper.make_node("Add", ["b", "a"], ["c"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])],
        [numpy_helper.from_array(np.array([2.0], np.float32), "w")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    segments = cut(model, [["a"], ["b"]])
    assert [s.sends for s in segments] == [["a"], ["b"], []]
    assert segments[2].receives == ["a", "b"] or sorted(segments[2].receives) == ["a", "b"]
    x = np.array([0.5, -1.0, 2.0], np.float32)
    out = _run_cut(segments, {"x": x})
    np.testing.assert_allclose(out["c"], np.tanh(2 * x) + 2 * x, rtol=1e-6)
    np.testing.assert_array_equal(out["x"], x)


def test_unknown_boundary_tensor_is_named(program):
    with pytest.raises(graphforge.GraphforgeError, match="no_such_tensor"):
        cut(program, [["no_such_tensor"]])


def test_overridable_initializers_stay_segment_inputs(mlp_path):
    """Parameters that are initializers *and* graph inputs (an optimizer program's) stay
    overridable in every segment that reads them: fed values replace the defaults."""
    program = graphforge.compile(mlp_path, "loss(kind=mse, output=y), autodiff, sgd(lr=0.1)").model
    params = [v.name for v in program.graph.input if v.name in {t.name for t in program.graph.initializer}]
    assert params
    grads = [o.name for o in program.graph.output if o.name.endswith("_grad")]
    segments = cut(program, [grads])
    for name in params:  # read by the forward/backward segment and by the update
        assert all(name in s.inputs for s in segments), name
        assert all(name in [i.name for i in s.model.graph.input] for s in segments), name
    feeds = _feeds(program)
    feeds.update({"lr": np.array(0.1, np.float32), "step": np.array(0, np.int64)})
    inits = {t.name: numpy_helper.to_array(t) for t in program.graph.initializer}
    feeds.update({name: inits[name] * 0.5 for name in params})
    whole, pieces = _run_whole(program, feeds), _run_cut(segments, feeds)
    for name, value in whole.items():
        np.testing.assert_array_equal(pieces[name], value, err_msg=name)
    assert not np.array_equal(
        whole["loss"], _run_whole(program, {k: v for k, v in feeds.items() if k not in params})["loss"]
    )
