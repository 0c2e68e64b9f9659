"""Tensor parallelism's marker calls through autodiff (passes/autodiff/rules/parallel.py): the
backward of a split MLP block has g where the forward has f and f where it has g (Megatron-LM's
rule, which puts the gradient's all-reduce where the split layer's input was copied), and on
one process, where both are Identity, the gradients are the unmarked block's, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphforge
from graphforge import roles

COPY, REDUCE = roles.TENSOR_PARALLEL_COPY_OP, roles.TENSOR_PARALLEL_REDUCE_OP


def _marker(op: str) -> onnx.FunctionProto:
    body = [helper.make_node("Identity", ["x"], ["y"])]
    return helper.make_function(roles.MARKER_DOMAIN, op, ["x"], ["y"], body, [helper.make_opsetid("", 18)], ["group"])


def _block(marked: bool) -> onnx.ModelProto:
    """y = (tanh(f(x) @ w1) @ w2 → g) + b: the MLP block a column split of w1 and a row split
    of w2 make, with its markers (``marked``) or without."""
    rng = np.random.default_rng(0)
    weights = {
        "w1": rng.standard_normal((4, 6)).astype(np.float32),
        "w2": rng.standard_normal((6, 3)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
    }

    def through(op, source, target):
        if marked:
            return [helper.make_node(op, [source], [target], domain=roles.MARKER_DOMAIN, group=0)]
        return [helper.make_node("Identity", [source], [target])]

    nodes = [
        *through(COPY, "x", "x_copied"),
        helper.make_node("MatMul", ["x_copied", "w1"], ["h"]),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("MatMul", ["a", "w2"], ["partial"]),
        *through(REDUCE, "partial", "summed"),
        helper.make_node("Add", ["summed", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    imports = [helper.make_opsetid("", 18), helper.make_opsetid(roles.MARKER_DOMAIN, 1)]
    functions = [_marker(COPY), _marker(REDUCE)] if marked else []
    return helper.make_model(graph, opset_imports=imports, functions=functions, ir_version=8)


def _gradients(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    program = graphforge.compile(model, "loss(kind=mse, output=y), autodiff").model
    session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
    names = [o.name for o in program.graph.output if o.name.endswith("_grad")]
    return dict(zip(names, session.run(names, feeds), strict=True)), program


def test_each_markers_gradient_is_the_other_marker_and_one_process_computes_the_unmarked_block():
    rng = np.random.default_rng(1)
    feeds = {
        "x": rng.standard_normal((5, 4)).astype(np.float32),
        "labels": rng.standard_normal((5, 3)).astype(np.float32),
    }
    marked, program = _gradients(_block(True), feeds)
    plain, _ = _gradients(_block(False), feeds)
    assert set(marked) == set(plain) == {"w1_grad", "w2_grad", "b_grad"}
    for name, value in plain.items():
        np.testing.assert_array_equal(marked[name], value, err_msg=name)
    calls = [n for n in program.graph.node if n.domain == roles.MARKER_DOMAIN]
    forward = {n.op_type: n for n in calls if n.output[0] in ("x_copied", "summed")}
    backward = [n for n in calls if n not in forward.values()]
    # g's gradient (of "summed") is copied to every member; f's gradient (of "x_copied") would be
    # summed over the group, but x is an input, not a parameter: nothing asks for it
    assert [n.op_type for n in backward] == [COPY]
    assert backward[0].input[0] in {n for node in program.graph.node for n in node.output}
    assert {f.name for f in program.functions} >= {COPY, REDUCE}


def _after_a_layer(marked: bool) -> onnx.ModelProto:
    """The block after a layer of its own: x -> Tanh -> the block's input."""
    model = _block(marked)
    model.graph.node.insert(0, helper.make_node("Tanh", ["x"], ["x_in"]))
    model.graph.node[1].input[0] = "x_in"
    return model


def test_the_gradient_of_a_copied_activation_is_summed_over_the_group():
    """Where the marked input is an activation whose gradient flows on (a block after another),
    its gradient goes through g (the members' partial gradients summed), and on one process it
    is the unmarked block's."""
    rng = np.random.default_rng(2)
    feeds = {
        "x": rng.standard_normal((5, 4)).astype(np.float32),
        "labels": rng.standard_normal((5, 3)).astype(np.float32),
    }
    grads = {}
    for marked in (True, False):
        program = graphforge.compile(_after_a_layer(marked), "loss(kind=mse, output=y), autodiff(inputs=[x])").model
        session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
        names = [o.name for o in program.graph.output if o.name.endswith("_grad")]
        grads[marked] = dict(zip(names, session.run(names, feeds), strict=True))
        if marked:
            ops = [n.op_type for n in program.graph.node if n.domain == roles.MARKER_DOMAIN]
            assert sorted(ops) == sorted([COPY, REDUCE, REDUCE, COPY])  # f and g forward, g and f backward
    assert "x_grad" in grads[True] and set(grads[True]) == set(grads[False])
    for name, value in grads[False].items():
        np.testing.assert_array_equal(grads[True][name], value, err_msg=name)
