"""Temperature, top-k and top-p filtering held to transformers' logits warpers on the same
logits (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, applied in the order
transformers' generate applies them), and the choice drawn from what they keep."""

from __future__ import annotations

import numpy as np
import pytest

from graphforge.errors import GenerationError
from graphforge.generate import Sampling, filtered

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _warped(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.from_numpy(logits.copy())
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k is not None else []
    warpers += [TopPLogitsWarper(top_p)] if top_p is not None else []
    for warper in warpers:
        scores = warper(ids, scores)
    return scores.numpy()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, None, None), (1.0, 5, None), (1.0, None, 0.9), (0.5, 20, 0.6), (2.0, 200, 0.05), (1.0, 1, None)],
)
def test_filtering_is_transformers_warpers(temperature, top_k, top_p):
    """Six rows of 128 logits, the last with eight equal best: top-k keeps every tie, as
    transformers does; top-p keeps as many of them (which ones is the sort's choice among
    equals: torch's sort is not stable, ours is)."""
    logits = np.random.default_rng(0).normal(0, 3, size=(6, 128)).astype(np.float32)
    logits[5, :8] = logits[5].max() + 1.0
    ours = filtered(logits, temperature, top_k, top_p)
    theirs = _warped(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isneginf(ours[:5]), np.isneginf(theirs[:5]))
    kept = ~np.isneginf(theirs[:5])
    np.testing.assert_allclose(ours[:5][kept], theirs[:5][kept], rtol=1e-6)
    np.testing.assert_array_equal(np.isneginf(ours).sum(-1), np.isneginf(theirs).sum(-1))
    np.testing.assert_array_equal(np.isneginf(ours[5, 8:]), np.isneginf(theirs[5, 8:]))
    assert (~np.isneginf(ours)).sum(axis=-1).min() >= 1


def test_the_choice_is_drawn_from_the_kept_tokens_by_their_probabilities():
    """10,000 draws from 5 kept tokens land on each as often as softmax says (within 4 standard
    deviations), never on a removed one; greedy is the argmax."""
    logits = np.random.default_rng(1).normal(0, 1, size=64).astype(np.float32)
    sampling = Sampling(temperature=0.8, top_k=5, seed=7)
    rng = sampling.rng()
    counts = np.bincount([sampling.choose(logits, rng) for _ in range(10_000)], minlength=64)
    scores = _warped(logits[None], 0.8, 5, None)[0]
    expected = torch.softmax(torch.from_numpy(scores).double(), -1).numpy() * 10_000
    assert counts[np.isneginf(scores)].sum() == 0
    assert np.all(np.abs(counts - expected) <= 4 * np.sqrt(expected + 1))
    assert Sampling().choose(logits, rng) == int(np.argmax(logits)) == Sampling(temperature=0).choose(logits, rng)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temperature": -1.0}, "temperature must be a number ≥ 0"),
        ({"top_k": 0}, "top_k must be a whole number ≥ 1"),
        ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must lie in \(0, 1\]"),
        ({"temperature": 0.0, "top_k": 5}, "temperature 0 is greedy decoding"),
    ],
)
def test_settings_out_of_range_are_refused(settings, message):
    with pytest.raises(GenerationError, match=message):
        Sampling(**settings)
