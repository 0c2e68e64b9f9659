"""The new text as it grows (NewText): pieces that never change once given, held back before
a character whose bytes are not all there yet and before what may become a stop string, on a
byte-level tokenizer (GPT-2's kind) whose every byte is a token of its own."""

from __future__ import annotations

import pytest

from graphforge.generate.text import NewText, Tokenizer

TEXT = "Café ☕ au lait, then the end. Fin."


@pytest.fixture(scope="module")
def bytes_tokenizer(tmp_path_factory) -> Tokenizer:
    from tokenizers import Tokenizer as HuggingFaceTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = HuggingFaceTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    bpe.train_from_iterator(["a"], trainer)
    path = tmp_path_factory.mktemp("bytes") / "tokenizer.json"
    bpe.save(str(path))
    return Tokenizer(bpe, path, frozenset())


def _given(tokenizer: Tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[list[str], NewText]:
    """The text given so far after each token (the pieces joined), the rest given at the end."""
    text = NewText(tokenizer, stops)
    given = [""]
    for token in ids:
        given.append(given[-1] + text.add(token))
        if text.stopped:
            break
    given.append(given[-1] + text.rest())
    return given[1:], text


def _after(prefix: str) -> int:
    """The index of the token that completes ``prefix`` of TEXT (one token a byte)."""
    return len(prefix.encode()) - 1


def test_pieces_hold_back_incomplete_characters(bytes_tokenizer):
    ids = bytes_tokenizer.encode(TEXT)
    assert len(ids) == len(TEXT.encode())  # é is two tokens, ☕ three
    given, text = _given(bytes_tokenizer, ids, ())
    assert given[-1] == TEXT == text.text
    assert all(TEXT.startswith(g) for g in given)  # never a replacement character, never taken back
    assert given[_after("Caf") + 1] == "Caf"  # é's first byte: nothing new
    assert given[_after("Café")] == "Café"


def test_a_stop_string_is_held_back_until_it_is_ruled_out_and_cut_when_it_comes(bytes_tokenizer):
    ids = bytes_tokenizer.encode(TEXT)
    given, text = _given(bytes_tokenizer, ids, ("the end", "Fim"))
    assert text.stopped and given[-1] == text.text == "Café ☕ au lait, then "
    assert len(text.ids) == _after("Café ☕ au lait, then the end") + 1  # the token that completed it is kept
    assert given[_after("Café ☕ au lait, t")] == "Café ☕ au lait, "  # "t" may start "the end" ...
    assert given[_after("Café ☕ au lait, the")] == "Café ☕ au lait, "
    assert given[_after("Café ☕ au lait, then")] == "Café ☕ au lait, then"  # ... until "n" rules it out
    given, text = _given(bytes_tokenizer, ids, ("Fim",))
    assert not text.stopped and given[-1] == TEXT
    assert given[_after(TEXT[:-2])] == TEXT[:-4]  # "Fi" waits ...
    assert given[_after(TEXT[:-1])] == TEXT[:-1]  # ... until "n" rules "Fim" out
