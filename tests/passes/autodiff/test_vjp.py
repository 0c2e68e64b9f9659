"""The vjp pass: gradients of named outputs against gradients given at run time (the
``<output>_seed`` inputs), checked against central differences of sum(output * seed) in
float64; its refusals; and its roles (gradients, no loss)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphforge
from graphforge import PipelineError, roles

RNG = np.random.default_rng(0)
W, B = RNG.standard_normal((4, 3)), RNG.standard_normal(3)


def two_outputs(*, weights_as_inputs: bool = False) -> onnx.ModelProto:
    """y = tanh(x W + b) [N, 3] and z = y * y, in float64; ``unused`` is a parameter only the
    output ``other`` reads."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["y"]),
        helper.make_node("Mul", ["y", "y"], ["z"]),
        helper.make_node("Shape", ["y"], ["shape"]),
        helper.make_node("Add", ["unused", "unused"], ["other"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 4])]
    initializers = [numpy_helper.from_array(np.ones(2), "unused")]
    weights = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "b")]
    if weights_as_inputs:
        inputs += [helper.make_tensor_value_info("W", TensorProto.DOUBLE, [4, 3])]
        inputs += [helper.make_tensor_value_info("b", TensorProto.DOUBLE, [3])]
    else:
        initializers += weights
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", 3]),
        helper.make_tensor_value_info("z", TensorProto.DOUBLE, ["N", 3]),
        helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        helper.make_tensor_value_info("other", TensorProto.DOUBLE, [2]),
    ]
    graph = helper.make_graph(nodes, "two_outputs", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def seeded_sum(values: dict, seeds: dict) -> float:
    forward = graphforge.create_session(two_outputs(weights_as_inputs=True), providers=["CPUExecutionProvider"])
    y, z = forward.run(["y", "z"], values)
    return float((y * seeds["y"]).sum() + (z * seeds["z"]).sum())


def test_the_gradients_equal_central_differences_of_the_seeded_sum():
    x = RNG.standard_normal((5, 4))
    seeds = {"y": RNG.standard_normal((5, 3)), "z": RNG.standard_normal((5, 3))}
    with pytest.warns(
        UserWarning, match=r"vjp: 'y', 'z' do not depend on 1 parameter\(s\), which get no gradient: unused"
    ):
        program = graphforge.compile(two_outputs(), "vjp(outputs=[y, z], inputs=[x])").model
    session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
    feeds = {"x": x, "y_seed": seeds["y"], "z_seed": seeds["z"]}
    got = dict(zip(("x", "W", "b"), session.run(["x_grad", "W_grad", "b_grad"], feeds), strict=True))
    values = {"x": x, "W": W, "b": B}
    eps = 1e-6
    for name, value in values.items():
        numeric = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            up, down = value.copy(), value.copy()
            up[index] += eps
            down[index] -= eps
            numeric[index] = (seeded_sum({**values, name: up}, seeds) - seeded_sum({**values, name: down}, seeds)) / (
                2 * eps
            )
        np.testing.assert_allclose(got[name], numeric, rtol=1e-6, atol=1e-8, err_msg=name)
    metadata = {p.key: p.value for p in program.metadata_props}
    assert roles.LOSS not in metadata
    assert json.loads(metadata[roles.GRADIENTS]) == {"W": "W_grad", "b": "b_grad", "x": "x_grad"}
    assert {i.name for i in program.graph.input} >= {"y_seed", "z_seed"}
    assert {o.name for o in program.graph.output} >= {"y", "z", "shape", "other"}  # the outputs stay


def test_one_output_seeded_alone_ignores_the_others():
    program = graphforge.compile(two_outputs(), "vjp(outputs=[z], trainable=[W])").model
    session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
    x, seed = RNG.standard_normal((3, 4)), RNG.standard_normal((3, 3))
    (w_grad,) = session.run(["W_grad"], {"x": x, "z_seed": seed})
    y = np.tanh(x @ W + B)
    np.testing.assert_allclose(w_grad, x.T @ (seed * 2 * y * (1 - y**2)), rtol=1e-12)
    assert "y_seed" not in {i.name for i in program.graph.input}


@pytest.mark.parametrize(
    "pipeline, message",
    [
        ("vjp", "vjp needs outputs=[...]"),
        ("vjp(outputs=[w])", "outputs=['w'] are not graph outputs; the graph outputs are: y, z, shape, other"),
        ("vjp(outputs=[shape])", "output 'shape' is not floating point"),
    ],
)
def test_refusals_name_what_is_wrong(pipeline, message):
    with pytest.raises(PipelineError, match=message.replace("[", r"\[").replace("]", r"\]")):
        graphforge.compile(two_outputs(), pipeline)


def test_a_seed_name_the_model_uses_is_refused():
    model = two_outputs()
    model.graph.node.append(helper.make_node("Identity", ["xw"], ["y_seed"]))
    with pytest.raises(PipelineError, match="cannot add the input 'y_seed': the model already has a tensor"):
        graphforge.compile(model, "vjp(outputs=[y])")
