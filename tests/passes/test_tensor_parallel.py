"""The tensor_parallel pass (passes/tensor_parallel.py) on MLP blocks. Two oracles: the program
on one process, where the markers are Identity, trains as the unmarked one, bit for bit; and
each member's program (``rank=r``: the first weights and biases sliced along the hidden
features, the second weight along its input features) computes a partial product whose sum
over the members (the TensorParallelReduce the runtime does) is the whole model's. Training
across processes: tests/distributed/test_tensor_parallel_members.py."""

from __future__ import annotations

import json
import warnings
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
    # f, g's gradient f; g, and the sum of the slices' squares in the global gradient norm
    assert ops == ["TensorParallelCopy", "TensorParallelCopy", "TensorParallelReduce", "TensorParallelReduce"]
    a, b = Module(marked, device="cpu", update="onnx"), Module(plain, device="cpu", update="onnx")
    for step in range(5):
        batch = _digits_batch(step)
        np.testing.assert_array_equal(a.train_step(**batch), b.train_step(**batch))
    for name, value in b.parameters.items():
        np.testing.assert_array_equal(a.parameters[name], value, err_msg=name)
    np.testing.assert_allclose(a.last_grad_norm, b.last_grad_norm, rtol=1e-6)  # the squares summed in two groups


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("source", ["digits", "tanh_mlp", "gpt2"])
def test_the_members_partial_products_sum_to_the_whole_models(source, size, transformer_path):
    """Member r's program (``rank=r``: its slices, the shapes after them inferred again, GPT-2's
    reshapes between its projections taking the hidden size from the data) computes a partial
    product where the program sums across the group; the members' partial products, summed,
    are the whole model's product there."""
    model = {
        "digits": lambda: onnx.load(DIGITS),
        "tanh_mlp": models.tanh_mlp,
        "gpt2": lambda: onnx.load(transformer_path),
    }[source]()
    output = model.graph.output[0].name
    marked = graphforge.compile(model, f"tensor_parallel(size={size})").model
    role = _role(marked)
    assert role["size"] == size and len(role["blocks"]) == 1 and "rank" not in role
    rng = np.random.default_rng(0)
    if source == "digits":
        feeds = {"images": rng.integers(0, 17, (5, 8, 8)).astype(np.uint8)}
    elif source == "gpt2":
        feeds = {"input_ids": rng.integers(0, 64, (2, 8))}
    else:
        feeds = {i.name: rng.standard_normal((5, 4)).astype(np.float32) for i in model.graph.input}
    whole = models.run(model, feeds)[output]
    np.testing.assert_allclose(models.run(marked, feeds)[output], whole, rtol=1e-5, atol=1e-6)  # identity markers
    (reduce,) = [n for n in marked.graph.node if n.op_type == "TensorParallelReduce"]
    summed = reduce.output[0]
    partials = []
    for rank in range(size):
        member = graphforge.compile(model, f"tensor_parallel(size={size}, rank={rank})").model
        assert _role(member)["rank"] == rank
        values = {t.name: numpy_helper.to_array(t) for t in member.graph.initializer}
        for name, axis in role["split"].items():
            whole_shape = numpy_helper.to_array(next(t for t in marked.graph.initializer if t.name == name)).shape
            assert values[name].shape[axis] == whole_shape[axis] // size, name
        partials.append(_run_to(member, summed, feeds))
    # what the group sums, summed, is what the whole model computes there
    np.testing.assert_allclose(sum(partials), _run_to(marked, summed, feeds), rtol=1e-4, atol=1e-5)


def _run_to(model: onnx.ModelProto, name: str, feeds) -> np.ndarray:
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    del cut.graph.output[:]
    cut.graph.output.extend([onnx.helper.make_empty_tensor_value_info(name)])
    return models.run(cut, feeds)[name]


@pytest.mark.slow
def test_the_blocks_of_a_dynamo_llama_export_and_a_bert_encoder_are_found(tmp_path):
    """Found on the graph: SwiGLU's gate and up projections (x·Wᵀ, as the dynamo exporter
    writes a Linear) are both column-parallel, sharing one f; BERT's erf GELU between its
    dense layers; attention's projections are left whole (not split by the pass yet)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llama = models.export_dynamo(models.llama_module(), tmp_path / "llama.onnx", 23)
        bert = models.export_bert(tmp_path / "bert.onnx")
    role = _role(graphforge.compile(str(llama), "tensor_parallel(size=2)").model)
    assert len(role["blocks"]) == 2
    for layer, block in enumerate(role["blocks"]):
        stem = f"inner.model.layers.{layer}.mlp"
        assert sorted(block["column"]) == [f"{stem}.gate_proj.weight", f"{stem}.up_proj.weight"]
        assert block["row"] == [f"{stem}.down_proj.weight"] and len(block["copy"]) == 1
        assert role["split"][f"{stem}.gate_proj.weight"] == 0 and role["split"][f"{stem}.down_proj.weight"] == 1
    role = _role(graphforge.compile(str(bert), "tensor_parallel(size=2)").model)
    assert [b["row"] for b in role["blocks"]] == [[f"inner.encoder.layer.{i}.output.dense.weight"] for i in range(2)]


def test_sizes_that_do_not_divide_and_models_without_a_block_are_refused_by_name():
    with pytest.raises(PipelineError, match=r"node '.*' makes 64 hidden features, which 3 processes cannot split"):
        graphforge.compile(DIGITS, "tensor_parallel(size=3)")
    with pytest.raises(PipelineError, match="no pair of projections"):
        graphforge.compile(models.linear_model(), "tensor_parallel(size=2)")
    model = onnx.load(DIGITS)
    first = next(n.name for n in model.graph.node if n.op_type == "Gemm")
    with pytest.raises(PipelineError, match="no pair of projections"):  # the only block, left replicated
        graphforge.compile(model, f'tensor_parallel(size=2, skip=["{first}"])')
