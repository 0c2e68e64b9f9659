"""The token cache: a second run reads the tokens the first wrote, without tokenizing; a
changed file, tokenizer or chat template makes a new entry; data.cache moves it; a failed
tokenization leaves nothing behind."""

from __future__ import annotations

import _text_helpers as tx
import numpy as np
import pytest

from graphforge.errors import ConfigError
from graphforge.train.text import lines
from graphforge.train.text.cache import ROOT


@pytest.fixture
def counted(monkeypatch):
    """How many chunks of lines were tokenized."""
    calls = []
    original = lines.Lines._tokenized

    def tokenized(self, chunk):
        calls.append(len(chunk))
        return original(self, chunk)

    monkeypatch.setattr(lines.Lines, "_tokenized", tokenized)
    return calls


def entries(folder) -> list:
    return sorted(p.name for p in (folder / ROOT).iterdir())


def test_a_second_run_reads_the_cache_without_tokenizing(tmp_path, counted):
    folder = tx.tokenizer(tmp_path / "tok")
    (path,) = tx.copy_text(tmp_path, "chat.jsonl")
    notes = []
    first = tx.all_rows(tx.source(path, folder, seq_len=256, notes=notes))
    assert counted == [20] and any(n.startswith("tokenized chat.jsonl (20 samples, ") for n in notes), notes
    (entry,) = (tmp_path / ROOT).iterdir()
    written = {p.name: p.stat().st_mtime_ns for p in entry.iterdir()}
    assert sorted(written) == ["learned.bin", "meta.json", "starts.npy", "targets.npy", "tokens.bin"]

    notes.clear()
    second = tx.all_rows(tx.source(path, folder, seq_len=256, notes=notes))
    assert counted == [20], "tokenized again"
    assert any("tokenized by an earlier run" in n and entry.name in n for n in notes), notes
    assert {p.name: p.stat().st_mtime_ns for p in entry.iterdir()} == written
    for name, value in first.items():
        assert np.array_equal(second[name], value), name
    # the rows are cut when the source opens: another seq_len or packing reads the same entry
    tx.source(path, folder, seq_len=100, pack=False)
    assert counted == [20] and len(entries(tmp_path)) == 1


def test_a_changed_file_tokenizer_or_template_makes_a_new_entry(tmp_path, counted):
    folder = tx.tokenizer(tmp_path / "tok")
    (path,) = tx.copy_text(tmp_path, "chat.jsonl")
    before = tx.source(path, folder, seq_len=256, pack=False).samples
    with open(path, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}\n')
    assert tx.source(path, folder, seq_len=256, pack=False).samples == before + 1
    assert len(entries(tmp_path)) == 2 and len(counted) == 2

    tx.tokenizer(folder, vocab_size=350)  # another tokenizer.json in the same place
    tx.source(path, folder, seq_len=256)
    assert len(entries(tmp_path)) == 3 and len(counted) == 3

    tx.tokenizer(folder, vocab_size=350, template=tx.headers())  # only the chat template changes
    rows = tx.all_rows(tx.source(path, folder, seq_len=256, pack=False))
    assert len(entries(tmp_path)) == 4 and len(counted) == 4
    hf = tx.oracle(folder)
    assert rows["input_ids"][0, 0] == hf.bos_token_id  # the new template's {{ bos_token }}


def test_data_cache_names_the_folder(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok")
    (path,) = tx.copy_text(tmp_path / "data", "fables.jsonl")
    tx.source(path, folder, seq_len=64, cache=tmp_path / "elsewhere")
    assert not (tmp_path / "data" / ROOT).exists()
    (entry,) = (tmp_path / "elsewhere").iterdir()
    assert entry.name.startswith("fables.jsonl-") and (entry / "meta.json").is_file()


def test_a_bad_line_leaves_no_cache_folder(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok")
    path = tmp_path / "data" / "train.jsonl"
    path.parent.mkdir()
    good = '{"text": "a fox and a crow"}\n'
    path.write_text(good * 700 + '{"text": 5}\n')  # past the first chunk of lines, which was tokenized
    with pytest.raises(ConfigError, match=r'train\.jsonl:701: "text" is a number, expected a string'):
        tx.source(path, folder, seq_len=16)
    assert sorted(p.name for p in path.parent.iterdir()) == ["train.jsonl"]
