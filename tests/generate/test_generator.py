"""Generation on the tiny GPT-2 and Llama, each exported plain and with cache inputs, held to
transformers' own generate on the same weights; sampling repeats with its seed; stop strings
and streaming give the text the whole generation gives; an onnxruntime adapter feeds the
parameters it holds."""

from __future__ import annotations

import _generate_helpers as helpers
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from graphforge.errors import GenerationError
from graphforge.generate import Generator

PROMPT = "The fox and the crow"
NEW = 16


@pytest.fixture(scope="module")
def oracles():
    """transformers' modules of the same weights as the exports."""
    return {"gpt2": helpers.gpt2(), "llama": helpers.llama()}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["recomputed", "added", "exported"])
def test_greedy_tokens_are_transformers_greedy_tokens(kind, mode, oracles, tokenizer_file, request):
    """Greedy ids equal generate(do_sample=False) token for token: a plain forward run again for
    each token (cache=False, and the note says so), the same forward given a KV cache by the
    kv_cache pass (the default), and a model exported with its own cache inputs; the cache's
    layers and the positions are read from the model's inputs."""
    model = request.getfixturevalue(f"{kind}_{'cache' if mode == 'exported' else 'plain'}")
    generator = Generator(model, tokenizer_file, device="cpu", cache=mode != "recomputed")
    result = generator.generate(PROMPT, max_new_tokens=NEW)
    expected = helpers.greedy_oracle(oracles[kind], result.prompt_ids, NEW)
    assert result.ids == expected
    assert len(set(expected)) > 3  # the tiny models do not just repeat one token
    assert result.text == generator.tokenizer.decode(expected)
    assert result.stop_reason == ("eos" if helpers.EOS in expected else "max_new_tokens")
    decoding = generator.decoding
    assert len(decoding.cache) == (0 if mode == "recomputed" else oracles[kind].config.num_hidden_layers)
    assert (generator.note is None) == (mode != "recomputed")
    if mode == "recomputed":
        assert generator.note == f"no KV cache in {model}: recomputing the prefix each token (cache off)"
    # GPT-2 reads positions from its wpe table (48 rows); Llama's rotary has no table
    assert decoding.table_positions == (48 if kind == "gpt2" else None)
    assert decoding.vocabulary == helpers.VOCAB
    assert decoding.vocab_last == (mode == "exported" or kind == "gpt2")  # the Llama builder's logits are [B, V, T]


def test_the_prompt_and_the_text_are_transformers_tokens_and_text(tokenizer_file):
    """The tokenizer as transformers' PreTrainedTokenizerFast reads the same file: the prompt's
    ids (its BOS first) and the text of ids (special tokens left out)."""
    from transformers import PreTrainedTokenizerFast

    from graphforge.generate import load_tokenizer

    oracle = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    tokenizer = load_tokenizer(tokenizer_file.parent)
    ids = tokenizer.encode(PROMPT)
    assert ids == oracle(PROMPT).input_ids and ids[0] == 1
    some = [5, 40, 2, 77, 1, 9]
    assert tokenizer.decode(some) == oracle.decode(some, skip_special_tokens=True)
    assert tokenizer.eos_ids == {helpers.EOS}


def test_the_same_seed_gives_the_same_text_and_another_seed_another(gpt2_cache, tokenizer_file):
    generator = Generator(gpt2_cache, tokenizer_file, device="cpu")
    settings = {"max_new_tokens": NEW, "temperature": 1.5, "top_k": 40, "top_p": 0.95}
    first = generator.generate(PROMPT, seed=0, **settings)
    again = generator.generate(PROMPT, seed=0, **settings)
    other = generator.generate(PROMPT, seed=1, **settings)
    assert first.ids == again.ids and first.text == again.text
    assert other.ids != first.ids
    greedy = generator.generate(PROMPT, max_new_tokens=NEW)
    assert first.ids != greedy.ids


def test_a_stop_string_ends_the_text_before_it(gpt2_cache, tokenizer_file, oracles):
    """The ids stop where transformers' generate(stop_strings=...) stops (at the token that
    completes the stop string); the text ends before the stop string. The stop strings are cut
    from the greedy text."""
    import torch
    from transformers import PreTrainedTokenizerFast

    generator = Generator(gpt2_cache, tokenizer_file, device="cpu")
    whole = generator.generate(PROMPT, max_new_tokens=NEW)
    oracle = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    ids = torch.tensor([whole.prompt_ids])
    third = len(whole.text) // 3
    for stop in (whole.text[third : third + 2], whole.text[2 * third : 2 * third + 3]):
        stopped = generator.generate(PROMPT, max_new_tokens=NEW, stop=["never there", stop])
        with torch.no_grad():
            out = oracles["gpt2"].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=NEW, eos_token_id=helpers.EOS, pad_token_id=helpers.EOS,
                                           stop_strings=[stop], tokenizer=oracle)  # fmt: skip
        assert stopped.ids == out[0, ids.shape[1] :].tolist()
        assert len(stopped.ids) < len(whole.ids)
        assert stopped.text == whole.text[: whole.text.find(stop)]
        assert stopped.stop_reason == "stop_string"


def test_streaming_gives_the_text_of_the_whole_generation(llama_cache, tokenizer_file):
    generator = Generator(llama_cache, tokenizer_file, device="cpu")
    settings = {"max_new_tokens": NEW, "temperature": 0.9, "seed": 3, "stop": ["zzz"]}
    stream = generator.stream(PROMPT, **settings)
    pieces = list(stream)
    whole = generator.generate(PROMPT, **settings)
    assert len(pieces) > 3
    assert "".join(pieces) == whole.text == stream.text
    assert stream.ids == whole.ids and stream.stop_reason == whole.stop_reason


def _bias_as_input(source, target, name: str, *, keep_default: bool) -> None:
    """``source`` with initializer ``name`` a graph input (with or without its default)."""
    model = onnx.load(str(source))
    tensor = next(t for t in model.graph.initializer if t.name == name)
    model.graph.input.append(onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
    if not keep_default:
        model.graph.initializer.remove(tensor)
    onnx.save(model, str(target))


def test_an_adapter_feeds_the_parameters_it_holds(gpt2_plain, tokenizer_file, oracles, tmp_path):
    """onnxruntime's LoraAdapter made active on every run: the model's final-norm bias, an input
    with its default, is fed from the adapter file, and the tokens are transformers' on the
    same weights with that bias; without the adapter, the default's. An input without a
    default is one generation cannot feed."""
    torch = pytest.importorskip("torch")
    name = next(
        t.name for t in onnx.load(str(gpt2_plain)).graph.initializer if t.name.endswith("transformer.ln_f.bias")
    )
    _bias_as_input(gpt2_plain, tmp_path / "model.onnx", name, keep_default=True)
    bias = np.random.default_rng(0).normal(0, 1.0, size=32).astype(np.float32)
    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters({name: ort.OrtValue.ortvalue_from_numpy(bias)})
    adapter.export_adapter(str(tmp_path / "bias.onnx_adapter"))
    generator = Generator(tmp_path / "model.onnx", tokenizer_file, device="cpu", adapter=tmp_path / "bias.onnx_adapter")
    result = generator.generate(PROMPT, max_new_tokens=NEW)
    module = helpers.gpt2()
    with torch.no_grad():
        module.transformer.ln_f.bias.copy_(torch.from_numpy(bias))
    assert result.ids == helpers.greedy_oracle(module, result.prompt_ids, NEW)
    plain = Generator(tmp_path / "model.onnx", tokenizer_file, device="cpu").generate(PROMPT, max_new_tokens=NEW)
    assert plain.ids == helpers.greedy_oracle(oracles["gpt2"], result.prompt_ids, NEW) != result.ids
    with pytest.raises(GenerationError, match=f"holds parameters that {gpt2_plain} does not take as inputs: {name}"):
        Generator(gpt2_plain, tokenizer_file, device="cpu", adapter=tmp_path / "bias.onnx_adapter")
    _bias_as_input(gpt2_plain, tmp_path / "required.onnx", name, keep_default=False)
    with pytest.raises(GenerationError, match=f"needs inputs generation does not feed: {name}"):
        Generator(tmp_path / "required.onnx", tokenizer_file, device="cpu")


def test_a_forward_the_kv_cache_pass_refuses_is_run_again_for_each_token(tokenizer_file, tmp_path):
    """A forward with no attention (a bigram model: logits = embedding of each id · W): the
    kv_cache pass refuses it, the note says why, and each token is the argmax of the last row."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    table, weight = rng.standard_normal((helpers.VOCAB, 8)), rng.standard_normal((8, helpers.VOCAB))
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["logits"])],
        "bigram",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", helpers.VOCAB])],
        [
            numpy_helper.from_array(table.astype(np.float32), "table"),
            numpy_helper.from_array(weight.astype(np.float32), "w"),
        ],
    )
    path = tmp_path / "bigram.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    generator = Generator(path, tokenizer_file, device="cpu")
    assert generator.note.startswith(
        f"no KV cache in {path}: recomputing the prefix each token; the kv_cache pass cannot add one: "
    )
    assert "\n" not in generator.note and not generator.decoding.cache
    result = generator.generate(PROMPT, max_new_tokens=4)
    scores = (table @ weight).astype(np.float32)
    expected, last = [], result.prompt_ids[-1]
    for _ in range(4):
        last = int(np.argmax(scores[last]))
        expected.append(last)
    assert result.ids[: len(expected)] == expected[: len(result.ids)]
