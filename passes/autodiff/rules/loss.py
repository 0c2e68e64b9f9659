"""Loss ops: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (opset 12+), and the
fused cross-entropy gradient the LogSoftmax rule uses when NLL reads its output."""

from __future__ import annotations

import numpy as np
from graphforge.passes.autodiff.registry import RULES

gradient = RULES.gradient


def _nll_positions(ctx, dy, like, labels, weight):
    """(indices, updates), both shaped [N, 1, d...]: d loss / d input of NLL is ``updates``
    at ``indices`` along the class axis and zero elsewhere.

    Each position i contributes -w_i * input[i, label_i] (w_i = weight[label_i], 0 where
    the label is ignore_index), divided by sum(w_i) for mean reduction."""
    ignore = ctx.attr("ignore_index")
    reduction = ctx.attr("reduction", "mean")
    if ignore is not None:
        keep = ~labels.op("Equal", ctx.const(np.array(ignore, dtype=np.int64)))
        safe = ctx.where(keep, labels, ctx.const(np.array(0, dtype=np.int64)))
    else:
        keep, safe = None, labels
    w = weight.op("Gather", safe) if weight is not None else ctx.ones_like(safe.cast_like(like))
    if keep is not None:
        w = w * keep.cast_like(like)
    # -w_i dy, over sum(w) for the mean (for sum dy is a scalar, for none it is shaped like the labels)
    per_position = w * (-dy / w.sum(keepdims=False)) if reduction == "mean" else w * -dy
    return safe.unsqueeze([1]), per_position.unsqueeze([1])


def _nll_input_grad(ctx, dy, like, labels, weight):
    indices, updates = _nll_positions(ctx, dy, like, labels, weight)
    return ctx.zeros_like(like).op("ScatterElements", indices, updates, axis=1)


def _scatter_add(data, indices, updates):
    """data with ``updates`` added at ``indices`` (axis 1, one index per row, so no duplicates).

    Gather, add, scatter rather than ScatterElements(reduction="add"): the same one pass over
    ``data`` (the gathered slice is [N, 1, d...]), from opset 11 on, and onnxruntime's CPU
    provider has no float16 scatter-add."""
    at = data.op("GatherElements", indices, axis=1) + updates
    return data.op("ScatterElements", indices, at, axis=1)


def _fused_grad(ctx, logp, positions, spread=None, spread_total=None):
    """d loss / d logits for logp = LogSoftmax(logits, axis=1) when d loss / d logp is the
    sparse ``positions`` (NLL's (indices, updates) pairs) plus ``spread`` ([N, 1, d...],
    the same for every class; ``spread_total`` its sum over the classes).

    LogSoftmax's rule dX = dY - exp(Y) * sum_c(dY) becomes, with S = sum_c(dY) computed
    from the small tensors, exp(Y) * -S + spread, then one scatter-add per NLL: three or
    four passes over the logits instead of six."""
    total = ctx.sum([u for _, u in positions] + ([spread_total] if spread_total is not None else []))
    grad = logp.exp() * -total
    if spread is not None:
        grad = grad + spread
    for indices, updates in positions:
        grad = _scatter_add(grad, indices, updates)
    return grad


def _class_axis_reduction(ctx, node, y) -> bool:
    """Whether ``node`` is a ReduceMean/ReduceSum of ``y`` over axis 1 alone."""
    if node.op not in ("ReduceMean", "ReduceSum") or node.inputs[0] is not y.tensor:
        return False
    other = ctx.for_node(node)
    axes = other.attr("axes")
    if axes is None:
        axes = other.const_value(1)
        if axes is None:
            return False
    r = len(y.shape)
    return [int(a) % r for a in np.asarray(axes).reshape(-1).tolist()] == [1]


def fused_log_softmax_grad(ctx):
    """The LogSoftmax rule's gradient when every reader of its output is an NLL on it, a
    ReduceMean/ReduceSum over the class axis (label smoothing), or a node no gradient left
    (an ArgMax); None when that does not hold (then the plain rule applies).

    It reads the readers' output gradients (ctx.output_grad) instead of the dense dY they
    built, which the graph cleanup then drops."""
    y, x = ctx.y(), ctx.x(0)
    if y is None or y.shape is None or x.shape is None or len(y.shape) < 2:
        return None
    r = len(y.shape)
    axis = ctx.attr("axis", -1 if ctx.opset >= 13 else 1) % r
    if axis != 1 or (ctx.opset < 13 and r != 2):
        return None
    positions, spreads, totals = [], [], []
    for reader in ctx.readers(y):
        dys = [ctx.output_grad(t) for t in reader.outputs]
        if all(dy is None for dy in dys):
            continue
        if sum(t is y.tensor for t in reader.inputs) != 1:
            return None
        if reader.op == "NegativeLogLikelihoodLoss" and reader.inputs[0] is y.tensor:
            nll = ctx.for_node(reader)
            positions.append(_nll_positions(nll, dys[0], y, nll.x(1), nll.x(2)))
        elif _class_axis_reduction(ctx, reader, y):
            g = dys[0] if ctx.for_node(reader).attr("keepdims", 1) else dys[0].unsqueeze([1])
            c = y.shape[1]
            classes = ctx.scalar(float(c), y) if isinstance(c, int) else ctx.shape(y, 1, 2).cast_like(y)
            if reader.op == "ReduceMean":
                spreads.append(g / classes)
                totals.append(g)
            else:
                spreads.append(g)
                totals.append(g * classes)
        else:
            return None
    if not positions:
        return None
    spread = ctx.sum(spreads) if spreads else None
    return _fused_grad(ctx, y, positions, spread, ctx.sum(totals) if totals else None)


_CLASS_WEIGHTS = {2: "class weights: torch gives them none (its derivative for weight is not implemented)"}


@gradient("NegativeLogLikelihoodLoss", since=12, settings=_CLASS_WEIGHTS)
def negative_log_likelihood_loss(ctx, dys):
    weight = ctx.x(2)
    return [_nll_input_grad(ctx, dys[0], ctx.x(0), ctx.x(1), weight), None, None][: len(ctx.node.inputs)]


@gradient("SoftmaxCrossEntropyLoss", since=12, settings=_CLASS_WEIGHTS)
def softmax_cross_entropy_loss(ctx, dys):
    # loss = NLL(LogSoftmax(scores, axis=1)); the optional second output is that log-prob
    scores = ctx.x(0)
    logp = ctx.y(1) if ctx.y(1) is not None else scores.op("LogSoftmax", axis=1)
    dlogp = dys[1] if len(dys) > 1 else None
    if dlogp is None:  # only the loss is differentiated: the fused form
        positions = [_nll_positions(ctx, dys[0], scores, ctx.x(1), ctx.x(2))]
        return [_fused_grad(ctx, logp, positions), None, None][: len(ctx.node.inputs)]
    if dys[0] is not None:
        dlogp = _nll_input_grad(ctx, dys[0], scores, ctx.x(1), ctx.x(2)) + dlogp
    total = dlogp.sum([1], keepdims=True)
    return [dlogp - logp.exp() * total, None, None][: len(ctx.node.inputs)]
