"""Text data under torchrun: two processes train as one process with the doubled batch; and a
run stopped and resumed equals the uninterrupted one bit for bit (the rows are an ArraySource:
the same shards and data position as .npz data).

The loss is the mean over each process's labels, and data parallelism averages the processes'
gradients, so two processes equal one only where each holds as many labels: the lines here are
15 words of a word-level tokenizer each, every row one line and its EOS, 15 labels a row."""

from __future__ import annotations

import sys
from pathlib import Path

import _text_helpers as tx
import _train_helpers as th
import models
import numpy as np
import pytest

import graphforge.train
from graphforge.runtime import CheckpointState
from graphforge.train.logs import read_jsonl

sys.path.insert(0, str(th.REPO / "tests" / "distributed"))
import _train_runs as runs

pytest.importorskip("transformers")
pytest.importorskip("torch")

STEPS, SEQ_LEN = 8, 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("text-dp")
    tx.word_tokenizer(folder / "tok")
    tx.windows("fables.jsonl", folder / "train.jsonl", SEQ_LEN - 1)
    tx.windows("kitchen.jsonl", folder / "eval.jsonl", SEQ_LEN - 1)
    tx.gpt2(folder / "model.onnx", vocab=2048)
    return folder


def config(folder: Path, name: str, batch_size: int) -> Path:
    document = th.base_config(
        model={"pipeline": tx.PIPELINE},
        data={"train": "train.jsonl", "eval": "eval.jsonl", "tokenizer": "tok", "seq_len": SEQ_LEN,
              "batch_size": batch_size},
        eval={"every": 4},
        checkpoint={"every": 4, "keep_last": 10},
        distributed={"timeout_s": 30},
    )  # fmt: skip
    return th.write_config(folder, document, name)


def checkpoint(out: Path, step: int) -> CheckpointState:
    return CheckpointState.load(runs.checkpoint_path(out, step))


def test_two_processes_train_as_one_with_the_doubled_batch_and_resume_bit_for_bit(folder):
    two = folder / "out-2"
    runs.launch(folder, config(folder, "two.toml", 4), two, "--steps", str(STEPS))
    one = graphforge.train.run(config(folder, "one.toml", 8), steps=STEPS, out=folder / "out-1", quiet=True)
    want, got = CheckpointState.load(one.checkpoint), checkpoint(two, STEPS)
    for name in want.tensors:  # (the key bias follows rounding only: models.without_key_bias)
        ours, theirs = (models.without_key_bias(name, t.tensors[name]).astype(np.float64) for t in (got, want))
        error = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
        assert error <= 1e-5, (name, error)
    assert got.data_position == want.data_position
    reference = read_jsonl(folder / "out-1" / "log.jsonl")
    for mine, expected in zip(read_jsonl(two / "log.jsonl"), reference, strict=True):
        for key in ("loss", "eval_loss", "eval_accuracy"):
            if key in expected:
                assert mine[key] == pytest.approx(expected[key], rel=1e-5), (key, mine, expected)
    assert any("eval_loss" in r for r in reference)

    # stopped halfway and resumed (in one process: the two processes' shards of the rows and
    # their data position are an ArraySource's, whose distributed resume test_train_distributed holds)
    resumed = folder / "out-1-resumed"
    graphforge.train.run(config(folder, "one.toml", 8), steps=STEPS // 2, out=resumed, quiet=True)
    graphforge.train.run(config(folder, "one.toml", 8), steps=STEPS, out=resumed, quiet=True)
    after, whole = checkpoint(resumed, STEPS), CheckpointState.load(one.checkpoint)
    for name, value in whole.tensors.items():
        assert np.array_equal(after.tensors[name], value), name
    assert after.data_position == whole.data_position
    assert after.properties["settings"] == whole.properties["settings"]
    assert got.properties["settings"]["data.seq_len"] == SEQ_LEN
