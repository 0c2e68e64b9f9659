"""Un-broadcasting decided when the program is built: operands whose symbolic dims are equal
(related by onnxruntime's symbolic shape inference through the export's shape arithmetic)
take their gradient as it is, with no run-time reduction (NonZero and the Shape/Equal chain
before it); dims that may still broadcast stay decided at run time."""

from __future__ import annotations

import json

import models
import numpy as np
import onnx

import graphforge
from graphforge import roles
from graphforge.graph import Model
from graphforge.shapes import infer_shapes, relate_dims

#: two operands whose symbolic dims may be 1 at run time: nothing may be assumed
BROADCAST = """
<ir_version: 8, opset_import: ["" : 17]>
broadcast (float[a, 3] x, float[n, 3] z) => (float[m, 3] y) {
    y = Add(x, z)
}
"""


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_dims_that_may_broadcast_stay_decided_at_run_time():
    model = Model.from_proto(models.parse(BROADCAST))
    infer_shapes(model, in_place=True)
    relate_dims(model)
    tensors = model.graph.tensors()
    assert tensors["y"].shape[0] not in ("a", "n")  # neither operand's: either may be 1
    program = graphforge.compile(models.parse(BROADCAST), "vjp(outputs=[y], inputs=[x, z])").model
    assert "NonZero" in _ops(program)
    session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
    seed = np.arange(12, dtype=np.float32).reshape(4, 3)
    dx, dz = session.run(["x_grad", "z_grad"], {"x": np.ones((1, 3), np.float32), "z": np.ones((4, 3), np.float32),
                                                 "y_seed": seed})  # fmt: skip
    np.testing.assert_array_equal(dx, seed.sum(axis=0, keepdims=True))
    np.testing.assert_array_equal(dz, seed)


def test_a_gpt2_exports_residual_operands_are_related_and_take_their_gradient_as_it_is(transformer_path):
    """After attention's Split and head Reshapes, ONNX's inference has fresh names for the
    residual's first operand; related, the backward of GPT-2 needs no run-time reduction. (Its
    gradients against torch autograd: test_models_vs_torch.py, over several batch and sequence sizes.)"""
    model = Model.from_proto(onnx.load(transformer_path))
    infer_shapes(model, in_place=True)
    residual = next(n for n in model.graph.nodes if n.name == "/inner/transformer/h.0/Add")
    assert residual.inputs[0].shape != residual.inputs[1].shape
    assert relate_dims(model) > 0
    assert residual.inputs[0].shape == residual.inputs[1].shape == ["batch", "seq", 32]
    program = graphforge.compile(transformer_path, "loss(kind=cross_entropy, output=logits), autodiff").model
    assert "NonZero" not in _ops(program)
    assert len(json.loads(roles.metadata_of(program)[roles.GRADIENTS])) > 10
