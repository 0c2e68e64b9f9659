"""Model builders shared by the tests: PyTorch exports, small hand-written graphs, feeds.

The torch builders import torch lazily, so a test module that only needs the hand-written
models runs where torch is not installed. Every builder is deterministic (fixed seeds).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphforge

OPSET = 17

#: MLP layer sizes: input features, two hidden layers, outputs
MLP_SIZES = (16, 32, 32, 4)
#: GPT-2 config of the transformer fixture
GPT2_CONFIG = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}


# --------------------------------------------------------------------------- PyTorch exports


def _jitter_vectors(module, seed: int) -> None:
    """Perturb every 1-D parameter (biases, norm scales) with seeded noise.

    The TorchScript exporter merges initializers with equal values (fresh biases are all
    zeros, norm weights all ones) and re-exposes them through Identity, which would tie
    parameters that training must keep apart.
    """
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() == 1:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _export(module, args: tuple, path: Path, input_names: list[str], output_names: list[str], dynamic_axes) -> Path:
    import torch

    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript exporter deprecation and tracer warnings
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            do_constant_folding=False,
            opset_version=OPSET,
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
        )
    return path


def mlp_module(seed: int = 0):
    """The torch MLP that ``export_mlp`` exports (16-32-32-4, ReLU), in eval mode."""
    import torch

    torch.manual_seed(seed)
    n_in, h1, h2, n_out = MLP_SIZES
    module = torch.nn.Sequential(
        torch.nn.Linear(n_in, h1),
        torch.nn.ReLU(),
        torch.nn.Linear(h1, h2),
        torch.nn.ReLU(),
        torch.nn.Linear(h2, n_out),
    )
    _jitter_vectors(module, seed)
    return module.eval()


def export_mlp(path: str | Path, seed: int = 0) -> Path:
    """Export a 16-32-32-4 ReLU MLP: input ``x`` [batch, 16], output ``y`` [batch, 4]."""
    import torch

    module = mlp_module(seed)
    example = torch.randn(2, MLP_SIZES[0], generator=torch.Generator().manual_seed(seed))
    axes = {"x": {0: "batch"}, "y": {0: "batch"}}
    return _export(module, (example,), Path(path), ["x"], ["y"], axes)


def gpt2_module(seed: int = 0, classes_first: bool = False, **config_changes):
    """A 1-layer GPT-2 with random weights (never downloaded) returning logits, in eval mode
    (``classes_first``: [batch, vocabulary, seq], cross_entropy's layout); ``config_changes``
    change its GPT2Config (``n_layer=2, tie_word_embeddings=False``)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    settings = {**GPT2_CONFIG, **config_changes}
    config = GPT2Config(**settings, attn_implementation="eager", use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    _jitter_vectors(model, seed)

    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            # transformers 5.x needs an explicit mask to trace a dynamic sequence length
            mask = torch.ones_like(input_ids)
            logits = self.inner(input_ids=input_ids, attention_mask=mask).logits
            return logits.transpose(1, 2) if classes_first else logits

    return LogitsOnly(model).eval()


def export_transformer(path: str | Path, seed: int = 0, classes_first: bool = False, **config_changes) -> Path:
    """Export the 1-layer GPT-2 (or as ``config_changes`` say): input ``input_ids`` int64
    [batch, seq], output ``logits`` [batch, seq, 64] (``classes_first``: [batch, 64, seq])."""
    import torch

    module = gpt2_module(seed, classes_first, **config_changes)
    ids = torch.randint(0, GPT2_CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(seed))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 2 if classes_first else 1: "seq"}}
    return _export(module, (ids,), Path(path), ["input_ids"], ["logits"], axes)


def export_bert(path: str | Path, seed: int = 0) -> Path:
    """A 2-layer BERT encoder (random weights, eager attention, no dropout) exported with
    dynamic batch and sequence: input ``input_ids`` int64 [batch, seq], output
    ``hidden`` [batch, seq, 32] (the encoder's last hidden states)."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")  # fmt: skip
    inner = BertModel(config, add_pooling_layer=False)
    _jitter_vectors(inner, seed)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).last_hidden_state

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "hidden": {0: "batch", 1: "seq"}}
    return _export(Encoder().eval(), (ids,), Path(path), ["input_ids"], ["hidden"], axes)


#: the Llama-style model's vocabulary
LLAMA_VOCAB = 128


def llama_module(seed: int = 0, heads: int = 4, kv_heads: int = 2):
    """A 2-layer Llama (SDPA attention, ``kv_heads`` key/value heads for ``heads`` query heads,
    RMSNorm, rotary, SwiGLU, random weights): input_ids [B, T] -> logits [B, V, T]
    (cross_entropy's layout), in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)  # fmt: skip
    inner = LlamaForCausalLM(config)
    _jitter_vectors(inner, seed)

    class ClassesFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            mask = torch.ones_like(input_ids)
            return self.inner(input_ids=input_ids, attention_mask=mask).logits.transpose(1, 2)

    return ClassesFirst().eval()


def export_llama(path: str | Path, seed: int = 0) -> Path:
    """The 2-layer Llama of ``llama_module`` exported by TorchScript unfolded (each Linear's
    weight [out, in] under its torch name, read through a Transpose): input ``input_ids``
    int64 [batch, seq], output ``logits`` [batch, 128, seq]."""
    import torch

    ids = torch.randint(0, LLAMA_VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 2: "seq"}}
    return _export(llama_module(seed), (ids,), Path(path), ["input_ids"], ["logits"], axes)


def export_dynamo(module, path: str | Path, opset: int, *, vocab: int = LLAMA_VOCAB) -> Path:
    """``module`` (input_ids [B, T] -> logits) exported by torch's dynamo exporter, unoptimized,
    with dynamic batch and sequence."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        example = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
        dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
        torch.onnx.export(module, (example,), str(path), dynamo=True, optimize=False, opset_version=opset,
                          input_names=["input_ids"], output_names=["logits"], dynamic_shapes=(dims,),
                          external_data=False, verbose=False)  # fmt: skip
    return Path(path)


# --------------------------------------------------------------------------- hand-written models


def parse(text: str) -> onnx.ModelProto:
    """A model from ONNX text form; checked, so a typo in a fixture fails loudly."""
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model, full_check=True)
    return model


#: x → Relu twice (a CSE target) → Add → y, plus a dead Neg (a DCE target): 4 nodes
DEAD_AND_DUPLICATE = """
<ir_version: 8, opset_import: ["" : 17]>
dead_and_duplicate (float[N, 4] x) => (float[N, 4] y) {
    a = Relu(x)
    b = Relu(x)
    y = Add(a, b)
    unused = Neg(x)
}
"""

#: x → Identity → Identity → Identity → Relu → y: three no-ops in a chain
IDENTITY_CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
identity_chain (float[N, 4] x) => (float[N, 4] y) {
    a = Identity(x)
    b = Identity(a)
    c = Identity(b)
    y = Relu(c)
}
"""

#: the initializer w is read directly and again through Identity, as exporters tie weights
TIED_INITIALIZER = """
<ir_version: 8, opset_import: ["" : 17]>
tied (float[N, 4] x) => (float[N, 4] y)
<float[4] w = {1.0, 2.0, 3.0, 4.0}>
{
    w_alias = Identity(w)
    a = Mul(x, w)
    y = Add(a, w_alias)
}
"""


def dead_and_duplicate() -> onnx.ModelProto:
    return parse(DEAD_AND_DUPLICATE)


def identity_chain() -> onnx.ModelProto:
    return parse(IDENTITY_CHAIN)


def tied_initializer() -> onnx.ModelProto:
    return parse(TIED_INITIALIZER)


def invalid_model() -> onnx.ModelProto:
    """Parses as ONNX but fails the checker: Add of a float and an int64 tensor."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "k"], ["y"])],
        "invalid",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(np.arange(4, dtype=np.int64), "k")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def cyclic_model() -> onnx.ModelProto:
    """Two nodes reading each other's output: invalid (only loads with verification off)."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "b"], ["a"], name="first"),
            helper.make_node("Relu", ["a"], ["b"], name="second"),
        ],
        "cyclic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def linear_model(in_features: int = 16, out_features: int = 32, seed: int = 0) -> onnx.ModelProto:
    """y = Relu(x @ W + b) with x [batch, in]; W is large enough to go to external data."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((in_features, out_features)).astype(np.float32)
    bias = rng.standard_normal(out_features).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["pre"]),
            helper.make_node("Identity", ["pre"], ["pre_alias"]),
            helper.make_node("Relu", ["pre_alias"], ["y"]),
        ],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out_features])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def tanh_mlp(seed: int = 0, *, scalar_scale: bool = False) -> onnx.ModelProto:
    """A 4-8-3 tanh MLP, x [N, 4] → y [N, 3], written by hand (no torch needed); with
    ``scalar_scale`` y is also multiplied by a 0-d parameter ``scale`` (as CLIP's logit_scale)."""
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> TensorProto:
        return numpy_helper.from_array((0.5 * rng.standard_normal(shape)).astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "w2"], ["y0"]),
        helper.make_node("Add", ["y0", "b2"], ["y1" if scalar_scale else "y"]),
    ]
    initializers = [weight("w1", 4, 8), weight("b1", 8), weight("w2", 8, 3), weight("b2", 3)]
    if scalar_scale:
        nodes.append(helper.make_node("Mul", ["y1", "scale"], ["y"]))
        initializers.append(numpy_helper.from_array(np.array(1.5, np.float32), "scale"))
    graph = helper.make_graph(
        nodes,
        "tanh_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def tanh_mlp_batches(count: int, batch: int = 5, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """Batches for ``tanh_mlp`` under an mse loss: x [batch, 4] and labels [batch, 3]."""
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((batch, 4)).astype(np.float32),
            "labels": rng.standard_normal((batch, 3)).astype(np.float32),
        }
        for _ in range(count)
    ]


def external_data_model(directory: str | Path) -> Path:
    """Save ``linear_model()`` as ``model.onnx`` + ``model.onnx.data`` in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = graphforge.save(linear_model(), directory / "model.onnx", external_data=True)
    assert (directory / "model.onnx.data").is_file()
    return path


# --------------------------------------------------------------------------- running models


_NP_TYPES = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT64: np.int64,
    TensorProto.INT32: np.int32,
    TensorProto.BOOL: np.bool_,
}


def random_inputs(
    model: onnx.ModelProto | str | Path,
    *,
    seed: int = 0,
    dims: Mapping[str, int] | None = None,
    int_high: int = GPT2_CONFIG["vocab_size"],
) -> dict[str, np.ndarray]:
    """Random feeds for every graph input that is not an initializer.

    Symbolic dims take their size from ``dims`` (default 3); integer inputs are drawn from
    [0, int_high), so token ids stay inside the vocabulary.
    """
    proto = model if isinstance(model, onnx.ModelProto) else graphforge.load(model, load_external_data=False)
    dims = dict(dims or {})
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in proto.graph.initializer}
    feeds = {}
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 3) for d in tensor_type.shape.dim]
        dtype = _NP_TYPES[tensor_type.elem_type]
        if np.issubdtype(dtype, np.floating):
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype is np.bool_:
            feeds[value.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[value.name] = rng.integers(0, int_high, shape).astype(dtype)
    return feeds


def run(model: onnx.ModelProto | str | Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs by name, from an onnxruntime session made by graphforge."""
    session = graphforge.create_session(model)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds)), strict=True))


def assert_same_outputs(
    reference: onnx.ModelProto | str | Path,
    candidate: onnx.ModelProto | str | Path,
    *,
    seeds: tuple[int, ...] = (0, 1),
    dims: Mapping[str, int] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> None:
    """Both models give the same outputs (same names) on random inputs in onnxruntime."""
    for seed in seeds:
        feeds = random_inputs(reference, seed=seed, dims=dims)
        expected, actual = run(reference, feeds), run(candidate, feeds)
        assert sorted(actual) == sorted(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(actual[name], value, rtol=rtol, atol=atol, err_msg=f"output {name!r}")


def node_count(model: onnx.ModelProto | str | Path) -> int:
    proto = model if isinstance(model, onnx.ModelProto) else graphforge.load(model)
    return len(proto.graph.node)


def without_key_bias(name: str, value: np.ndarray) -> np.ndarray:
    """What of a GPT-2 parameter follows its gradient: all of it but the attention's key bias
    (the middle third of c_attn's bias). Adding one vector to every key adds q·b to all of a
    row's scores, which softmax takes away: its gradient is zero but for rounding, and Adam-like
    optimizers turn rounding into full-size steps of any sign, so two runs that round apart move
    it apart (seen: 4% as far as the query bias moves)."""
    if not name.endswith("attn.c_attn.bias"):
        return value
    third = value.shape[0] // 3
    return np.concatenate([value[:third], value[2 * third :]])
