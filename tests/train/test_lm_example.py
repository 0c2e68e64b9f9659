"""The language-model example (examples/lm/, ``make lm``) at a tiny size: the same code path
(the corpus, the tokenizer, a Llama pretrained by graphforge train, LoRA fine-tuning, the merged
export, the held-out loss, generation), its outputs at the paths the browser page reads, and its
stated threshold the same in the Makefile, the script and the README."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import onnx
import pytest
from _pages import REPO, page_text

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # examples.lm, as `python -m examples.lm.run` imports it from the root

from examples.lm import corpus, finetune, run  # noqa: E402
from examples.lm.base import BaseSize, other_texts  # noqa: E402

#: one layer of width 64 on 30 kB of docstrings, 80 pretraining steps, 60 of fine-tuning
TINY = BaseSize(vocab_size=512, hidden=64, layers=1, heads=2, positions=128, corpus_chars=30_000, steps=80)
FINETUNE_STEPS = 60
#: the held-out loss drops at least this much at the tiny size (its run: 0.30 on Python 3.11)
TINY_MIN_DROP = 0.15


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    return out, run.run(out, TINY, finetune_steps=FINETUNE_STEPS)


def test_fine_tuning_lowers_the_held_out_loss_and_changes_the_samples(example):
    _, result = example
    assert result["before"] - result["after"] >= TINY_MIN_DROP, result
    assert len(result["samples_before"]) == len(result["samples_after"]) == len(run.PROMPTS)
    # (a sample may be empty: the model may end a text with its EOS at once)
    assert all(isinstance(text, str) for text in result["samples_before"] + result["samples_after"])
    assert any(result["samples_before"]) and any(result["samples_after"]), result
    assert result["samples_before"] != result["samples_after"]


def test_the_outputs_are_where_the_page_reads_them(example):
    out, _ = example
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>"
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == TINY.vocab_size
    for model in ("base", "tuned"):
        graph = onnx.load(str(out / model / "model.onnx")).graph
        assert [i.name for i in graph.input] == ["input_ids"]
        assert [o.name for o in graph.output] == ["logits"]
        dims = [d.dim_param or d.dim_value for d in graph.output[0].type.tensor_type.shape.dim]
        assert dims[2] == TINY.vocab_size and all(isinstance(d, str) for d in dims[:2]), dims


def test_the_held_out_loss_is_torchs_cross_entropy(example):
    """heldout_loss against torch's cross_entropy over the same model's logits, fable by fable."""
    out, result = example
    from tokenizers import Tokenizer

    import graphforge

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    session = graphforge.create_session(str(out / "tuned" / "model.onnx"), providers=["CPUExecutionProvider"])
    losses = []
    for text in corpus.fables()[1]:
        ids = [*tokenizer.encode(text).ids, tokenizer.token_to_id("<|endoftext|>")]
        (logits,) = session.run(["logits"], {"input_ids": np.array([ids], np.int64)})
        targets = torch.tensor(ids[1:])
        losses.append(torch.nn.functional.cross_entropy(torch.from_numpy(logits[0, :-1]).double(), targets,
                                                        reduction="none"))  # fmt: skip
    expected = float(torch.cat(losses).mean())
    assert result["after"] == pytest.approx(expected, rel=1e-9)
    assert (
        finetune.heldout_loss(out / "tuned" / "model.onnx", out / "tokenizer.json", corpus.fables()[1])
        == (result["after"])
    )


def test_the_split_and_the_corpus_are_fixed(example):
    tuned, held_out = corpus.fables()
    shipped = [json.loads(line)["text"] for line in corpus.FABLES.read_text().splitlines()]
    assert (len(tuned), len(held_out)) == (24, 8) and not set(tuned) & set(held_out)
    assert sorted(tuned + held_out) == sorted(shipped)
    out, _ = example  # a second reading of the standard library gives the texts the run pretrained on
    written = [json.loads(line)["text"] for line in (out / "data" / "pretrain.jsonl").read_text().splitlines()]
    assert written == corpus.stdlib_docstrings(TINY.corpus_chars) + other_texts()
    assert sum(map(len, written)) >= TINY.corpus_chars


def test_the_stated_loss_drop_agrees_everywhere():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^LM_MIN_LOSS_DROP := (\S+)$", makefile, re.MULTILINE).group(1) == str(run.MIN_LOSS_DROP)
    line = next(line for line in page_text("README.md").splitlines() if line.startswith("make lm"))
    assert f"fails below {run.MIN_LOSS_DROP}" in line
