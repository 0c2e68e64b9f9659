"""Choosing the next token from a row of logits: greedy, or sampled after temperature, top-k
and top-p (nucleus) filtering, applied in that order with transformers' arithmetic
(TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper), drawn with a seeded numpy
Generator so that the same seed gives the same tokens: Philox4x64-10 keyed by the seed itself
(no SeedSequence), one float64 uniform per token, a stream a JavaScript page reproduces
(examples/web-lm/sampling.js)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphforge.errors import GenerationError


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. Greedy (the most likely token) unless ``temperature``,
    ``top_k`` or ``top_p`` is given; then sampled, at temperature 1 where only top-k or top-p
    is given. ``temperature=0`` is greedy too."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if t is not None and not (np.isfinite(t) and t >= 0):
            raise GenerationError(f"temperature must be a number ≥ 0 (0: greedy), got {t!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise GenerationError(f"top_k must be a whole number ≥ 1, got {k!r}")
        if p is not None and not (0 < p <= 1):
            raise GenerationError(f"top_p must lie in (0, 1], got {p!r}")
        if t == 0 and (k is not None or p is not None):
            raise GenerationError("temperature 0 is greedy decoding: top_k and top_p do not apply")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or (self.temperature is None and self.top_k is None and self.top_p is None)

    def rng(self) -> np.random.Generator:
        """numpy's Philox with the seed as its key (no seed: a random key)."""
        if self.seed is None:
            return np.random.Generator(np.random.Philox())
        return np.random.Generator(np.random.Philox(key=self.seed))

    def choose(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """The next token from ``logits`` [vocab]."""
        if self.greedy:
            return int(np.argmax(logits))
        scores = filtered(logits, self.temperature or 1.0, self.top_k, self.top_p)
        return draw(scores, rng)


def filtered(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """``logits`` [..., vocab] (float32) divided by ``temperature``, with every token outside the
    top ``top_k`` and outside the nucleus ``top_p`` set to -inf (one token is always kept)."""
    scores = np.asarray(logits, dtype=np.float32) / np.float32(temperature)
    if top_k is not None:
        k = min(top_k, scores.shape[-1])
        kth = np.partition(scores, -k, axis=-1)[..., -k, None]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p is not None:
        scores = _nucleus(scores, top_p)
    return scores


def _nucleus(scores: np.ndarray, top_p: float) -> np.ndarray:
    """TopPLogitsWarper: sorted ascending, the tokens whose cumulative probability stays at or
    below 1 - top_p are removed, keeping at least the most likely one."""
    order = np.argsort(scores, axis=-1, kind="stable")
    ascending = np.take_along_axis(scores, order, axis=-1)
    cumulative = np.cumsum(_softmax(ascending), axis=-1)
    remove = cumulative <= np.float32(1 - top_p)
    remove[..., -1] = False
    removed = np.empty_like(remove)
    np.put_along_axis(removed, order, remove, axis=-1)
    return np.where(removed, -np.inf, scores)


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def draw(scores: np.ndarray, rng: np.random.Generator) -> int:
    """One token drawn from softmax(``scores``) [vocab] (float64 arithmetic, one uniform draw)."""
    probabilities = _softmax(scores.astype(np.float64))
    cumulative = np.cumsum(probabilities)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, len(cumulative) - 1)
