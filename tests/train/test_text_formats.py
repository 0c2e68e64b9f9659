"""JSONL text in MLX-LM's three shapes, read as graphforge train reads it: each row's token ids,
labels and masks against transformers reading the same tokenizer files (its tokenizer for text
and completions, its ``apply_chat_template`` for the rendered chat and, with
``return_assistant_tokens_mask``, for which tokens are the assistant's)."""

from __future__ import annotations

import json

import _text_helpers as tx
import numpy as np
import pytest

from graphforge.errors import ConfigError
from graphforge.train.text.tokenizer import load_tokenizer

pytest.importorskip("transformers")


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_rows(rows: dict, expected: list[tuple[list[int], list[bool]]]) -> None:
    """Row r holds sample r: its ids, then padding; labels[t] = ids[t + 1] where that token is
    learned, else the ignore index (unshifted_labels: the same one place later); the mask 1 on
    tokens; positions from 0."""
    assert len(rows["input_ids"]) == len(expected)
    for r, (ids, learned) in enumerate(expected):
        n = len(ids)
        assert rows["input_ids"][r, :n].tolist() == ids, r
        assert rows["attention_mask"][r].tolist() == [1] * n + [0] * (rows["attention_mask"].shape[1] - n)
        assert rows["position_ids"][r, :n].tolist() == list(range(n))
        want = [ids[t + 1] if learned[t + 1] else tx.IGNORE for t in range(n - 1)]
        assert rows["labels"][r, : n - 1].tolist() == want, r
        assert (rows["labels"][r, n - 1 :] == tx.IGNORE).all()
        # as a transformers model that shifts them itself takes them: one place later
        assert rows["unshifted_labels"][r, 0] == tx.IGNORE
        assert rows["unshifted_labels"][r, 1:].tolist() == rows["labels"][r, :-1].tolist()


@pytest.mark.parametrize("bos", [False, True], ids=["plain", "with-bos-post-processor"])
def test_text_is_each_line_tokenized_with_the_tokenizers_special_tokens_then_eos(tmp_path, bos):
    folder = (tx.bos_tokenizer if bos else tx.tokenizer)(tmp_path / "tok")
    (path,) = tx.copy_text(tmp_path, "fables.jsonl")
    hf = tx.oracle(folder)
    expected = [hf(line["text"])["input_ids"] + [hf.eos_token_id] for line in lines(path)]
    assert all(ids[0] == hf.bos_token_id for ids in expected) == bos
    rows = tx.all_rows(tx.source(path, folder, pack=False))
    check_rows(rows, [(ids, [True] * len(ids)) for ids in expected])


def test_completions_without_a_chat_template_learn_exactly_the_completion_and_eos(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok", template=None)
    (path,) = tx.copy_text(tmp_path, "questions.jsonl")
    hf = tx.oracle(folder)
    expected = []
    for line in lines(path):
        prompt = hf(line["prompt"])["input_ids"]
        completion = hf(line["completion"], add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
        expected.append((prompt + completion, [False] * len(prompt) + [True] * len(completion)))
    check_rows(tx.all_rows(tx.source(path, folder, pack=False)), expected)
    # mask_prompt = false: every token after the first is a label
    every = [(ids, [True] * len(ids)) for ids, _ in expected]
    check_rows(tx.all_rows(tx.source(path, folder, pack=False, mask_prompt=False)), every)


def test_completions_with_a_chat_template_are_a_user_message_and_the_assistants_answer(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok")
    (path,) = tx.copy_text(tmp_path, "questions.jsonl")
    hf = tx.oracle(folder)
    expected = []
    for line in lines(path):
        messages = [{"role": "user", "content": line["prompt"]}, {"role": "assistant", "content": line["completion"]}]
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert any(out["assistant_masks"])
        expected.append((out["input_ids"], [bool(m) for m in out["assistant_masks"]]))
    check_rows(tx.all_rows(tx.source(path, folder, pack=False)), expected)


def test_chat_through_a_template_with_generation_blocks_learns_what_transformers_marks_as_the_assistants(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok")
    (path,) = tx.copy_text(tmp_path, "chat.jsonl")
    hf = tx.oracle(folder)
    expected = []
    for line in lines(path):
        out = hf.apply_chat_template(
            line["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        expected.append((out["input_ids"], [bool(m) for m in out["assistant_masks"]]))
    assert sum(sum(learned) for _, learned in expected) < sum(len(ids) for ids, _ in expected) / 2
    check_rows(tx.all_rows(tx.source(path, folder, pack=False)), expected)


def test_chat_through_a_template_without_them_learns_each_assistant_message_and_its_end_of_turn(tmp_path):
    """The text each assistant message adds (its content, end marker and newline) is what the
    same template with that text in {% generation %} blocks marks; transformers renders and
    tokenizes the plain template to the same ids, BOS from the bos_token variable included."""
    folder = tx.tokenizer(tmp_path / "tok", template=tx.headers())
    tagged = tx.tokenizer(tmp_path / "tagged", template=tx.headers(generation=True))
    (path,) = tx.copy_text(tmp_path, "chat.jsonl")
    hf, hf_tagged = tx.oracle(folder), tx.oracle(tagged)
    ours = load_tokenizer(folder, "test").template
    expected = []
    for line in lines(path):
        messages = line["messages"]
        text = hf.apply_chat_template(messages, tokenize=False)
        assert ours.render(messages) == text and text.startswith("<|endoftext|>")
        ids = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        out = hf_tagged.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert out["input_ids"] == ids
        expected.append((ids, [bool(m) for m in out["assistant_masks"]]))
    check_rows(tx.all_rows(tx.source(path, folder, pack=False)), expected)
    # and the generation prompt, as transformers writes it
    messages = lines(path)[0]["messages"][:1]
    assert ours.render(messages, add_generation_prompt=True) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_a_template_reads_its_chat_template_jinja_before_the_configs(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok")
    (folder / "chat_template.jinja").write_text(tx.headers())
    template = load_tokenizer(folder / "tokenizer.json", "test").template
    assert template.text == tx.headers()


def test_the_format_is_told_by_the_first_lines_keys_as_mlx_lm_does(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok")
    paths = tx.copy_text(tmp_path, "fables.jsonl", "questions.jsonl", "chat.jsonl")
    described = [tx.source(p, folder).describe() for p in paths]
    assert [d.split()[1] for d in described] == ["text", "completions", "chat"], described
    with pytest.raises(ConfigError, match=r'questions\.jsonl:1: has no "text" \(format = "text" reads'):
        tx.source(paths[1], folder, format="text")


def test_chat_needs_a_chat_template(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok", template=None)
    (path,) = tx.copy_text(tmp_path, "chat.jsonl")
    with pytest.raises(ConfigError, match=r'format = "chat" renders the messages .*tokenizer_config\.json has none'):
        tx.source(path, folder)


def test_the_rows_are_numpy_views_of_a_memory_mapped_cache(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok")
    (path,) = tx.copy_text(tmp_path, "fables.jsonl")
    opened = tx.source(path, folder, seq_len=64, pack=True)
    tokens = opened.arrays["input_ids"].rows.cache.tokens
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
