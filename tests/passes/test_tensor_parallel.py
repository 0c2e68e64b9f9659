"""The tensor_parallel pass (passes/tensor_parallel.py) on MLP blocks. Two oracles: the program
on one process, where the markers are Identity, trains as the unmarked one, bit for bit; and
the split it records is the right one: each of T members' forward with its slices (the first
weight and bias along the hidden features, the second weight along its input features) gives
a partial output, and the sum over the members (the TensorParallelReduce the runtime will do),
the second bias counted once, is the whole model's output."""

from __future__ import annotations

import json
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import graphforge
from graphforge import roles
from graphforge.errors import PipelineError
from graphforge.runtime import Module

#: Gemm (transB) with a bias, Relu, Gemm with a bias
DIGITS = str(Path(__file__).resolve().parents[2] / "examples" / "digits" / "model.onnx")
LOSS = "loss(kind=cross_entropy, output=logits), autodiff"


def _digits_batch(seed: int, batch: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"images": rng.integers(0, 17, (batch, 8, 8)).astype(np.uint8), "labels": rng.integers(0, 10, batch)}


def _role(model: onnx.ModelProto) -> dict:
    return json.loads(next(p.value for p in model.metadata_props if p.key == roles.TENSOR_PARALLEL))


def test_on_one_process_the_marked_program_trains_as_the_unmarked_one():
    marked = graphforge.compile(DIGITS, f"tensor_parallel(size=2), {LOSS}, adamw(lr=0.01)").model
    plain = graphforge.compile(DIGITS, f"{LOSS}, adamw(lr=0.01)").model
    assert _role(marked)["split"] == {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    ops = sorted(n.op_type for n in marked.graph.node if n.domain == roles.MARKER_DOMAIN)
    assert ops == ["TensorParallelCopy", "TensorParallelCopy", "TensorParallelReduce"]  # f, g, and g's gradient f
    a, b = Module(marked, device="cpu", update="onnx"), Module(plain, device="cpu", update="onnx")
    for step in range(5):
        batch = _digits_batch(step)
        np.testing.assert_array_equal(a.train_step(**batch), b.train_step(**batch))
    for name, value in b.parameters.items():
        np.testing.assert_array_equal(a.parameters[name], value, err_msg=name)


def _member(model: onnx.ModelProto, split: dict[str, int], rank: int, size: int) -> onnx.ModelProto:
    """Member ``rank``'s forward: each split parameter's slice, the shapes in between inferred again."""
    member = onnx.ModelProto()
    member.CopyFrom(model)
    for tensor in member.graph.initializer:
        if tensor.name in split:
            value = numpy_helper.to_array(tensor)
            part = np.split(value, size, axis=split[tensor.name])[rank]
            tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(part), tensor.name))
    del member.graph.value_info[:]
    return member


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("source", ["digits", "tanh_mlp"])
def test_the_recorded_split_sums_to_the_whole_models_output(source, size):
    model = onnx.load(DIGITS) if source == "digits" else models.tanh_mlp()
    output = model.graph.output[0].name
    marked = graphforge.compile(model, f"tensor_parallel(size={size})").model
    role = _role(marked)
    assert role["size"] == size and len(role["blocks"]) == 1
    rng = np.random.default_rng(0)
    if source == "digits":
        feeds = {"images": rng.integers(0, 17, (5, 8, 8)).astype(np.uint8)}
    else:
        feeds = {i.name: rng.standard_normal((5, 4)).astype(np.float32) for i in model.graph.input}
    whole = models.run(model, feeds)[output]
    parts = [models.run(_member(marked, role["split"], r, size), feeds)[output] for r in range(size)]
    # every member adds the second bias after its (identity) TensorParallelReduce: the sum has it size times
    (add,) = [n for n in marked.graph.node if n.op_type == "Add" and n.output[0] == output]
    values = {t.name: numpy_helper.to_array(t) for t in marked.graph.initializer}
    np.testing.assert_allclose(sum(parts) - (size - 1) * values[add.input[1]], whole, rtol=1e-5, atol=1e-5)


def test_sizes_that_do_not_divide_and_models_without_a_block_are_refused_by_name():
    with pytest.raises(PipelineError, match=r"node '.*' makes 64 hidden features, which 3 processes cannot split"):
        graphforge.compile(DIGITS, "tensor_parallel(size=3)")
    with pytest.raises(PipelineError, match="no pair of projections"):
        graphforge.compile(models.linear_model(), "tensor_parallel(size=2)")
    model = onnx.load(DIGITS)
    first = next(n.name for n in model.graph.node if n.op_type == "Gemm")
    with pytest.raises(PipelineError, match="no pair of projections"):  # the only block, left replicated
        graphforge.compile(model, f'tensor_parallel(size=2, skip=["{first}"])')
