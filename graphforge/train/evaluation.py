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
    classes_across=None,
):
    """Loss averaged over samples and, when ``output`` is set and the labels are integer class
    ids, the accuracy of the argmax of ``output`` over its classes (axis 1, or the last where the
    loss pass read them there) (labels < 0, the ignored ones, not counted).

    Runs the module in eval mode (dropout off, BatchNorm on its running statistics) and
    puts it back in the mode it was in; the training state is not touched. ``across``: each
    rank of a data-parallel run evaluated its share of the batches; the sums are added up
    over the ranks, so every rank gets the metrics of the whole data. ``classes_across``: a
    tensor group (graphforge.distributed.TensorParallel) whose members each hold a slice of
    ``output``'s classes (an LM head split along the vocabulary): the argmax is the group's.
    """
    was_training = module.training
    module.eval()
    axis = module.roles.class_axis
    loss_sum, samples, correct, counted = 0.0, 0, 0, 0
    try:
        for batch in batches:
            count = len(next(iter(batch.values())))
            target = batch.get(labels) if labels is not None else None
            scored = output is not None and target is not None and np.issubdtype(target.dtype, np.integer)
            if scored:
                loss, predicted = module(**batch, outputs=[output])
                chosen = _argmax_across(predicted, classes_across, axis) if classes_across is not None else None
                right, total = _hits(predicted, target, output, axis, chosen)
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


def _hits(predicted: np.ndarray, target: np.ndarray, output: str, axis: int, chosen=None) -> tuple[int, int]:
    others = np.delete(np.array(predicted.shape), axis)
    if predicted.ndim != target.ndim + 1 or tuple(others) != target.shape:
        scores = "[N, C, ...]" if axis == 1 else "[N, ..., C]"
        raise GraphforgeError(
            f"accuracy needs {output!r} as scores {scores} for labels [N, ...]; it is {list(predicted.shape)} "
            f"for labels {list(target.shape)} (set eval.output to the logits output)"
        )
    valid = target >= 0
    chosen = np.argmax(predicted, axis=axis) if chosen is None else chosen
    return int(np.sum((chosen == target) & valid)), int(np.sum(valid))


def _argmax_across(scores: np.ndarray, group, axis: int = 1) -> np.ndarray:
    """The class of the highest score along ``axis``, which the members of ``group`` split in
    rank order: each member's best and where, the group's best of those (on a tie the lower
    rank's, as argmax over the whole takes the first)."""
    mine = (scores.max(axis=axis), scores.argmax(axis=axis), scores.shape[axis])
    gathered = group.gather(mine, "the evaluation's argmax across the tensor group")
    offsets = np.cumsum([0, *(count for _, _, count in gathered)])[:-1]
    bests = np.stack([best for best, _, _ in gathered])
    wheres = np.stack([where + offset for (_, where, _), offset in zip(gathered, offsets, strict=True)])
    return np.take_along_axis(wheres, np.argmax(bests, axis=0)[None], axis=0)[0]
