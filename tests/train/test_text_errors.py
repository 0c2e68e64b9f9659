"""Bad text data is one error naming the file, the line and what is wrong, before anything is
written: a line that is not JSON, lacks its field or holds the wrong type; an empty file; ids
past the model's vocabulary; logits with the vocabulary last, which the loss would misread;
text keys that do not go together."""

from __future__ import annotations

import re
import sys

import _text_helpers as tx
import _train_helpers as th
import pytest
from _pages import page_block
from _tracebacks import assert_no_traceback

from graphforge.errors import ConfigError
from graphforge.train.config import Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

pytest.importorskip("transformers")

GOOD = '{"text": "A fox found a bunch of grapes."}'
CHAT = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}'


@pytest.mark.parametrize(
    ("line", "fmt", "message"),
    [
        ('{"text": "unfinished', "text", r"not JSON \(Unterminated string"),
        ('["text", "a list"]', "text", r'is a list, not an object like \{"text": "..."\} \(format = "text"\)'),
        ('{"txt": "x"}', "text", r'has no "text" \(format = "text" reads \{"text": "..."\}\)'),
        ('{"text": 5}', "text", r'"text" is a number, expected a string'),
        ('{"prompt": "Q", "answer": "A"}', "completions", r'has no "completion"'),
        ('{"prompt": null, "completion": "A"}', "completions", r'"prompt" is null, expected a string'),
        ('{"messages": "hi"}', "chat", r'"messages" is a string, expected a list of messages'),
        ('{"messages": [{"content": "hi"}]}', "chat", r'"messages"\[0\]: "role" is missing, expected a string'),
        ('{"messages": [{"role": "user", "content": 3}]}', "chat", r'"messages"\[0\]: "content" is a number'),
        (
            '{"messages": [{"role": "tool", "content": "x"}]}',
            "chat",
            r"the chat template fails on it: unknown role tool",
        ),
    ],
)
def test_a_bad_line_is_named_by_file_and_number(tmp_path, line, fmt, message):
    folder = tx.tokenizer(tmp_path / "tok", template=tx.headers())
    path = tmp_path / "train.jsonl"
    good = {"text": GOOD, "completions": '{"prompt": "Q", "completion": "A"}', "chat": CHAT}[fmt]
    path.write_text(f"{good}\n\n{good}\n{line}\n{good}\n")
    with pytest.raises(ConfigError, match=rf"^train\.toml: data\.train: {re.escape(str(path))}:4: {message}"):
        tx.source(path, folder, format=fmt, seq_len=16)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    folder = tx.tokenizer(tmp_path / "tok")
    path = tmp_path / "train.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"train\.jsonl:2: not UTF-8 text \(invalid continuation byte\)"):
        tx.source(path, folder)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"train": "a.jsonl"}, r"data\.train = '.*a\.jsonl' is JSONL text: give data\.tokenizer"),
        ({"train": "a.npz", "seq_len": 64}, r"data\.seq_len applies to JSONL text data; data\.train = '.*a\.npz'"),
        ({"train": "a.jsonl", "tokenizer": "t", "format": "text", "mask_prompt": True}, r"data\.mask_prompt applies"),
        ({"train": "a.jsonl", "tokenizer": "t", "format": "dialogue"}, r'data\.format must be one of "text"'),
        ({"train": "a.jsonl", "tokenizer": "t", "seq_len": 1}, r"data\.seq_len must be a whole number ≥ 2"),
    ],
)
def test_text_keys_are_checked_with_the_config(data, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"model": {"program": "p.onnx"}, "data": data})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text-errors")
    tx.tokenizer(folder / "tok")
    tx.tokenizer(folder / "big", vocab_size=600)
    tx.gpt2(folder / "model.onnx", vocab=400)
    tx.gpt2(folder / "vocabulary-last.onnx", vocab=400, classes_first=False)
    tx.copy_text(folder, "fables.jsonl")
    (folder / "bad.jsonl").write_text(f"{GOOD}\n{GOOD}\n{{'text': 'single quotes'}}\n")
    (folder / "empty.jsonl").write_text("\n  \n")
    return folder


def one_error(proc, *fragments: str) -> str:
    """Exit 2, one error line holding every fragment, no traceback (the TorchScript export's
    GPT-2 also has autodiff warn about its embeddings' padding rows)."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert_no_traceback(proc.stderr + proc.stdout)
    (line,) = [x for x in proc.stderr.splitlines() if not x.startswith("warning: autodiff:")]
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def test_the_command_refuses_bad_data_in_one_line_and_writes_nothing(folder):
    cfgs = {
        "bad": tx.config(folder, "bad.toml", train="bad.jsonl"),
        "empty": tx.config(folder, "empty.toml", train="empty.jsonl"),
        "vocabulary": tx.config(folder, "vocabulary.toml", train="fables.jsonl", tokenizer="big"),
        "layout": tx.config(folder, "layout.toml", model="vocabulary-last.onnx", train="fables.jsonl"),
    }
    runs = {key: (["train", cfg, "--out", f"out-{key}"], folder) for key, cfg in cfgs.items()}
    done = th.cli_many(runs, timeout=300)
    one_error(done["bad"], "error: ", "bad.toml: data.train:", "bad.jsonl:3: not JSON (Expecting property name")
    one_error(done["empty"], "empty.jsonl holds no samples (it is empty, or only blank lines)")
    line = one_error(done["vocabulary"], "big/tokenizer.json is past the model's vocabulary: its embedding")
    assert "has 400 rows (the data's largest id is 5" in line and "train with the model's own tokenizer" in line, line
    one_error(
        done["layout"],
        "the loss scores 'logits' shaped [batch, seq, 400], the vocabulary last, and loss(kind=cross_entropy) "
        "takes the classes on axis 1 unless told: compile it with loss(kind=cross_entropy, output=logits, axis=-1)",
    )
    assert not [p for p in folder.iterdir() if p.name.startswith("out-")]
    # the bad and the empty files left no cache; the vocabulary's (a good file, tokenized) is kept
    assert [p.name.split("-")[0] for p in (folder / ".graphforge-cache").iterdir()] == ["fables.jsonl"]


def test_the_training_pages_text_config_is_a_valid_config():
    block = page_block("docs/getting-started/training.md", "toml", "[model]", 'tokenizer = "tokenizer"')
    config = Config.from_dict(tomllib.loads(block), base="/data")
    assert config.data.seq_len == 512 and str(config.data.tokenizer) == "/data/tokenizer"
