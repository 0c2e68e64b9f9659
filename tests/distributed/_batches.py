"""The global batches the data-parallel tests train on: digits images and labels, and token
ids with regression targets for the small transformer, for 1 and 2 micro-batches per step."""

from __future__ import annotations

from pathlib import Path

import models
import numpy as np
from _launch import REPO


def write_batches(folder: Path, steps: int, size: int, *, seq: int, seed: int) -> None:
    """``<model>-<micro-batches>.npz`` in ``folder``: ``steps`` × micro-batches batches of ``size`` rows."""
    digits = np.load(REPO / "data" / "digits" / "train.npz")
    rng = np.random.default_rng(seed)
    for model in ("digits", "gpt"):
        for accumulate in (1, 2):
            count = steps * accumulate
            if model == "digits":
                rows = rng.integers(0, len(digits["labels"]), (count, size))
                arrays = {"images": digits["images"][rows], "labels": digits["labels"][rows]}
            else:
                vocab = models.GPT2_CONFIG["vocab_size"]
                arrays = {
                    "input_ids": rng.integers(0, vocab, (count, size, seq)),
                    "labels": rng.standard_normal((count, size, seq, vocab)).astype(np.float32),
                }
            np.savez(folder / f"{model}-{accumulate}.npz", **arrays)
