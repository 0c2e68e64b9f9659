"""The example's base model: a byte-level BPE tokenizer and a small Llama-style model,
random-initialized with transformers, exported to ONNX and pretrained by ``graphforge train``
(examples/lm/pretrain.toml) on English prose the machine has (examples/lm/corpus.py).

From the repository's root::

    from pathlib import Path
    from examples.lm.base import pretrain

    base = pretrain(Path("out/lm"))  # out/lm/tokenizer.json, tokenizer_config.json, base/model.onnx

writes the files the browser page and the fine-tuning read, under ``out``:
``tokenizer.json`` and ``tokenizer_config.json`` (its ``eos_token``), ``base/model.onnx``
(``input_ids`` [batch, seq] -> ``logits`` [batch, seq, vocab]), ``data/pretrain.jsonl`` (the
corpus) and ``pretrain/`` (the run: program, checkpoint, logs).
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import graphforge.train
from examples.lm import corpus

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
#: the one special token: it ends each text (EOS), as GPT-2's <|endoftext|>
EOS = "<|endoftext|>"
#: data/text's files of other kinds than the fables, pretrained on with the docstrings
OTHER_TEXT = ("kitchen.jsonl", "questions.jsonl")
#: autodiff's warning about an embedding's padding row, which this model does not have
NO_PADDING_ROW = "autodiff: this export does not say whether the embedding lookups"


@dataclass(frozen=True)
class BaseSize:
    """How big the base model, its tokenizer and its corpus are (the example's by default; the
    test's are tiny), and how many steps pretraining takes (None: pretrain.toml's)."""

    vocab_size: int = 512
    hidden: int = 128
    layers: int = 3
    heads: int = 4
    positions: int = 256
    corpus_chars: int = 600_000
    steps: int | None = None


#: the example's sizes
EXAMPLE = BaseSize()


def pretrain(out: Path, size: BaseSize = EXAMPLE, *, quiet: bool = False) -> Path:
    """Write the corpus, train the tokenizer, export a random-initialized Llama and pretrain it
    with graphforge train; the inference model ``out/base/model.onnx``."""
    out.mkdir(parents=True, exist_ok=True)
    texts = corpus.stdlib_docstrings(size.corpus_chars) + other_texts()
    corpus.write_jsonl(out / "data" / "pretrain.jsonl", texts)
    train_tokenizer(out, texts, size.vocab_size)
    export_random_model(out / "init" / "model.onnx", size)
    shutil.rmtree(out / "pretrain", ignore_errors=True)  # a fresh run, not a resumed one
    with warnings.catch_warnings():
        # the model has no padding row (no pad_token_id): autodiff's note that a TorchScript
        # export cannot say which row is padding does not apply
        warnings.filterwarnings("ignore", message=NO_PADDING_ROW)
        result = graphforge.train.run(config(HERE / "pretrain.toml", out), out=out / "pretrain", steps=size.steps,
                                      quiet=quiet)  # fmt: skip
    (out / "base").mkdir(exist_ok=True)
    graphforge.train.export(result.program, out / "base" / "model.onnx", checkpoint=result.checkpoint)
    return out / "base" / "model.onnx"


def config(path: Path, out: Path) -> graphforge.train.Config:
    """The train config ``path`` (examples/lm/*.toml), its relative paths taken from ``out``."""
    with open(path, "rb") as f:
        return graphforge.train.Config.from_dict(tomllib.load(f), base=out, source=path)


def other_texts() -> list[str]:
    """The text of data/text's kitchen notes and questions (their prompt and completion joined)."""
    texts = []
    for name in OTHER_TEXT:
        for line in (corpus.REPO / "data" / "text" / name).read_text().splitlines():
            row = json.loads(line)
            texts.append(row["text"] if "text" in row else row["prompt"] + row["completion"])
    return texts


def train_tokenizer(out: Path, texts: list[str], vocab_size: int) -> Path:
    """``out/tokenizer.json``, a byte-level BPE of ``vocab_size`` tokens trained on ``texts``
    with Hugging Face tokenizers, and ``out/tokenizer_config.json`` naming its EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "model_max_length": 256}
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=1) + "\n")
    return out / "tokenizer.json"


def export_random_model(path: Path, size: BaseSize) -> Path:
    """A Llama of ``size`` (rotary positions, tied embeddings) with random weights (seed 0),
    exported with torch.onnx's TorchScript exporter: ``input_ids`` [batch, seq] -> ``logits``
    [batch, seq, vocab]."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings = LlamaConfig(vocab_size=size.vocab_size, hidden_size=size.hidden, intermediate_size=2 * size.hidden,
                           num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
                           max_position_embeddings=size.positions, tie_word_embeddings=True, bos_token_id=0,
                           eos_token_id=0, use_cache=False, attn_implementation="eager")  # fmt: skip
    model = LlamaForCausalLM(settings)
    with torch.no_grad():  # the exporter would share equal vectors (zero biases, unit norm scales): tell them apart
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.01 * torch.randn(parameter.shape))
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.zeros((2, 8), dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's tracer warnings
        torch.onnx.export(_logits_only(model), (ids,), str(path), dynamo=False, do_constant_folding=False,
                          opset_version=17, input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})  # fmt: skip
    return path


def _logits_only(model):
    """``model`` returning its logits alone, for input_ids alone (its mask all ones: no padding)."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits

    return Logits(model).eval()
