"""Loss ops: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (opset 12+)."""

from __future__ import annotations

import numpy as np
from graphforge.passes.autodiff.registry import RULES

gradient = RULES.gradient


def _nll_input_grad(ctx, dy, shape_of, labels, weight):
    """d loss / d input for NLL over an input shaped like ``shape_of`` ([N, C, d...]).

    Each position i contributes -w_i * input[i, label_i] (w_i = weight[label_i], 0 where
    the label is ignore_index), divided by sum(w_i) for mean reduction."""
    b = ctx.b
    ignore = ctx.attr("ignore_index")
    reduction = ctx.attr("reduction", "mean")
    like = shape_of
    if ignore is not None:
        keep = b.op("Not", b.op("Equal", labels, b.constant(np.array(ignore, dtype=np.int64))))
        safe = b.op("Where", keep, labels, b.constant(np.array(0, dtype=np.int64)))
    else:
        keep, safe = None, labels
    w = b.op("Gather", weight, safe) if weight is not None else b.ones_like(b.cast_like(safe, like))
    if keep is not None:
        w = b.mul(w, b.cast_like(keep, like))
    if reduction == "mean":
        coeff = b.div(b.neg(dy), b.axes_op("ReduceSum", w, None, keepdims=0))
        per_position = b.mul(w, coeff)
    elif reduction == "sum":
        per_position = b.mul(w, b.neg(dy))
    else:  # none: dy has the labels' shape
        per_position = b.mul(w, b.neg(dy))
    zeros = b.zeros_like(shape_of)
    return b.op("ScatterElements", zeros, b.unsqueeze(safe, [1]), b.unsqueeze(per_position, [1]), axis=1)


@gradient("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(ctx, dys):
    weight = ctx.x(2)
    return [_nll_input_grad(ctx, dys[0], ctx.x(0), ctx.x(1), weight), None, None][: len(ctx.node.inputs)]


@gradient("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(ctx, dys):
    # loss = NLL(LogSoftmax(scores, axis=1)); the optional second output is that log-prob
    b, scores = ctx.b, ctx.x(0)
    logp = ctx.y(1) if ctx.y(1) is not None else b.op("LogSoftmax", scores, axis=1)
    dlogp = None
    if dys[0] is not None:
        dlogp = _nll_input_grad(ctx, dys[0], scores, ctx.x(1), ctx.x(2))
    if len(dys) > 1 and dys[1] is not None:
        dlogp = dys[1] if dlogp is None else b.add(dlogp, dys[1])
    total = b.reduce_sum(dlogp, [1], keepdims=True)
    dscores = b.sub(dlogp, b.mul(b.op("Exp", logp), total))
    return [dscores, None, None][: len(ctx.node.inputs)]
