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


def test_a_block_whose_weight_another_layer_shares_is_left_whole():
    """Two MLP blocks; the first's second weight is read again by a later projection (weights
    tied across layers, or an exporter's shared initializer): slicing it would change what
    that one reads, so the first block stays whole and only the second is split."""
    rng = np.random.default_rng(0)

    def init(name, *shape):
        return onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        onnx.helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], transB=1),
        onnx.helper.make_node("Relu", ["h1"], ["a1"]),
        onnx.helper.make_node("Gemm", ["a1", "w2", "b2"], ["y1"], transB=1),
        onnx.helper.make_node("Gemm", ["y1", "w3", "b3"], ["h2"], transB=1),
        onnx.helper.make_node("Relu", ["h2"], ["a2"]),
        onnx.helper.make_node("Gemm", ["a2", "w4", "b4"], ["y2"], transB=1),
        onnx.helper.make_node("MatMul", ["y2", "w2"], ["y"]),  # w2 [4, 8]: y2 [n, 4] -> y [n, 8]
    ]
    inits = [init("w1", 8, 4), init("b1", 8), init("w2", 4, 8), init("b2", 4), init("w3", 8, 4), init("b3", 8)]
    inits += [init("w4", 4, 8), init("b4", 4)]
    graph = onnx.helper.make_graph(
        nodes,
        "shared",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 8])],
        inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    role = _role(graphforge.compile(model, "tensor_parallel(size=2)").model)
    assert [b["row"] for b in role["blocks"]] == [["w4"]] and "w2" not in role["split"]
    member = graphforge.compile(model, "tensor_parallel(size=2, rank=1)").model
    shapes = {t.name: tuple(t.dims) for t in member.graph.initializer}
    assert shapes["w2"] == (4, 8) and shapes["w3"] == (4, 4) and shapes["w4"] == (4, 4)


def _hf_export(name: str, path: Path) -> Path:
    """A 2-layer transformers model of architecture ``name`` (random weights, biases jittered
    apart as trained ones are), TorchScript-exported: input_ids [b, s] -> logits."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    small = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "max_position_embeddings": 32}
    inner = {
        "opt": lambda: OPTForCausalLM(OPTConfig(**small, ffn_dim=64, num_attention_heads=2, word_embed_proj_dim=32)),
        "gpt-neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**small, intermediate_size=64, num_attention_heads=2)),
        "qwen2": lambda: Qwen2ForCausalLM(
            Qwen2Config(**small, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
        ),
    }[name]()
    models._jitter_vectors(inner, 0)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    axes = {"input_ids": {0: "b", 1: "s"}, "logits": {0: "b", 1: "s"}}
    return models._export(Logits().eval(), (ids,), path, ["input_ids"], ["logits"], axes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["opt", "gpt-neox", "qwen2"])
def test_the_mlps_of_other_architectures_split_and_their_members_sum_to_the_whole(name, tmp_path):
    """Architectures the other tests do not train (OPT: Gemm, ReLU; GPT-NeoX: MatMul and bias
    Add, GELU; Qwen2: SwiGLU without biases): every layer's MLP is found, the marked model
    computes what the export does, and the members' partial products in the first block sum
    to the whole model's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = onnx.load(_hf_export(name, tmp_path / f"{name}.onnx"))
        marked = graphforge.compile(model, "tensor_parallel(size=2)").model
        members = [graphforge.compile(model, f"tensor_parallel(size=2, rank={r})").model for r in range(2)]
    assert len(_role(marked)["blocks"]) == 2
    feeds = {"input_ids": np.random.default_rng(1).integers(0, 64, (2, 8))}
    np.testing.assert_allclose(models.run(marked, feeds)["logits"], models.run(model, feeds)["logits"], atol=1e-5)
    first = next(n.output[0] for n in marked.graph.node if n.op_type == "TensorParallelReduce")
    total = sum(_run_to(member, first, feeds) for member in members)
    np.testing.assert_allclose(total, _run_to(marked, first, feeds), rtol=1e-4, atol=1e-5)


def test_a_dropout_between_the_projections_draws_a_stream_per_member():
    """Seeded dropout keys a node's masks by its output's name: a Dropout inside a split
    block gets one per member (each drops elements of its own slice independently, as
    Megatron-LM's per-rank generator), the whole program keeps the export's."""
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
            onnx.helper.make_node("Relu", ["h"], ["a"]),
            onnx.helper.make_node("Dropout", ["a", "ratio"], ["d"]),
            onnx.helper.make_node("Gemm", ["d", "w2", "b2"], ["y"], transB=1),
        ],
        "dropout",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 4])],
        [
            onnx.numpy_helper.from_array(np.ones((8, 4), np.float32), "w1"),
            onnx.numpy_helper.from_array(np.full(8, 0.1, np.float32), "b1"),
            onnx.numpy_helper.from_array(np.ones((4, 8), np.float32), "w2"),
            onnx.numpy_helper.from_array(np.full(4, 0.2, np.float32), "b2"),
            onnx.numpy_helper.from_array(np.array(0.1, np.float32), "ratio"),
        ],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])

    def dropout_output(program):
        return next(n.output[0] for n in program.graph.node if n.op_type == "Dropout")

    assert dropout_output(graphforge.compile(model, "tensor_parallel(size=2)").model) == "d"
    names = [dropout_output(graphforge.compile(model, f"tensor_parallel(size=2, rank={r})").model) for r in (0, 1)]
    assert len(set(names)) == 2 and "d" not in names
