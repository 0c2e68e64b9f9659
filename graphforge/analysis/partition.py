"""Cutting a chain into contiguous stages so that the slowest stage is as fast as it can be.

``balanced_cuts(weights, stages, allowed)`` is the classic linear-partition dynamic
program: over the cut points ``allowed`` (positions between consecutive units), it finds
the stages - 1 cuts minimising the largest stage sum, exactly, in O(stages × cuts²). A
model becomes a chain by its topological order, and the positions where only one tensor
that depends on a parameter crosses are its cut points (between transformer blocks,
between CNN stages, between the layers of an MLP).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise

from graphforge.errors import GraphforgeError


def balanced_cuts(weights: Sequence[float], stages: int, allowed: Sequence[int] | None = None) -> list[int]:
    """The positions (0 < p < len(weights), units [p_k, p_{k+1}) forming stage k) of the
    ``stages`` - 1 cuts, taken from ``allowed`` (default: every position), that minimise the
    heaviest stage. Raises when there are fewer allowed positions than cuts needed."""
    n = len(weights)
    points = sorted({p for p in (range(1, n) if allowed is None else allowed) if 0 < p < n})
    if stages < 1:
        raise GraphforgeError(f"stages must be ≥ 1, got {stages}")
    if len(points) < stages - 1:
        raise GraphforgeError(
            f"{stages} stages need {stages - 1} cut points, but the model has only {len(points)} where one "
            "activation alone crosses; use fewer stages, or name the cuts"
        )
    prefix = [0.0, *accumulate(float(w) for w in weights)]
    ends = [*points, n]  # where a stage may end
    index = {p: i for i, p in enumerate(ends)}
    inf = float("inf")
    # best[k][j]: the heaviest stage when stages 0..k cover units [0, ends[j])
    best = [[inf] * len(ends) for _ in range(stages)]
    choice = [[-1] * len(ends) for _ in range(stages)]
    for j, end in enumerate(ends):
        best[0][j] = prefix[end]
    for k in range(1, stages):
        for j, end in enumerate(ends):
            for i in range(j):
                start = ends[i]
                value = max(best[k - 1][i], prefix[end] - prefix[start])
                if value < best[k][j]:
                    best[k][j], choice[k][j] = value, i
    cuts, j = [], index[n]
    for k in range(stages - 1, 0, -1):
        j = choice[k][j]
        cuts.append(ends[j])
    return sorted(cuts)


def stage_sums(weights: Sequence[float], cuts: Sequence[int]) -> list[float]:
    """The sum of each stage's units for ``cuts``."""
    bounds = [0, *cuts, len(weights)]
    return [float(sum(weights[a:b])) for a, b in pairwise(bounds)]
