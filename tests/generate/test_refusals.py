"""What generation refuses, each in one line naming what and where, before a token is made: a
tokenizer whose ids go past the model's logits, a prompt longer than the model's positions, a
model with no logits-like output or inputs it cannot feed, an empty prompt, bad settings and
missing files. A generation that uses up the positions stops there, keeping its text."""

from __future__ import annotations

import _generate_helpers as helpers
import models
import onnx
import pytest

from graphforge.errors import GenerationError
from graphforge.generate import Generator


def test_a_tokenizer_past_the_models_vocabulary_is_refused(gpt2_cache, llama_plain, tmp_path):
    """200 ids against 128 logits: read from [B, T, V] logits, and from the Llama builder's [B, V, T]."""
    wide = helpers.tokenizer(tmp_path / "wide", vocab_size=200)
    for model in (gpt2_cache, llama_plain):
        with pytest.raises(GenerationError, match=rf"gives ids up to 199, past the 128 logits of {model}"):
            Generator(model, wide, device="cpu")


def test_a_prompt_longer_than_the_position_table_is_refused(gpt2_plain, tokenizer_file):
    generator = Generator(gpt2_plain, tokenizer_file, device="cpu")
    prompt = "The fox and the crow. " * 10
    length = len(generator.tokenizer.encode(prompt))
    assert length > 48
    with pytest.raises(
        GenerationError,
        match=rf"the prompt is {length} tokens long, longer than the 48 positions .* position table '.*wpe.weight'",
    ):
        generator.generate(prompt)


def test_without_a_table_max_positions_bounds_the_prompt_and_the_generation(llama_cache, tokenizer_file):
    """Llama's rotary positions have no table: --max-positions is the bound; a generation that
    reaches it stops there with the text so far."""
    generator = Generator(llama_cache, tokenizer_file, device="cpu", max_positions=9)
    with pytest.raises(GenerationError, match=r"longer than the 9 positions of .* \(given as max_positions\)"):
        generator.generate("The fox and the crow. The fox and the crow.")
    result = generator.generate("The fox", max_new_tokens=20)
    prompt = len(result.prompt_ids)
    assert result.stop_reason == "positions"
    assert len(result.ids) == 9 - prompt + 1  # the last token is chosen from the 9th position's logits
    unbounded = Generator(llama_cache, generator.tokenizer, device="cpu").generate("The fox", max_new_tokens=20)
    assert unbounded.ids[: len(result.ids)] == result.ids


def test_a_model_without_logits_is_refused(tmp_path, tokenizer_file):
    model = models.parse(
        """<ir_version: 8, opset_import: ["" : 17]>
        g (int64[batch, seq] input_ids) => (float[batch, seq] hidden) {
            hidden = Cast<to = 1>(input_ids)
        }"""
    )
    onnx.save(model, str(tmp_path / "encoder.onnx"))
    with pytest.raises(GenerationError, match="has no logits-like output: no 'logits', and 0 floating-point outputs"):
        Generator(tmp_path / "encoder.onnx", tokenizer_file, device="cpu")


@pytest.mark.parametrize(
    ("prompt", "settings", "message"),
    [
        ("", {}, "the prompt is empty"),
        ([], {}, "the prompt is empty"),
        ([5, 128], {}, r"the prompt's ids must lie in \[0, 128\), got 5 to 128"),
        ("The fox", {"max_new_tokens": 0}, "max_new_tokens must be a whole number ≥ 1"),
        ("The fox", {"stop": ["fox", ""]}, "a stop string is empty"),
        ("The fox", {"top_p": 2.0}, r"top_p must lie in \(0, 1\]"),
    ],
)
def test_bad_requests_are_refused(gpt2_cache, tokenizer_file, prompt, settings, message):
    generator = Generator(gpt2_cache, tokenizer_file, device="cpu")
    with pytest.raises(GenerationError, match=message):
        generator.generate(prompt, **settings)


def test_missing_files_are_named(gpt2_cache, tokenizer_file, tmp_path):
    with pytest.raises(GenerationError, match=f"tokenizer: no such file {tmp_path / 'none.json'}"):
        Generator(gpt2_cache, tmp_path / "none.json")
    with pytest.raises(GenerationError, match=f"adapter: no such file {tmp_path / 'a.onnx_adapter'}"):
        Generator(gpt2_cache, tokenizer_file, adapter=tmp_path / "a.onnx_adapter")
    (tmp_path / "junk.onnx_adapter").write_bytes(b"not an adapter")
    with pytest.raises(GenerationError, match="is not an onnxruntime adapter file"):
        Generator(gpt2_cache, tokenizer_file, adapter=tmp_path / "junk.onnx_adapter")
