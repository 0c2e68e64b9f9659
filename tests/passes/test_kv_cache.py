"""The kv_cache pass on random-initialized Hugging Face causal LMs of five families (GPT-2, Llama,
Qwen2 with grouped-query attention, Mistral, Phi), exported by torch's TorchScript exporter with
eager attention and an attention_mask input: the decoding model's prefill logits are the
forward's, and a greedy decode with the cache gives the tokens and the logits of recomputing the
prefix with the forward (a batch of two, one row left-padded), and transformers' own greedy
``generate`` tokens and logits. Then forwards without a mask input (GPT-2 and tests/models.py's
SDPA Llama, making ones like the ids), the patterns alone, and the refusals."""

from __future__ import annotations

import json
import shlex
import warnings
from pathlib import Path

import models
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from _pages import page_block
from graphforge.passes.kv_cache_patterns import cache_point, ones_like_ids, sequence_ranges
from typer.testing import CliRunner

import graphforge
from graphforge import roles
from graphforge.cli import app
from graphforge.errors import GraphforgeError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
PAGE = "docs/guides/kv-cache.md"
VOCAB = 64
#: logits of the cached and the recomputed decode agree within this (float32, tiny models)
ATOL = 1e-5
#: the prompt (the second row's first PAD tokens are padding) and the tokens decoded after it
BATCH, PROMPT, PAD, STEPS = 2, 8, 3, 4
_SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 64}  # fmt: skip
#: family -> (config class, model class, config): two layers, hidden 32; kv heads < heads where
#: the family has grouped-query attention
FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 2,
                                               "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                               "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**_SMALL, "num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_SMALL, "num_key_value_heads": 1}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_SMALL, "num_key_value_heads": 2, "sliding_window": None}),
    "phi": ("PhiConfig", "PhiForCausalLM", {**_SMALL, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                           "attention_dropout": 0.0, "partial_rotary_factor": 0.5}),
}  # fmt: skip


class CausalLM(torch.nn.Module):
    """input_ids, attention_mask [B, T] -> logits [B, T, V], as optimum exports a causal LM."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask).logits


def hf_model(family: str, attention: str = "eager") -> torch.nn.Module:
    config_class, model_class, settings = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**settings, attn_implementation=attention, use_cache=False)
    return getattr(transformers, model_class)(config).eval()


def export(module: torch.nn.Module, path: Path) -> onnx.ModelProto:
    """TorchScript (dynamo=False), dynamic batch and sequence, as tests/models.py's builders."""
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "logits": {0: "batch", 1: "sequence"}}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(CausalLM(module), (ids, torch.ones_like(ids)), str(path), dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes=axes)  # fmt: skip
    return onnx.load(str(path))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """family -> (the torch model, its forward export, the decoding model), each made once."""
    made = {}

    def export_of(family: str):
        if family not in made:
            module = hf_model(family)
            forward = export(module, tmp_path_factory.mktemp(family) / "model.onnx")
            made[family] = module, forward, graphforge.compile(forward, "kv_cache").model
        return made[family]

    return export_of


# --------------------------------------------------------------------------- decoding, two ways


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def greedy_cached(decoder: onnx.ModelProto, ids: np.ndarray, mask: np.ndarray | None, steps: int, vocab: int = -1):
    """Greedy tokens [B, steps], the prefill's logits and each new token's ([B, T, V]; the
    model's vocabulary axis is ``vocab``), the cache carried from step to step (prefill with
    empty past tensors)."""
    run = session(decoder)
    inputs = {i.name: i for i in run.get_inputs()}
    outputs = [o.name for o in run.get_outputs()]
    feeds = {n: np.zeros((len(ids), i.shape[1], 0, i.shape[3]), np.float32) for n, i in inputs.items()
             if n.startswith("past_key_values.")}  # fmt: skip
    tokens, logits, new = [], [], ids
    for _ in range(steps + 1):
        feeds["input_ids"] = new
        if mask is not None:
            feeds["attention_mask"] = mask
        result = dict(zip(outputs, run.run(outputs, feeds), strict=True))
        logits.append(np.moveaxis(result["logits"], vocab, -1))
        new = logits[-1][:, -1].argmax(-1)[:, None].astype(np.int64)
        tokens.append(new)
        feeds = {n.replace("present.", "past_key_values."): v for n, v in result.items() if n.startswith("present.")}
        if mask is not None:
            mask = np.concatenate([mask, np.ones_like(new)], axis=1)
    return np.concatenate(tokens[:steps], axis=1), logits


def greedy_recomputed(forward: onnx.ModelProto, ids: np.ndarray, mask: np.ndarray | None, steps: int, vocab: int = -1):
    """The same, the forward run over the whole prefix at every step."""
    run = session(forward)
    tokens, logits = [], []
    for step in range(steps + 1):
        feeds = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
        out = np.moveaxis(run.run(["logits"], feeds)[0], vocab, -1)
        logits.append(out if step == 0 else out[:, -1:])
        new = out[:, -1].argmax(-1)[:, None].astype(np.int64)
        tokens.append(new)
        ids = np.concatenate([ids, new], axis=1)
        if mask is not None:
            mask = np.concatenate([mask, np.ones_like(new)], axis=1)
    return np.concatenate(tokens[:steps], axis=1), logits


def prompt(rows: int = BATCH, pad: int = PAD) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [rows, PROMPT] and their mask, the last row left-padded by ``pad`` tokens."""
    ids = np.random.default_rng(1).integers(1, VOCAB, (rows, PROMPT)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[-1, :pad] = 0
    ids[-1, :pad] = 0
    return ids, mask


def assert_same_decode(forward, decoder, ids, mask, steps: int = STEPS, vocab: int = -1) -> np.ndarray:
    cached, cached_logits = greedy_cached(decoder, ids, mask, steps, vocab)
    recomputed, recomputed_logits = greedy_recomputed(forward, ids, mask, steps, vocab)
    for step, (a, b) in enumerate(zip(cached_logits, recomputed_logits, strict=True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=f"step {step}'s logits")
    np.testing.assert_array_equal(cached, recomputed)
    return cached


# --------------------------------------------------------------------------- the families


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_decode_is_the_recomputed_one(exports, family):
    """Prefill logits are the forward's, then each greedy step's logits and token are those of
    recomputing the prefix, in a batch whose second row is left-padded; the cache's inputs and
    outputs are named and shaped as optimum's (kv heads, not heads)."""
    module, forward, decoder = exports(family)
    config = module.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in decoder.graph.input}
    layers = config.num_hidden_layers
    cache = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    assert list(inputs) == ["input_ids", "attention_mask", *cache]
    assert inputs["attention_mask"] == ["batch", "total_sequence_length"]
    assert all(inputs[n] == ["batch", kv_heads, "past_sequence_length", head_dim] for n in cache)
    outputs = [o.name for o in decoder.graph.output]
    assert outputs == ["logits", *(n.replace("past_key_values.", "present.") for n in cache)]
    recorded = json.loads({p.key: p.value for p in decoder.metadata_props}[roles.KV_CACHE])
    assert recorded == {"layers": [{"kv_heads": kv_heads, "head_dim": head_dim}] * layers}
    ids, mask = prompt()
    tokens = assert_same_decode(forward, decoder, ids, mask)
    assert len(np.unique(tokens)) > 1  # not one token repeated: the steps differ


def test_tokens_are_transformers_greedy_generate(exports):
    """Qwen2 (one kv head for four query heads): the cached decode's tokens and each step's
    logits are those of transformers' greedy ``generate`` on the torch model itself, the
    left-padded row too (transformers counts its positions as the export does)."""
    module, _, decoder = exports("qwen2")
    ids, mask = prompt()
    tokens, logits = greedy_cached(decoder, ids, mask, STEPS)
    with torch.no_grad():
        made = module.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               max_new_tokens=STEPS, do_sample=False, pad_token_id=0, output_logits=True,
                               return_dict_in_generate=True)  # fmt: skip
    np.testing.assert_array_equal(tokens, made.sequences[:, PROMPT:].numpy())
    for step in range(STEPS):
        np.testing.assert_allclose(logits[step][:, -1], made.logits[step].numpy(), rtol=0, atol=ATOL)


def test_a_forward_without_a_mask_input(transformer_path):
    """tests/models.py's GPT-2 takes input_ids alone and makes its mask as ones like them: the
    decoding model takes no mask either, and that mask grows with the cache."""
    forward = onnx.load(str(transformer_path))
    decoder = graphforge.compile(forward, "kv_cache").model
    assert [i.name for i in decoder.graph.input] == ["input_ids", "past_key_values.0.key", "past_key_values.0.value"]
    ids, _ = prompt(pad=0)
    assert_same_decode(forward, decoder, ids, None)


def test_the_repositorys_llama(tmp_path):
    """tests/models.py's Llama as its builders export it: SDPA attention (scaled Q and Kᵀ, by
    Cast(Sqrt(c)) left unfolded, and a guard against NaN rows between the Softmax and ·V),
    input_ids alone, logits [B, V, T]."""
    ids = torch.randint(0, models.LLAMA_VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 2: "seq"}}
    path = models._export(models.llama_module(), (ids,), tmp_path / "llama.onnx", ["input_ids"], ["logits"], axes)
    forward = onnx.load(str(path))
    decoder = graphforge.compile(forward, "kv_cache").model
    assert_same_decode(forward, decoder, prompt(pad=0)[0], None, vocab=1)


def test_a_model_with_its_cache_is_left_as_it_is(exports):
    _, _, decoder = exports("gpt2")
    result = graphforge.compile(decoder, "kv_cache")
    assert [i.name for i in result.model.graph.input] == [i.name for i in decoder.graph.input]
    assert len(result.model.graph.node) == len(decoder.graph.node)
    assert result.records[0].note == "the model has cache inputs already: left as it is"


# --------------------------------------------------------------------------- the patterns alone

#: the pieces the pass follows, alone: GPT-2's Kᵀ (a [B, T, h, d] reshape transposed to
#: [B, h, d, T], scaled), Llama's repeated Kᵀ (Unsqueeze, Expand, Reshape, Transpose), and the
#: Ranges over the ids' length, the batch and the mask's length, and a mask of ones like the ids
PIECES = """
<ir_version: 8, opset_import: ["" : 17]>
pieces (int64[B, T] input_ids, int64[B, S] attention_mask, float[B, T, 8] x, float[B, 2, T, 4] k)
    => (float[B, 2, 4, T] gpt2_k, float[B, 4, 4, T] gqa_k, int64[T] positions, int64[B] batch, int64[S] keys,
        int64[B, T] ones)
<int64[4] heads = {0, 0, 2, 4}, int64[5] spread = {1, 1, 2, 1, 1}, int64[4] merged = {0, 4, -1, 4},
 int64[1] at2 = {2}, float scale = {0.5}, int64 zero = {0}, int64 one = {1}>
{
    k3 = Reshape(x, heads)
    kt = Transpose <perm = [0, 2, 3, 1]> (k3)
    gpt2_k = Mul(kt, scale)
    u = Unsqueeze(k, at2)
    e = Expand(u, spread)
    r = Reshape(e, merged)
    gqa_k = Transpose <perm = [0, 1, 3, 2]> (r)
    ids_shape = Shape(input_ids)
    length = Gather <axis = 0> (ids_shape, one)
    positions = Range(zero, length, one)
    rows = Gather <axis = 0> (ids_shape, zero)
    batch = Range(zero, rows, one)
    mask_shape = Shape(attention_mask)
    mask_length = Gather <axis = 0> (mask_shape, one)
    keys = Range(zero, mask_length, one)
    ones = ConstantOfShape <value = int64[1] {1}> (ids_shape)
}
"""


def test_the_patterns_alone():
    """K is followed up to what the layer computed, its axes tracked through the transposes and
    the grouped-query repeat; of three Ranges only the ids' length's counts the new tokens."""
    graph = gs.import_onnx(models.parse(PIECES))
    tensors = graph.tensors()
    gpt2, gqa = cache_point(tensors["gpt2_k"], "bhdt"), cache_point(tensors["gqa_k"], "bhdt")
    assert (gpt2.tensor.name, gpt2.axes) == ("k3", "bthd")
    assert (gqa.tensor.name, gqa.axes) == ("k", "bhtd")
    ids = tensors["input_ids"]
    assert [n.outputs[0].name for n in sequence_ranges(graph, ids)] == ["positions"]
    assert [n.outputs[0].name for n in ones_like_ids(graph, ids)] == ["ones"]


# --------------------------------------------------------------------------- refusals

NO_ATTENTION = """
<ir_version: 8, opset_import: ["" : 17]>
no_attention (int64[B, T] input_ids) => (float[B, T, 8] logits)
<float[8, 4] embedding = {0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5,
                          1.6, 1.7, 1.8, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0, 3.1},
 float[4, 8] head = {0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5,
                     1.6, 1.7, 1.8, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0, 3.1}>
{
    hidden = Gather(embedding, input_ids)
    scores = MatMul(hidden, head)
    logits = {op}(scores)
}
"""


def _values(*shape: int) -> str:
    return ", ".join(f"{v:.2f}" for v in np.sin(np.arange(np.prod(shape))))


#: one head-split attention whose positions are counted from the mask's length, as a dynamo
#: export counts them (its sequence dims are one symbol)
POSITIONS_FROM_THE_MASK = f"""
<ir_version: 8, opset_import: ["" : 17]>
attention (int64[B, T] input_ids, int64[B, T] attention_mask) => (float[B, 2, T, 4] context)
<float[16, 8] embedding = {{{_values(16, 8)}}}, float[8, 8] w = {{{_values(8, 8)}}},
 float[16, 4] table = {{{_values(16, 4)}}}, int64[4] heads = {{0, 0, 2, 4}}, int64[2] middle = {{1, 2}},
 int64 zero = {{0}}, int64 one = {{1}}>
{{
    hidden = Gather(embedding, input_ids)
    projected = MatMul(hidden, w)
    x = Reshape(projected, heads)
    q = Transpose <perm = [0, 2, 1, 3]> (x)
    kt = Transpose <perm = [0, 2, 3, 1]> (x)
    v = Transpose <perm = [0, 2, 1, 3]> (x)
    mask_shape = Shape(attention_mask)
    length = Gather <axis = 0> (mask_shape, one)
    counted = Range(zero, length, one)
    positions = Gather(table, counted)
    placed = Add(q, positions)
    products = MatMul(placed, kt)
    mask = Cast <to = 1> (attention_mask)
    mask4 = Unsqueeze(mask, middle)
    scores = Add(products, mask4)
    probabilities = Softmax <axis = -1> (scores)
    context = MatMul(probabilities, v)
}}
"""


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (models.parse(NO_ATTENTION.replace("{op}", "Relu")), "no attention found: the graph has no Softmax"),
        (
            models.parse(NO_ATTENTION.replace("{op}", "Softmax")),
            "layer 0 (an unnamed Softmax): expected exactly one MatMul Q·Kᵀ of two activations",
        ),
        (models.tanh_mlp(), "expected the token ids as the input 'input_ids'; the inputs: x"),
        (models.parse(POSITIONS_FROM_THE_MASK), "no Range counting the new tokens (from axis 1 of 'input_ids')"),
    ],
    ids=["no-softmax", "softmax-of-logits", "no-token-ids", "positions-from-the-mask"],
)
def test_refuses_what_it_does_not_recognize(model, message):
    """One line naming what was expected (and the layer's Softmax, or the Range it looked for); generation
    then recomputes the prefix."""
    with pytest.raises(GraphforgeError) as caught:
        graphforge.compile(model, "kv_cache")
    assert message in str(caught.value) and "\n" not in str(caught.value)


# --------------------------------------------------------------------------- the page


def test_the_pages_blocks_run_as_written(tmp_path, monkeypatch, capsys):
    """docs/guides/kv-cache.md in a fresh folder: the export, the command that writes the
    decoding model (run in this process: the CLI's own start-up is tested elsewhere), and the
    greedy loop, whose tokens are those of recomputing the prefix."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(page_block(PAGE, "python", "torch.onnx.export"), PAGE, "exec", dont_inherit=True), namespace)
    program, *args = shlex.split(page_block(PAGE, "sh", "-p kv_cache"))
    assert program == ".venv/bin/graphforge"
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    loop: dict = {}
    exec(compile(page_block(PAGE, "python", "ort.InferenceSession"), PAGE, "exec", dont_inherit=True), loop)
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    ids = loop["ids"]
    expected, _ = greedy_recomputed(onnx.load("llama.onnx"), ids, np.ones_like(ids), 5)
    assert printed == str(expected[0].tolist())
