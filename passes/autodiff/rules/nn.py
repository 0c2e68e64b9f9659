"""Neural-network ops: softmax family and normalizations."""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES
from graphforge.passes.autodiff.rules.loss import fused_log_softmax_grad

gradient = RULES.gradient


def _softmax_axis(ctx) -> int:
    # opset 13 made softmax act on one axis (default -1); before, it flattened from `axis` (default 1)
    if ctx.opset >= 13:
        return ctx.attr("axis", -1)
    axis = ctx.attr("axis", 1)
    r = ctx.rank(ctx.x(0))
    if (axis % r) != r - 1:
        ctx.fail("Softmax before opset 13 over more than the last axis is not differentiable yet")
    return -1


@gradient("Softmax")
def softmax(ctx, dys):
    # dx = y * (dy - sum(dy * y, axis))
    b, y, dy = ctx.b, ctx.y(), dys[0]
    axis = _softmax_axis(ctx)
    inner = b.reduce_sum(b.mul(dy, y), [axis], keepdims=True)
    return [b.mul(y, b.sub(dy, inner))]


@gradient("LogSoftmax")
def log_softmax(ctx, dys):
    # dx = dy - softmax * sum(dy, axis); under an NLL loss, a fused form (rules/loss.py)
    fused = fused_log_softmax_grad(ctx)
    if fused is not None:
        return [fused]
    b, y, dy = ctx.b, ctx.y(), dys[0]
    axis = _softmax_axis(ctx)
    total = b.reduce_sum(dy, [axis], keepdims=True)
    return [b.sub(dy, b.mul(b.op("Exp", y), total))]


@gradient("LayerNormalization", since=17)
def layer_norm(ctx, dys):
    # y = (x - mean) * rstd * scale + bias over the axes from `axis` on.
    # With xhat = (x - mean) * rstd and g = dy * scale:
    #   dx = rstd * (g - mean(g) - xhat * mean(g * xhat));  dscale = sum(dy * xhat);  dbias = sum(dy)
    b, x, scale, bias, dy = ctx.b, ctx.x(0), ctx.x(1), ctx.x(2), dys[0]
    r = ctx.rank(x)
    axis = ctx.attr("axis", -1) % r
    eps = ctx.attr("epsilon", 1e-5)
    norm_axes = list(range(axis, r))
    mean = b.axes_op("ReduceMean", x, norm_axes, keepdims=1)
    centered = b.sub(x, mean)
    var = b.axes_op("ReduceMean", b.mul(centered, centered), norm_axes, keepdims=1)
    rstd = b.op("Reciprocal", b.op("Sqrt", b.add(var, ctx.scalar(eps, x))))
    xhat = b.mul(centered, rstd)
    g = b.mul(dy, scale)
    mean_g = b.axes_op("ReduceMean", g, norm_axes, keepdims=1)
    mean_gx = b.axes_op("ReduceMean", b.mul(g, xhat), norm_axes, keepdims=1)
    dx = b.mul(rstd, b.sub(b.sub(g, mean_g), b.mul(xhat, mean_gx)))
    outer = list(range(axis))
    dscale = ctx.unbroadcast(b.reduce_sum(b.mul(dy, xhat), outer, keepdims=False), ctx.x(0).shape[axis:], scale)
    dbias = (
        None if bias is None else ctx.unbroadcast(b.reduce_sum(dy, outer, keepdims=False), ctx.x(0).shape[axis:], bias)
    )
    return [dx, dscale, dbias]
