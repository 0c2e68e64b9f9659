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
    b = ctx.b
    centered = b.sub(x, b.axes_op("ReduceMean", x, axes, keepdims=1))
    var = b.axes_op("ReduceMean", b.mul(centered, centered), axes, keepdims=1)
    rstd = b.op("Reciprocal", b.op("Sqrt", b.add(var, ctx.scalar(eps, x))))
    return b.mul(centered, rstd), rstd


def _standardize_grad(ctx, g, xhat, rstd, axes: list[int]):
    b = ctx.b
    mean_g = b.axes_op("ReduceMean", g, axes, keepdims=1)
    mean_gx = b.axes_op("ReduceMean", b.mul(g, xhat), axes, keepdims=1)
    return b.mul(rstd, b.sub(b.sub(g, mean_g), b.mul(xhat, mean_gx)))


def _per_channel(ctx, v):
    """A [C] vector shaped to broadcast against x's channel axis: [1, C, 1, ...]."""
    r = ctx.rank(ctx.x(0))
    return ctx.b.unsqueeze(v, [0, *range(2, r)])


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
    b, x, scale, dy = ctx.b, ctx.x(0), ctx.x(1), dys[0]
    axes = [0, *range(2, ctx.rank(x))]
    eps = ctx.attr("epsilon", 1e-5)
    gamma = _per_channel(ctx, scale)
    if _batch_norm_training(ctx):  # statistics of this batch
        xhat, rstd = _standardized(ctx, x, axes, eps)
        dx = _standardize_grad(ctx, b.mul(dy, gamma), xhat, rstd, axes)
    else:  # the given mean and variance are constants
        var = _per_channel(ctx, ctx.x(4))
        rstd = b.op("Reciprocal", b.op("Sqrt", b.add(var, ctx.scalar(eps, x))))
        xhat = b.mul(b.sub(x, _per_channel(ctx, ctx.x(3))), rstd)
        dx = b.mul(dy, b.mul(gamma, rstd))
    dscale = b.reduce_sum(b.mul(dy, xhat), axes, keepdims=False)
    return [dx, dscale, b.reduce_sum(dy, axes, keepdims=False), None, None]


@gradient("InstanceNormalization", since=6)
def instance_norm(ctx, dys):
    b, x, dy = ctx.b, ctx.x(0), dys[0]
    r = ctx.rank(x)
    xhat, rstd = _standardized(ctx, x, list(range(2, r)), ctx.attr("epsilon", 1e-5))
    dx = _standardize_grad(ctx, b.mul(dy, _per_channel(ctx, ctx.x(1))), xhat, rstd, list(range(2, r)))
    outer = [0, *range(2, r)]
    return [dx, b.reduce_sum(b.mul(dy, xhat), outer, keepdims=False), b.reduce_sum(dy, outer, keepdims=False)]


@gradient("GroupNormalization", since=21)
def group_norm(ctx, dys):
    # opset 21's per-channel scale and bias (GroupNormalization-18, per group, is deprecated:
    # the ONNX checker refuses it). Work on the view [N, G, C/G, -1].
    b, x, dy, groups = ctx.b, ctx.x(0), dys[0], ctx.attr("num_groups")
    per_group = b.div(b.shape(x, 1, 2), b.ints([groups]))
    view = b.op("Concat", b.shape(x, 0, 1), b.ints([groups]), per_group, b.ints([-1]), axis=0)
    xg, dyg = b.reshape(x, view), b.reshape(dy, view)
    xhat, rstd = _standardized(ctx, xg, [2, 3], ctx.attr("epsilon", 1e-5))
    g = b.mul(dyg, b.reshape(ctx.x(1), [1, groups, -1, 1]))
    dx = b.reshape_like(_standardize_grad(ctx, g, xhat, rstd, [2, 3]), x)
    dscale = b.reshape(b.reduce_sum(b.mul(dyg, xhat), [0, 3], keepdims=False), [-1])
    return [dx, dscale, b.reshape(b.reduce_sum(dyg, [0, 3], keepdims=False), [-1])]


@gradient("LpNormalization")
def lp_normalization(ctx, dys):
    # y = x / n with n = ||x||_p: dx = (dy - s * sum(dy * y)) / n, s = y for p=2, sign(x) for p=1
    b, x, y, dy = ctx.b, ctx.x(0), ctx.y(), dys[0]
    axis, p = ctx.attr("axis", -1), ctx.attr("p", 2)
    if p not in (1, 2):
        ctx.fail(f"LpNormalization with p={p} (only 1 and 2 are defined)")
    norm = b.axes_op("ReduceL2" if p == 2 else "ReduceL1", x, [axis], keepdims=1)
    total = b.reduce_sum(b.mul(dy, y), [axis], keepdims=True)
    s = y if p == 2 else b.op("Sign", x)
    return [b.div(b.sub(dy, b.mul(s, total)), norm)]


def _channel_window_sum(ctx, t, before: int, after: int):
    """Sum of t over the channel window [c - before, c + after]: a Conv with a ones kernel
    over t viewed as [N, 1, C, rest]."""
    b, x = ctx.b, ctx.x(0)
    view = b.op("Concat", b.shape(x, 0, 1), b.ints([1]), b.shape(x, 1, 2), b.ints([-1]), axis=0)
    dtype = x.dtype if x.dtype is not None else np.float32
    ones = b.constant(np.ones((1, 1, before + after + 1, 1), dtype=dtype))
    summed = b.op("Conv", b.reshape(t, view), ones, pads=[before, 0, after, 0])
    return b.reshape_like(summed, x)


@gradient("LRN")
def lrn(ctx, dys):
    # y = x * s^-beta, s = bias + alpha/size * window_sum(x^2):
    # dx = dy * s^-beta - 2 * alpha/size * beta * x * window_sum^T(dy * y / s)
    b, x, y, dy = ctx.b, ctx.x(0), ctx.y(), dys[0]
    size = ctx.attr("size")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    window = _channel_window_sum(ctx, b.mul(x, x), before, after)
    s = b.add(ctx.scalar(bias, x), b.mul(ctx.scalar(alpha / size, x), window))
    back = _channel_window_sum(ctx, b.div(b.mul(dy, y), s), after, before)  # the transposed window
    direct = b.mul(dy, b.op("Pow", s, ctx.scalar(-beta, x)))
    return [b.sub(direct, b.mul(ctx.scalar(2 * alpha * beta / size, x), b.mul(x, back)))]
