"""Rows of text: samples packed one after another (text) or whole and in order (completions,
chat), or one a row; positions restarting at each sample; labels never reaching into the next
sample; what packing does by default for a model that takes an attention mask or positions.
The expected rows are built here from transformers' tokenization of the same lines."""

from __future__ import annotations

import itertools
import json

import _text_helpers as tx
import numpy as np
import pytest

from graphforge.train.text.cache import TokenCache
from graphforge.train.text.rows import Rows, plan

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packing")
    tx.tokenizer(folder / "tok")
    tx.copy_text(folder, "fables.jsonl", "questions.jsonl", "chat.jsonl")
    return folder


def samples(folder, name: str) -> list[list[int]]:
    """Each line's ids as transformers tokenizes text (then EOS) or renders a chat."""
    hf = tx.oracle(folder / "tok")
    out = []
    for line in (folder / name).read_text().splitlines():
        value = json.loads(line)
        if "text" in value:
            out.append(hf(value["text"])["input_ids"] + [hf.eos_token_id])
        else:
            out.append(hf.apply_chat_template(value["messages"], tokenize=True, return_dict=True)["input_ids"])
    return out


def real(rows: dict, r: int) -> np.ndarray:
    return rows["input_ids"][r][rows["attention_mask"][r] == 1]


def test_packed_text_is_the_samples_one_after_another_cut_every_seq_len(folder):
    seq_len, ids = 64, samples(folder, "fables.jsonl")
    rows = tx.all_rows(tx.source(folder / "fables.jsonl", folder / "tok", seq_len=seq_len, pack=True))
    stream = np.concatenate([np.array(s) for s in ids])
    sample_start = np.repeat(np.cumsum([0] + [len(s) for s in ids])[:-1], [len(s) for s in ids])
    last_of_sample = np.cumsum([len(s) for s in ids]) - 1
    assert len(rows["input_ids"]) == -(-len(stream) // seq_len)
    assert np.array_equal(np.concatenate([real(rows, r) for r in range(len(rows["input_ids"]))]), stream)
    for r in range(len(rows["input_ids"])):
        g = np.arange(r * seq_len, min((r + 1) * seq_len, len(stream)))  # the stream's positions in this row
        n = len(g)
        assert rows["position_ids"][r, :n].tolist() == (g - np.maximum(sample_start[g], r * seq_len)).tolist()
        want = np.where(np.isin(g, last_of_sample), tx.IGNORE, stream[np.minimum(g + 1, len(stream) - 1)])
        assert rows["labels"][r, :n].tolist() == want.tolist()  # the next token, never the next sample's first
        assert (rows["labels"][r, n:] == tx.IGNORE).all() and (rows["attention_mask"][r, n:] == 0).all()


def test_unpacked_text_cuts_a_long_sample_into_rows_of_its_own(folder):
    seq_len, ids = 48, samples(folder, "fables.jsonl")
    rows = tx.all_rows(tx.source(folder / "fables.jsonl", folder / "tok", seq_len=seq_len, pack=False))
    # (a piece that is a sample's last token alone has no label: no row)
    pieces = [(s, i) for s in ids for i in range(0, len(s), seq_len) if i + 1 < len(s)]
    assert len(rows["input_ids"]) == len(pieces) > len(ids)
    for r, (sample, begin) in enumerate(pieces):
        piece = sample[begin : begin + seq_len]
        assert real(rows, r).tolist() == piece
        assert rows["position_ids"][r, : len(piece)].tolist() == list(range(len(piece)))
        nxt = sample[begin + 1 : begin + 1 + len(piece)]  # at the piece's end: the sample's next token, in the next row
        assert rows["labels"][r, : len(nxt)].tolist() == nxt
        assert (rows["labels"][r, len(nxt) :] == tx.IGNORE).all()


def test_packed_chats_are_whole_in_file_order_each_row_taking_the_next_while_it_fits(folder):
    seq_len, ids = 320, samples(folder, "chat.jsonl")
    assert max(map(len, ids)) <= seq_len
    rows = tx.all_rows(tx.source(folder / "chat.jsonl", folder / "tok", seq_len=seq_len, pack=True))
    held = []  # per row, the samples it holds: runs of positions from 0
    for r in range(len(rows["input_ids"])):
        positions = rows["position_ids"][r][rows["attention_mask"][r] == 1]
        starts = [*np.flatnonzero(positions == 0).tolist(), len(positions)]
        tokens = real(rows, r)
        held.append([tokens[a:b].tolist() for a, b in itertools.pairwise(starts)])
    assert [s for row in held for s in row] == ids  # whole, in order
    for row, following in itertools.pairwise(held):  # a new row only where the next did not fit
        assert sum(map(len, row)) + len(following[0]) > seq_len
    assert len(held) < len(ids)


def test_samples_longer_than_seq_len_are_cut_and_those_left_with_nothing_to_learn_left_out(folder):
    hf = tx.oracle(folder / "tok")
    seq_len, notes = 40, []
    opened = tx.source(folder / "chat.jsonl", folder / "tok", seq_len=seq_len, pack=False, notes=notes)
    rows = tx.all_rows(opened)
    masks = []
    for line in (folder / "chat.jsonl").read_text().splitlines():
        out = hf.apply_chat_template(
            json.loads(line)["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        masks.append(out["assistant_masks"])
    cut = sum(len(m) > seq_len for m in masks)
    # a label at position t is token t + 1: the first seq_len + 1 tokens hold the labels of a cut sample
    empty = sum(not any(m[1 : seq_len + 1]) for m in masks)
    assert cut > 0 and empty > 0
    assert f"{cut} sample(s) of chat.jsonl longer than data.seq_len = 40 cut to their first 40 tokens" in notes
    assert f"{empty} sample(s) of chat.jsonl have no token to learn within data.seq_len: left out" in notes
    assert len(rows["input_ids"]) == len(masks) - empty
    assert ((rows["labels"] != tx.IGNORE).sum(axis=1) > 0).all()


def test_by_default_a_model_taking_an_attention_mask_gets_one_sample_a_row(folder):
    notes = []
    opened = tx.source(folder / "questions.jsonl", folder / "tok", seq_len=128, takes_mask=True, notes=notes)
    assert opened.samples == 30  # one a row
    assert any("one sample a row, padded: the model takes an attention_mask" in n for n in notes), notes
    notes.clear()
    opened = tx.source(folder / "questions.jsonl", folder / "tok", seq_len=128, takes_mask=True, pack=True, notes=notes)
    assert opened.samples < 30
    notes.clear()
    tx.source(folder / "questions.jsonl", folder / "tok", seq_len=128, takes_positions=True, notes=notes)
    assert any("position_ids restart at each sample" in n for n in notes), notes


def test_a_row_with_no_label_is_left_out():
    """One text sample of seq_len + 1 tokens: its first row holds every label (the last one the
    token in the next row), and the next row its last token alone, which has none."""
    seq_len = 8
    tokens = np.arange(10, 10 + seq_len + 1, dtype=np.uint16)
    cache = TokenCache(
        folder=None,
        tokens=tokens,
        learned=None,
        starts=np.array([0, seq_len + 1]),
        targets=np.array([seq_len]),
        meta={},
    )
    layout = plan(cache, seq_len, fmt="text", pack=True, learn_all=True)
    assert layout.count == 1
    rows = Rows(cache, layout, seq_len, pad_id=0, ignore_index=tx.IGNORE, learn_all=True).build(np.arange(1))
    assert rows["input_ids"][0].tolist() == tokens[:seq_len].tolist()
    assert rows["labels"][0].tolist() == tokens[1:].tolist()
