"""Evaluation during training: the eval loss, and accuracy when the labels are class ids."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from graphforge.distributed import World
from graphforge.errors import GraphforgeError
from graphforge.runtime import Module


def evaluate(
    module: Module,
    batches: Iterable[dict[str, np.ndarray]],
    *,
    output: str | None,
    labels: str | None,
    across: World | None = None,
):
    """Loss averaged over samples and, when ``output`` is set and the labels are integer class
    ids, the accuracy of ``argmax(output, axis=1)`` (labels < 0, the ignored ones, not counted).

    Runs the module in eval mode (dropout off, BatchNorm on its running statistics) and
    puts it back in the mode it was in; the training state is not touched. ``across``: each
    rank of a data-parallel run evaluated its share of the batches; the sums are added up
    over the ranks, so every rank gets the metrics of the whole data.
    """
    was_training = module.training
    module.eval()
    loss_sum, samples, correct, counted = 0.0, 0, 0, 0
    try:
        for batch in batches:
            count = len(next(iter(batch.values())))
            target = batch.get(labels) if labels is not None else None
            scored = output is not None and target is not None and np.issubdtype(target.dtype, np.integer)
            if scored:
                loss, predicted = module(**batch, outputs=[output])
                right, total = _hits(predicted, target, output)
                correct += right
                counted += total
            else:
                loss = module(**batch)
            loss_sum += float(loss) * count
            samples += count
    finally:
        module.train(was_training)
    if across is not None:
        total = across.sum([loss_sum, samples, correct, counted], "adding up the evaluation")
        loss_sum, samples, correct, counted = total[0], int(total[1]), int(total[2]), int(total[3])
    metrics = {"eval_loss": loss_sum / samples if samples else float("nan")}
    if counted:
        metrics["eval_accuracy"] = correct / counted
    return metrics


def _hits(predicted: np.ndarray, target: np.ndarray, output: str) -> tuple[int, int]:
    if predicted.ndim != target.ndim + 1 or predicted.shape[0] != target.shape[0]:
        raise GraphforgeError(
            f"accuracy needs {output!r} as scores [N, C, ...] for labels [N, ...]; it is {list(predicted.shape)} "
            f"for labels {list(target.shape)} (set eval.output to the logits output)"
        )
    valid = target >= 0
    return int(np.sum((np.argmax(predicted, axis=1) == target) & valid)), int(np.sum(valid))
