"""``graphforge train`` on JSONL text: a tiny GPT-2 (random weights, exported here) learns the
shipped fables and its loss falls; a model taking attention_mask and position_ids gets rows
that give, through its ONNX export, torch's logits for each sample alone."""

from __future__ import annotations

import _text_helpers as tx
import _train_helpers as th
import numpy as np
import onnxruntime as ort
import pytest

import graphforge.train
from graphforge.errors import ConfigError
from graphforge.train.logs import read_jsonl

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def test_a_tiny_gpt2_learns_the_fables_and_its_loss_falls(tmp_path):
    tx.tokenizer(tmp_path / "tok")
    tx.gpt2(tmp_path / "model.onnx", vocab=400)
    tx.copy_text(tmp_path, "fables.jsonl", "kitchen.jsonl")
    cfg = tx.config(tmp_path, train="fables.jsonl", eval="kitchen.jsonl", batch_size=8)
    done = th.cli("train", cfg, "--steps", 40, "--out", "out", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "train 32 text samples of " in out and "fables.jsonl in 146 rows of 32 tokens, packed (1% padding)" in out, (
        out
    )
    assert "tokenized fables.jsonl (32 samples, " in out and "tokenized kitchen.jsonl (24 samples, " in out, out
    records = read_jsonl(tmp_path / "out" / "log.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[0] > np.log(400) - 0.5 and losses[-1] < losses[0] - 1.0, losses
    evals = [r for r in records if "eval_loss" in r]
    assert evals and 0 < evals[-1]["eval_accuracy"] < 1 and np.isfinite(evals[-1]["eval_loss"]), evals

    # a second run reads the tokens the first wrote
    again = th.cli("train", cfg, "--steps", 2, "--out", "out-again", cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "tokens of fables.jsonl (32 samples, " in again.stdout and "tokenized by an earlier run" in again.stdout

    # what fixes the rows is saved with the checkpoint: resuming with another seq_len is refused
    changed = tx.config(tmp_path, "changed.toml", train="fables.jsonl", eval="kitchen.jsonl", batch_size=8, seq_len=16)
    with pytest.raises(
        ConfigError, match=r"data\.seq_len is 16 but .*-00000040\.safetensors was written with data\.seq_len = 32"
    ):
        graphforge.train.run(changed, steps=42, out=tmp_path / "out", quiet=True)


def test_transformers_layout_learns_alike_with_the_loss_on_the_last_axis(tmp_path):
    """The same GPT-2 exported with transformers' [batch, seq, vocab] logits, compiled with
    loss(axis=-1), takes the same steps as its [batch, vocab, seq] export (same weights, data),
    and its evaluation (the accuracy's argmax over the last axis) gives the same figures."""
    tx.tokenizer(tmp_path / "tok")
    tx.gpt2(tmp_path / "first.onnx", vocab=400)
    tx.gpt2(tmp_path / "last.onnx", vocab=400, classes_first=False)
    tx.copy_text(tmp_path, "fables.jsonl", "kitchen.jsonl")
    last = "loss(kind=cross_entropy, output=logits, axis=-1), autodiff, adamw(lr=0.01)"
    data = {"train": "fables.jsonl", "eval": "kitchen.jsonl", "batch_size": 8}
    cfgs = {
        "first": tx.config(tmp_path, "first.toml", model="first.onnx", **data),
        "last": tx.config(tmp_path, "last.toml", model="last.onnx", pipeline=last, **data),
    }
    done = th.cli_many({k: (["train", c, "--steps", 12, "--out", f"out-{k}"], tmp_path) for k, c in cfgs.items()})
    losses = {}
    for key, proc in done.items():
        assert proc.returncode == 0, proc.stdout + proc.stderr
        losses[key] = [r["loss"] for r in read_jsonl(tmp_path / f"out-{key}" / "log.jsonl") if "loss" in r]
    np.testing.assert_allclose(losses["last"], losses["first"], rtol=1e-4)
    assert losses["last"][-1] < losses["last"][0] - 0.5, losses["last"]
    evals = {k: [r for r in read_jsonl(tmp_path / f"out-{k}" / "log.jsonl") if "eval_loss" in r][-1] for k in cfgs}
    np.testing.assert_allclose(evals["last"]["eval_loss"], evals["first"]["eval_loss"], rtol=1e-4)
    assert evals["last"]["eval_accuracy"] == evals["first"]["eval_accuracy"] > 0, evals


def test_rows_feed_a_models_attention_mask_and_position_ids_as_transformers_takes_them(tmp_path):
    """One sample a row (the default for a model taking a mask): each row's logits, through the
    ONNX export, are torch's for the sample alone. Packed (pack = true), a row's second sample
    differs from itself alone: it attends to the first, as the run's note says."""
    tx.tokenizer(tmp_path / "tok", template=None)  # questions as prompt then completion: short
    module = tx.gpt2_with_mask_and_positions(tmp_path / "model.onnx", vocab=400)
    (path,) = tx.copy_text(tmp_path, "questions.jsonl")
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])

    def logits(rows, r):
        feeds = {name: rows[name][r : r + 1] for name in ("input_ids", "attention_mask", "position_ids")}
        return session.run(None, feeds)[0][0]

    def alone(ids):
        with torch.no_grad():
            t = torch.tensor([ids])
            return module(t, torch.ones_like(t), torch.arange(len(ids))[None]).numpy()[0]

    padded = tx.all_rows(tx.source(path, tmp_path / "tok", seq_len=64, pack=False))
    for r in (0, 7):
        n = int(padded["attention_mask"][r].sum())
        assert n < 64
        np.testing.assert_allclose(logits(padded, r)[:, :n], alone(padded["input_ids"][r, :n].tolist()), atol=1e-4)
    packed = tx.all_rows(tx.source(path, tmp_path / "tok", seq_len=64, pack=True))
    second = int(np.flatnonzero(packed["position_ids"][0] == 0)[1])
    n = second + int(np.argmin(packed["position_ids"][0, second + 1 :] > 0)) + 1
    got = logits(packed, 0)
    np.testing.assert_allclose(got[:, :second], alone(packed["input_ids"][0, :second].tolist()), atol=1e-4)
    assert not np.allclose(got[:, second:n], alone(packed["input_ids"][0, second:n].tolist()), atol=1e-2)


def test_a_model_taking_an_attention_mask_learns_chats_one_a_row(tmp_path):
    tx.tokenizer(tmp_path / "tok")
    tx.gpt2_with_mask_and_positions(tmp_path / "model.onnx", vocab=400)
    tx.copy_text(tmp_path, "chat.jsonl")
    cfg = tx.config(tmp_path, train="chat.jsonl", seq_len=128, batch_size=4)
    done = th.cli("train", cfg, "--steps", 20, "--out", "out", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "one sample a row, padded: the model takes an attention_mask" in done.stdout, done.stdout
    assert "chat.jsonl in 20 rows of 128 tokens (" in done.stdout, done.stdout
    losses = [r["loss"] for r in read_jsonl(tmp_path / "out" / "log.jsonl") if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
