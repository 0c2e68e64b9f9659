"""Normalizations of convolutional nets: batch, instance, group, Lp and local response.

Batch (training mode), instance and group normalization all standardize x over some
axes with statistics taken from x itself, then scale and shift per channel. With
xhat = (x - mean) * rstd and g = dy * scale, their shared input gradient is
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))    (means over the normalized axes).
"""

from __future__ import annotations

import numpy as np
from graphforge.passes.autodiff.registry import RULES

gradient = RULES.gradient


def _standardized(ctx, x, axes: list[int], eps: float):
    """(xhat, rstd) of x over ``axes``, recomputed from x with the population variance."""
    centered = x - x.mean(axes, keepdims=True)
    rstd = ((centered * centered).mean(axes, keepdims=True) + eps).sqrt().reciprocal()
    return centered * rstd, rstd


def _standardize_grad(g, xhat, rstd, axes: list[int]):
    mean_g, mean_gx = g.mean(axes, keepdims=True), (g * xhat).mean(axes, keepdims=True)
    return rstd * (g - mean_g - xhat * mean_gx)


def _per_channel(ctx, v):
    """A [C] vector shaped to broadcast against x's channel axis: [1, C, 1, ...]."""
    return v.unsqueeze([0, *range(2, ctx.rank(ctx.x(0)))])


def _batch_norm_training(ctx) -> bool:
    # opset 14+ says so in training_mode; before, asking for the batch statistics did
    if ctx.opset >= 14:
        return bool(ctx.attr("training_mode", 0))
    return any(ctx.y(i) is not None for i in range(1, len(ctx.node.outputs)))


@gradient(
    "BatchNormalization",
    since=9,
    settings={
        3: "the running mean: a buffer, which torch does not train",
        4: "the running variance: a buffer, which torch does not train",
    },
    detached={
        1: "the running mean it updates: a buffer update, outside autograd in torch",
        2: "the running variance it updates: a buffer update, outside autograd in torch",
        3: "the saved mean (opsets 9-13): what torch saves for the backward pass",
        4: "the saved variance (opsets 9-13): what torch saves for the backward pass",
    },
)
def batch_norm(ctx, dys):
    # running statistics (outputs 1, 2) are not differentiated; input_mean/var get no gradient
    x, dy = ctx.x(0), dys[0]
    axes = [0, *range(2, ctx.rank(x))]
    eps = ctx.attr("epsilon", 1e-5)
    gamma = _per_channel(ctx, ctx.x(1))
    if _batch_norm_training(ctx):  # statistics of this batch
        xhat, rstd = _standardized(ctx, x, axes, eps)
        dx = _standardize_grad(dy * gamma, xhat, rstd, axes)
    else:  # the given mean and variance are constants
        rstd = (_per_channel(ctx, ctx.x(4)) + eps).sqrt().reciprocal()
        xhat = (x - _per_channel(ctx, ctx.x(3))) * rstd
        dx = dy * (gamma * rstd)
    return [dx, (dy * xhat).sum(axes), dy.sum(axes), None, None]


@gradient("InstanceNormalization", since=6)
def instance_norm(ctx, dys):
    x, dy = ctx.x(0), dys[0]
    r = ctx.rank(x)
    xhat, rstd = _standardized(ctx, x, list(range(2, r)), ctx.attr("epsilon", 1e-5))
    dx = _standardize_grad(dy * _per_channel(ctx, ctx.x(1)), xhat, rstd, list(range(2, r)))
    outer = [0, *range(2, r)]
    return [dx, (dy * xhat).sum(outer), dy.sum(outer)]


@gradient("GroupNormalization", since=21)
def group_norm(ctx, dys):
    # opset 21's per-channel scale and bias (GroupNormalization-18, per group, is deprecated:
    # the ONNX checker refuses it). Work on the view [N, G, C/G, -1].
    x, dy, groups = ctx.x(0), dys[0], ctx.attr("num_groups")
    per_group = ctx.shape(x, 1, 2) / ctx.ints([groups])
    view = ctx.concat([ctx.shape(x, 0, 1), ctx.ints([groups]), per_group, ctx.ints([-1])], axis=0)
    xg, dyg = x.reshape(view), dy.reshape(view)
    xhat, rstd = _standardized(ctx, xg, [2, 3], ctx.attr("epsilon", 1e-5))
    g = dyg * ctx.x(1).reshape([1, groups, -1, 1])
    dx = _standardize_grad(g, xhat, rstd, [2, 3]).reshape_like(x)
    dscale = (dyg * xhat).sum([0, 3]).reshape([-1])
    return [dx, dscale, dyg.sum([0, 3]).reshape([-1])]


@gradient("LpNormalization")
def lp_normalization(ctx, dys):
    # y = x / n with n = ||x||_p: dx = (dy - s * sum(dy * y)) / n, s = y for p=2, sign(x) for p=1
    x, y, dy = ctx.x(0), ctx.y(), dys[0]
    axis, p = ctx.attr("axis", -1), ctx.attr("p", 2)
    if p not in (1, 2):
        ctx.fail(f"LpNormalization with p={p} (only 1 and 2 are defined)")
    norm = x.reduce("ReduceL2" if p == 2 else "ReduceL1", [axis], keepdims=True)
    total = (dy * y).sum([axis], keepdims=True)
    s = y if p == 2 else x.sign()
    return [(dy - s * total) / norm]


def _channel_window_sum(ctx, t, before: int, after: int):
    """Sum of t over the channel window [c - before, c + after]: a Conv with a ones kernel
    over t viewed as [N, 1, C, rest]."""
    x = ctx.x(0)
    view = ctx.concat([ctx.shape(x, 0, 1), ctx.ints([1]), ctx.shape(x, 1, 2), ctx.ints([-1])], axis=0)
    ones = ctx.const(np.ones((1, 1, before + after + 1, 1), dtype=x.dtype if x.dtype is not None else np.float32))
    return t.reshape(view).op("Conv", ones, pads=[before, 0, after, 0]).reshape_like(x)


@gradient("LRN")
def lrn(ctx, dys):
    # y = x * s^-beta, s = bias + alpha/size * window_sum(x^2):
    # dx = dy * s^-beta - 2 * alpha/size * beta * x * window_sum^T(dy * y / s)
    x, y, dy = ctx.x(0), ctx.y(), dys[0]
    size = ctx.attr("size")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    s = bias + (alpha / size) * _channel_window_sum(ctx, x * x, before, after)
    back = _channel_window_sum(ctx, dy * y / s, after, before)  # the transposed window
    direct = dy * s.op("Pow", ctx.scalar(-beta, x))
    return [direct - (2 * alpha * beta / size) * (x * back)]
