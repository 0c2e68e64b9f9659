"""The tensor_parallel pass (passes/tensor_parallel.py) on MLP and attention blocks. Two
oracles: the program on one process, where the markers are Identity, trains as the unmarked
one, bit for bit; and the members' programs (``rank=r``: the column weights and biases sliced
along their output features or heads, the row weight along its input features, the reshapes
to heads rewritten) run as the group runs them (``_group_run``: each TensorParallelReduce's
input summed across the members, in order) compute the whole model's output. Training across
processes: tests/distributed/test_tensor_parallel_members.py."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from graphforge.passes.tensor_parallel_axes import probe_shapes
from onnx import numpy_helper

import graphforge
from graphforge import roles
from graphforge.errors import PipelineError
from graphforge.graph import Model
from graphforge.program import joined_slices
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


@pytest.fixture(scope="module")
def gpt2_four_heads(tmp_path_factory) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return models.export_transformer(tmp_path_factory.mktemp("tp") / "gpt2.onnx", n_head=4, n_layer=2)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("source", ["digits", "tanh_mlp", "gpt2"])
def test_the_members_run_as_a_group_compute_the_whole_model(source, size, gpt2_four_heads):
    """Each member's program holds 1/size of every split parameter (GPT-2's fused c_attn: of
    each of its Q, K and V sections) and, with the group's sums between its parts, computes
    what the whole model does: GPT-2 (2 layers, 4 heads) through both layers' attention and
    MLP blocks."""
    model = {
        "digits": lambda: onnx.load(DIGITS),
        "tanh_mlp": models.tanh_mlp,
        "gpt2": lambda: onnx.load(gpt2_four_heads),
    }[source]()
    output = model.graph.output[0].name
    marked = graphforge.compile(model, f"tensor_parallel(size={size})").model
    role = _role(marked)
    kinds = [b["kind"] for b in role["blocks"]]
    assert kinds == (["attention", "mlp"] * 2 if source == "gpt2" else ["mlp"]) and "rank" not in role
    if source == "gpt2":
        assert role["sections"]["inner.transformer.h.0.attn.c_attn.weight"] == [32, 32, 32]
    rng = np.random.default_rng(0)
    if source == "digits":
        feeds = {"images": rng.integers(0, 17, (5, 8, 8)).astype(np.uint8)}
    elif source == "gpt2":
        feeds = {"input_ids": rng.integers(0, 64, (2, 8))}
    else:
        feeds = {i.name: rng.standard_normal((5, 4)).astype(np.float32) for i in model.graph.input}
    whole = models.run(model, feeds)[output]
    np.testing.assert_allclose(models.run(marked, feeds)[output], whole, rtol=1e-5, atol=1e-6)  # identity markers
    members = []
    for rank in range(size):
        member = graphforge.compile(model, f"tensor_parallel(size={size}, rank={rank})").model
        assert _role(member)["rank"] == rank
        values = {t.name: numpy_helper.to_array(t) for t in member.graph.initializer}
        for name, axis in role["split"].items():
            whole_shape = numpy_helper.to_array(next(t for t in marked.graph.initializer if t.name == name)).shape
            assert values[name].shape[axis] == whole_shape[axis] // size, name
        members.append(member)
    np.testing.assert_allclose(_group_run(members, feeds, output), whole, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:tensor_parallel")  # the LM head, under no loss here, stays whole
def test_a_fused_qkv_projection_s_adapter_is_split_by_its_sections(gpt2_four_heads):
    """GPT-2's fused c_attn under the lora pass: the adapter's B ([3·hidden, r]) is cut as the
    weight is, each member taking its part of the Q, K and V sections (a contiguous half would
    give member 0 all of Q's rows of B and half of K's); the members, run as a group, compute
    the adapted model's logits with nonzero adapters."""
    adapted = graphforge.compile(onnx.load(gpt2_four_heads), "lora(r=2, alpha=4, targets=[c_attn])").model
    rng = np.random.default_rng(0)
    for t in adapted.graph.initializer:
        if ".lora_" in t.name:
            t.CopyFrom(numpy_helper.from_array((0.3 * rng.standard_normal(tuple(t.dims))).astype(np.float32), t.name))
    role = _role(graphforge.compile(adapted, "tensor_parallel(size=2)").model)
    assert role["sections"]["inner.transformer.h.0.attn.c_attn.lora_B.weight"] == [32, 32, 32]
    feeds = {"input_ids": rng.integers(0, 64, (2, 8))}
    members = [graphforge.compile(adapted, f"tensor_parallel(size=2, rank={r})").model for r in range(2)]
    want = models.run(adapted, feeds)["logits"]
    np.testing.assert_allclose(_group_run(members, feeds, "logits"), want, rtol=1e-4, atol=1e-5)


#: how the group reduces each marker's input
_REDUCTIONS = {"TensorParallelReduce": np.add.reduce, "TensorParallelMax": np.maximum.reduce}


def _group_run(members: list[onnx.ModelProto], feeds, output: str) -> np.ndarray:
    """``output`` as the group computes it (members[0]'s)."""
    sums = _group_sums(members, feeds)
    return _run_to(_fed(members[0], sums), output, {**feeds, **sums})


def _group_sums(members: list[onnx.ModelProto], feeds) -> dict[str, np.ndarray]:
    """Each TensorParallelReduce's input summed across the members' programs (each
    TensorParallelMax's the maximum), in the order they reach them, fed on as its output:
    every member's values of the markers' outputs."""
    sums: dict[str, np.ndarray] = {}
    for node in [n for n in members[0].graph.node if n.op_type in _REDUCTIONS]:
        parts = [_run_to(_fed(m, sums), node.input[0], {**feeds, **sums}) for m in members]
        sums[node.output[0]] = _REDUCTIONS[node.op_type](parts)
    return sums


def _run_to(model: onnx.ModelProto, name: str | list[str], feeds):
    """``model``'s value of ``name`` (or of each of a list of names)."""
    names = [name] if isinstance(name, str) else name
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    del cut.graph.output[:]
    cut.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    got = models.run(cut, feeds)
    return got[name] if isinstance(name, str) else got


def _fed(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with the tensors ``values`` names read from inputs instead of computed."""
    fed = onnx.ModelProto()
    fed.CopyFrom(model)
    kept = [n for n in fed.graph.node if not any(o in values for o in n.output)]
    del fed.graph.node[:]
    fed.graph.node.extend(kept)
    fed.graph.input.extend(
        onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for name, v in values.items()
    )
    return fed


@pytest.mark.slow
def test_a_dynamo_llama_and_a_bert_encoder_split_their_attention_and_mlps(tmp_path):
    """Found on the graph: Llama's attention (dynamo export: x·Wᵀ projections, rotary
    embedding, grouped key/value heads repeated by Expand, ONNX's Attention op) splits by
    heads, its SwiGLU's gate and up projections both column-parallel, sharing one f; BERT's
    attention (TorchScript: the number of heads a constant in its reshapes) and its erf GELU
    MLP. The members, run as a group, compute each model's output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llama = models.export_dynamo(models.llama_module(), tmp_path / "llama.onnx", 23)
        bert = models.export_bert(tmp_path / "bert.onnx")
    role = _role(graphforge.compile(str(llama), "tensor_parallel(size=2)").model)
    # (before a loss: the LM head stays whole, the untied embedding splits)
    assert [b["kind"] for b in role["blocks"]] == ["attention", "mlp"] * 2 + ["embedding"]
    for layer in range(2):
        attention, mlp = role["blocks"][2 * layer : 2 * layer + 2]
        stem = f"inner.model.layers.{layer}"
        assert sorted(attention["column"]) == [f"{stem}.self_attn.{x}_proj.weight" for x in "kqv"]
        assert attention["row"] == [f"{stem}.self_attn.o_proj.weight"]
        assert sorted(mlp["column"]) == [f"{stem}.mlp.gate_proj.weight", f"{stem}.mlp.up_proj.weight"]
        assert mlp["row"] == [f"{stem}.mlp.down_proj.weight"] and len(mlp["copy"]) == 1
        assert role["split"][f"{stem}.mlp.gate_proj.weight"] == 0 and role["split"][f"{stem}.mlp.down_proj.weight"] == 1
    role = _role(graphforge.compile(str(bert), "tensor_parallel(size=2)").model)
    assert role["blocks"][-1]["column"] == ["inner.embeddings.word_embeddings.weight"]
    rows = [b["row"] for b in role["blocks"][:-1]]
    assert rows == [
        [f"inner.encoder.layer.{i}.{x}.dense.weight"] for i in range(2) for x in ("attention.output", "output")
    ]
    rng = np.random.default_rng(3)
    for path, vocab, output in ((llama, models.LLAMA_VOCAB, "logits"), (bert, 64, "hidden")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            members = [graphforge.compile(str(path), f"tensor_parallel(size=2, rank={r})").model for r in range(2)]
        feeds = {"input_ids": rng.integers(0, vocab, (2, 7))}
        whole = models.run(str(path), feeds)[output]
        np.testing.assert_allclose(_group_run(members, feeds, output), whole, rtol=1e-4, atol=1e-5)


def test_sizes_that_do_not_divide_and_models_without_a_block_are_refused_by_name(transformer_path):
    """Each refusal names the node and offers a way out that works: the test takes it."""
    with pytest.raises(PipelineError, match=r"node '.*' has 64 output features, which 3 processes cannot split") as got:
        graphforge.compile(DIGITS, "tensor_parallel(size=3)")
    # the digits' one block: leaving it whole would leave nothing to split, so sizes that divide it
    offered = re.findall(r"size=(\d+)", str(got.value).split("no other layer splits")[1])
    assert offered == ["2", "4", "8", "16"] and "skip=" not in str(got.value)
    for size in offered:
        graphforge.compile(DIGITS, f"tensor_parallel(size={size})")
    with pytest.raises(PipelineError, match="no layer to split"):
        graphforge.compile(models.linear_model(), "tensor_parallel(size=2)")
    model = onnx.load(DIGITS)
    first = next(n.name for n in model.graph.node if n.op_type == "Gemm")
    with pytest.raises(PipelineError, match="no layer to split"):  # the only block, left replicated
        graphforge.compile(model, f'tensor_parallel(size=2, skip=["{first}"])')
    # GPT-2 with 2 heads on 4 members: refused at its reshape to heads, naming the block to skip
    gpt2 = onnx.load(transformer_path)
    with pytest.raises(PipelineError, match=r"Reshape node '.*' makes 2 along the split axis .* skip=\[(.*)\]") as got:
        graphforge.compile(gpt2, "tensor_parallel(size=4)")
    skip = re.search(r"skip=(\[.*\])", str(got.value)).group(1)
    c_proj = next(n.name for n in gpt2.graph.node if n.op_type == "Gemm" and "attn/c_proj" in n.name)
    assert skip == f"[{c_proj!r}]"
    role = _role(graphforge.compile(gpt2, f"tensor_parallel(size=4, skip={skip})").model)
    assert [b["kind"] for b in role["blocks"]] == ["mlp"]  # the attention stays whole on every member


#: GPT-2 vocabularies no other size of the model equals (a tensor with a dim of this size holds
#: whole-vocabulary values): one 2 and 4 divide, and an odd one as GPT-2's own 50257
VOCAB, ODD_VOCAB = 96, 95


@pytest.fixture(scope="module")
def gpt2_classes_first(tmp_path_factory) -> dict[int, Path]:
    """GPT-2s of 1 layer (tied embeddings) with logits [batch, vocabulary, seq]: vocabulary ->
    path (4 heads; the odd vocabulary's 2). A layer is all the vocabulary's split needs: each
    member runs the group up to each sum, one session a sum, and layers only add sums."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tp-vocab")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            VOCAB: models.export_transformer(folder / "gpt2.onnx", n_head=4, n_layer=1, vocab_size=VOCAB,
                                             classes_first=True),
            ODD_VOCAB: models.export_transformer(folder / "odd.onnx", vocab_size=ODD_VOCAB, classes_first=True),
        }  # fmt: skip


SMOOTHED = "loss(kind=cross_entropy, output=logits, ignore_index=0, label_smoothing=0.1)"


@pytest.mark.parametrize(
    ("vocab", "loss", "size"),
    [
        (VOCAB, SMOOTHED, 2),
        (VOCAB, SMOOTHED, 4),
        (VOCAB, "loss(kind=cross_entropy, output=logits, reduction=sum)", 2),
        (ODD_VOCAB, SMOOTHED, 2),
    ],
)
def test_the_vocabulary_parallel_cross_entropy_equals_the_gathered_one(vocab, loss, size, gpt2_classes_first):
    """After the loss pass, tensor_parallel splits the token embedding and the LM head tied to
    it (one table, split along the vocabulary; an odd one unevenly, member 0 holding one row
    more) and computes the cross-entropy from each member's slice of the logits: run as a
    group (each TensorParallelReduce summed, each TensorParallelMax the maximum across the
    members), the members' loss and every parameter's gradient, joined from their slices,
    equal the whole model's with the loss pass's cross-entropy (label smoothing and an
    ignored label, whose rows member 0 holds, included). No member's program has a tensor of
    the vocabulary's size at fixed dims."""
    path = gpt2_classes_first[vocab]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = graphforge.compile(path, f"{loss}, autodiff").model
        members = [
            graphforge.compile(path, f"{loss}, tensor_parallel(size={size}, rank={r}), autodiff").model
            for r in range(size)
        ]
    role = _role(members[0])
    assert [b["kind"] for b in role["blocks"]] == ["attention", "mlp", "embedding", "vocabulary"]
    assert role["split"]["inner.transformer.wte.weight"] == 0  # the embedding's and the LM head's table
    assert role.get("uneven", {}) == ({} if vocab % size == 0 else {"inner.transformer.wte.weight": vocab})
    rng = np.random.default_rng(size)
    feeds = {"input_ids": rng.integers(0, vocab, (3, 8)), "labels": rng.integers(0, vocab, (3, 8))}
    feeds["labels"][0, :3] = 0
    want = models.run(whole, feeds)
    sums = _group_sums(members, feeds)
    norm = "inner.transformer.ln_f.weight"  # whole on every member
    outputs = ["loss", f"{norm}_grad", *(f"{name}_grad" for name in role["split"])]
    got = [_run_to(_fed(m, sums), outputs, {**feeds, **sums}) for m in members]
    np.testing.assert_allclose(got[0]["loss"], want["loss"], rtol=1e-6)
    np.testing.assert_allclose(got[0][f"{norm}_grad"], want[f"{norm}_grad"], rtol=1e-4, atol=1e-7)
    for name, axis in role["split"].items():
        joined = joined_slices([g[f"{name}_grad"] for g in got], axis, role.get("sections", {}).get(name))
        np.testing.assert_allclose(joined, want[f"{name}_grad"], rtol=1e-4, atol=1e-7, err_msg=name)
    for rank, member in enumerate(members):
        shapes = probe_shapes(Model.from_proto(member))
        assert [n for n, shape in shapes.items() if vocab in shape] == []
        assert shapes["logits"][1] == vocab // size + (rank < vocab % size)


def test_the_vocabulary_stays_whole_where_the_split_cannot_take_it(gpt2_classes_first):
    """The rest still splits: an LM head whose logits another loss reads whole (mse) stays
    whole, and so does the table tied to it (said in a warning); so does an LM head with no
    loss after it yet (tensor_parallel before the loss pass), and both with vocab=false."""
    ce, mse = "loss(kind=cross_entropy, output=logits)", "loss(kind=mse, output=logits)"
    with pytest.warns(UserWarning, match="1 layer.* stay whole .*embedding .*read by a layer that stays whole"):
        role = _role(graphforge.compile(gpt2_classes_first[VOCAB], f"{mse}, tensor_parallel(size=2)").model)
    with pytest.warns(UserWarning, match="no loss reads it yet .*put tensor_parallel after the loss pass"):
        graphforge.compile(gpt2_classes_first[VOCAB], "tensor_parallel(size=2)")
    for pipeline in ("tensor_parallel(size=2)", f"{ce}, tensor_parallel(size=2, vocab=false)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            role = _role(graphforge.compile(gpt2_classes_first[VOCAB], pipeline).model)
        assert [b["kind"] for b in role["blocks"]] == ["attention", "mlp"], pipeline
        assert "inner.transformer.wte.weight" not in role["split"]


def test_a_block_that_mixes_the_members_parts_stays_whole_with_a_warning():
    """An attention-like block whose scores get a bias per head that is not split (T5's
    relative position bias) cannot be computed on a member's heads: it stays whole, said once
    in a warning with the node, and the MLP after it still splits."""
    rng = np.random.default_rng(0)

    def init(name, *shape):
        return onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    ints = lambda name, values: onnx.numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "wq"], ["q"]),
        onnx.helper.make_node("MatMul", ["x", "wk"], ["k"]),
        onnx.helper.make_node("Reshape", ["q", "heads"], ["qh"]),
        onnx.helper.make_node("Reshape", ["k", "heads"], ["kh"]),
        onnx.helper.make_node("Transpose", ["qh"], ["qt"], perm=[1, 0, 2]),
        onnx.helper.make_node("Transpose", ["kh"], ["kt"], perm=[1, 2, 0]),
        onnx.helper.make_node("MatMul", ["qt", "kt"], ["scores"]),
        onnx.helper.make_node("Add", ["scores", "head_bias"], ["biased"], name="per_head_bias"),
        onnx.helper.make_node("Softmax", ["biased"], ["p"]),
        onnx.helper.make_node("MatMul", ["p", "qt"], ["ctx"]),
        onnx.helper.make_node("Transpose", ["ctx"], ["ctxt"], perm=[1, 0, 2]),
        onnx.helper.make_node("Reshape", ["ctxt", "merged"], ["m"]),
        onnx.helper.make_node("MatMul", ["m", "wo"], ["a"]),
        onnx.helper.make_node("Add", ["x", "a"], ["r"]),
        onnx.helper.make_node("MatMul", ["r", "w1"], ["h"]),
        onnx.helper.make_node("Relu", ["h"], ["g"]),
        onnx.helper.make_node("MatMul", ["g", "w2"], ["y"]),
    ]
    inits = [init("wq", 8, 8), init("wk", 8, 8), init("wo", 8, 8), init("w1", 8, 16), init("w2", 16, 8)]
    inits += [init("head_bias", 4, 1, 1), ints("heads", [0, 4, 2]), ints("merged", [0, 8])]
    graph = onnx.helper.make_graph(
        nodes,
        "per_head_bias",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 8])],
        inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match="1 layer.* stay whole .*'per_head_bias' reads 'head_bias'"):
        role = _role(graphforge.compile(model, "tensor_parallel(size=2)").model)
    assert [b["row"] for b in role["blocks"]] == [["w2"]]


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


def _hf_export(name: str, path: Path, layers: int = 2) -> Path:
    """A transformers model of architecture ``name`` (``layers`` layers, random weights, biases
    jittered apart as trained ones are), TorchScript-exported: input_ids [b, s] -> logits."""
    import torch
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        OPTConfig,
        OPTForCausalLM,
        PhiConfig,
        PhiForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    small = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": layers, "max_position_embeddings": 32}
    inner = {
        "opt": lambda: OPTForCausalLM(OPTConfig(**small, ffn_dim=64, num_attention_heads=2, word_embed_proj_dim=32)),
        "gpt-neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**small, intermediate_size=64, num_attention_heads=2)),
        "qwen2": lambda: Qwen2ForCausalLM(
            Qwen2Config(**small, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
        ),
        "phi": lambda: PhiForCausalLM(
            PhiConfig(**small, intermediate_size=64, num_attention_heads=4, partial_rotary_factor=0.5)
        ),
    }[name]()
    models._jitter_vectors(inner, 0)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):  # logits [b, vocabulary, s]: cross_entropy's layout
            return self.inner(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.transpose(1, 2)

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    axes = {"input_ids": {0: "b", 1: "s"}, "logits": {0: "b", 2: "s"}}
    return models._export(Logits().eval(), (ids,), path, ["input_ids"], ["logits"], axes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["opt", "gpt-neox", "qwen2", "phi"])
def test_other_architectures_split_and_their_members_compute_the_whole(name, tmp_path):
    """Architectures the other tests do not train (OPT: Gemm, ReLU, separate Q/K/V; GPT-NeoX:
    a fused QKV laid out per head, partial rotary, GELU; Qwen2: grouped key/value heads,
    SwiGLU without biases; Phi: attention and MLP side by side reading one norm, each with an
    f of its own; OPT's LM head tied to its embedding): every layer's attention and MLP
    split, the embedding and the LM head under the cross-entropy along the vocabulary, the
    marked model computes what the export does, and so do the members run as a group."""
    loss = "loss(kind=cross_entropy, output=logits)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = onnx.load(_hf_export(name, tmp_path / f"{name}.onnx"))
        plain = graphforge.compile(model, loss).model
        marked = graphforge.compile(model, f"{loss}, tensor_parallel(size=2)").model
        members = [graphforge.compile(model, f"{loss}, tensor_parallel(size=2, rank={r})").model for r in range(2)]
    kinds = sorted(b["kind"] for b in _role(marked)["blocks"])
    assert kinds == ["attention", "attention", "embedding", "mlp", "mlp", "vocabulary"]
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(0, 64, (2, 8)), "labels": rng.integers(0, 64, (2, 8))}
    whole = models.run(plain, feeds)
    np.testing.assert_allclose(models.run(marked, feeds)["logits"], whole["logits"], atol=1e-5)
    np.testing.assert_allclose(_group_run(members, feeds, "loss"), whole["loss"], rtol=1e-5)


@pytest.fixture(scope="module")
def phi_one_layer(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _hf_export("phi", tmp_path_factory.mktemp("tp-phi") / "phi.onnx", layers=1)


def test_adapters_on_projections_with_biases_split_with_them(phi_one_layer):
    """Phi (1 layer: its Q, K, V, dense, fc1 and fc2 MatMuls each with a bias Add, which the
    lora pass's sum comes before) with adapters on every linear layer splits the blocks it
    splits without them: each column projection's bias with its weight and its adapter's B,
    the row projections' A along their inputs. With nonzero adapters the members, run as a
    group, compute the one-process loss, logits (joined along the vocabulary) and every
    adapter's gradient (joined from the members' slices, or the same on every member)."""
    loss = "loss(kind=cross_entropy, output=logits)"
    model = onnx.load(phi_one_layer)
    adapted = graphforge.compile(model, "lora(r=2, alpha=4, targets='all-linear')").model
    rng = np.random.default_rng(0)
    for t in adapted.graph.initializer:
        if ".lora_" in t.name:
            t.CopyFrom(numpy_helper.from_array((0.3 * rng.standard_normal(tuple(t.dims))).astype(np.float32), t.name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer left whole, with adapters or without
        marked = [_role(graphforge.compile(m, f"{loss}, tensor_parallel(size=2)").model) for m in (model, adapted)]
        whole = graphforge.compile(adapted, f"{loss}, autodiff").model
        members = [graphforge.compile(adapted, f"{loss}, tensor_parallel(size=2, rank={r}), autodiff").model
                   for r in range(2)]  # fmt: skip
    kinds = [sorted(b["kind"] for b in r["blocks"]) for r in marked]
    assert kinds == [["attention", "embedding", "mlp", "vocabulary"]] * 2
    role = _role(members[0])
    stem = "inner.model.layers.0"
    split = {n: a for n, a in role["split"].items() if n.startswith(stem)}
    assert split == {
        **{f"{stem}.self_attn.{x}_proj.{p}": 0 for x in "qkv" for p in ("weight", "bias", "lora_B.weight")},
        **{f"{stem}.mlp.fc1.{p}": 0 for p in ("weight", "bias", "lora_B.weight")},
        **{f"{stem}.{m}.{p}": 1 for m in ("self_attn.dense", "mlp.fc2") for p in ("weight", "lora_A.weight")},
    }
    adapters = [f"{t.name}_grad" for t in adapted.graph.initializer if ".lora_" in t.name]
    feeds = {"input_ids": rng.integers(0, 64, (2, 8)), "labels": rng.integers(0, 64, (2, 8))}
    want = models.run(whole, feeds)
    sums = _group_sums(members, feeds)
    got = [_run_to(_fed(m, sums), ["loss", "logits", *adapters], {**feeds, **sums}) for m in members]
    np.testing.assert_allclose(got[0]["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(np.concatenate([g["logits"] for g in got], axis=1), want["logits"], rtol=1e-5, atol=1e-6)
    for name in adapters:
        axis = role["split"].get(name.removesuffix("_grad"))
        parts = [g[name] for g in got]
        joined = parts[0] if axis is None else joined_slices(parts, axis)
        assert np.abs(want[name]).max() > 1e-3, name
        np.testing.assert_allclose(joined, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        if axis is None:
            np.testing.assert_allclose(parts[1], parts[0], rtol=1e-5, atol=1e-6, err_msg=name)


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
