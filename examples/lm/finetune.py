"""The example's fine-tuning: LoRA adapters on the pretrained base (examples/lm/base.py), trained
by ``graphforge train`` (examples/lm/finetune.toml) on the fables, merged into the base by
``graphforge.train.export``; and what the example measures on a model: the held-out fables'
loss, and the text it writes after a prompt.

Writes, under ``out``: ``data/fables-train.jsonl`` and ``data/fables-heldout.jsonl`` (the split
of examples/lm/corpus.py), ``finetune/`` (the run) and ``tuned/model.onnx`` (the merged model,
with the base's inputs and output).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

import graphforge
import graphforge.train
from examples.lm import corpus
from examples.lm.base import EXAMPLE, HERE, config
from graphforge.generate import Generator

#: how samples() draws each token: the same draws before and after fine-tuning
SAMPLING = {"temperature": 0.7, "top_k": 40, "seed": 0}


def finetune(out: Path, *, steps: int | None = None, quiet: bool = False) -> Path:
    """Fine-tune ``out/base/model.onnx`` on the fables with LoRA (``steps``: default
    finetune.toml's); the merged model ``out/tuned/model.onnx``."""
    tuned, held_out = corpus.fables()
    corpus.write_jsonl(out / "data" / "fables-train.jsonl", tuned)
    corpus.write_jsonl(out / "data" / "fables-heldout.jsonl", held_out)
    shutil.rmtree(out / "finetune", ignore_errors=True)  # a fresh run, not a resumed one
    result = graphforge.train.run(config(HERE / "finetune.toml", out), out=out / "finetune", steps=steps, quiet=quiet)
    (out / "tuned").mkdir(exist_ok=True)
    graphforge.train.export(result.program, out / "tuned" / "model.onnx", checkpoint=result.checkpoint)
    return out / "tuned" / "model.onnx"


def heldout_loss(model: Path, tokenizer: Path, texts: list[str]) -> float:
    """The mean cross-entropy (nats a token) of ``model`` predicting each token of ``texts``
    from those before it, each text run alone from its first token to the EOS after it (as
    graphforge train's text data ends a sample), by a plain onnxruntime session."""
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_file(str(tokenizer))
    eos = encoder.token_to_id("<|endoftext|>")
    session = graphforge.create_session(str(model), providers=["CPUExecutionProvider"])
    total, count = 0.0, 0
    for text in texts:
        ids = np.array([[*encoder.encode(text).ids, eos]], dtype=np.int64)
        (logits,) = session.run(["logits"], {"input_ids": ids})
        scores = logits[0, :-1].astype(np.float64)
        top = scores.max(axis=-1, keepdims=True)
        log_z = np.log(np.exp(scores - top).sum(axis=-1)) + top[:, 0]
        total += float((log_z - scores[np.arange(len(scores)), ids[0, 1:]]).sum())
        count += len(scores)
    return total / count


def samples(model: Path, tokenizer: Path, prompts: list[str], max_new_tokens: int = 40) -> list[str]:
    """What ``model`` writes after each prompt, up to ``max_new_tokens`` tokens or its EOS, drawn
    at temperature SAMPLING["temperature"] from the SAMPLING["top_k"] likeliest tokens with a fixed
    seed (``graphforge.generate.Generator``, with the KV cache its pass gives the model)."""
    generator = Generator(model, tokenizer=tokenizer, device="cpu", max_positions=EXAMPLE.positions)
    return [generator.generate(prompt, max_new_tokens=max_new_tokens, **SAMPLING).text for prompt in prompts]
