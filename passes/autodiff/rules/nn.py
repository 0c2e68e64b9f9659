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
    dx = _through_statistics(ctx, dx, dys, centered, rstd, mean)
    outer = list(range(axis))
    dscale = ctx.unbroadcast(b.reduce_sum(b.mul(dy, xhat), outer, keepdims=False), ctx.x(0).shape[axis:], scale)
    dbias = (
        None if bias is None else ctx.unbroadcast(b.reduce_sum(dy, outer, keepdims=False), ctx.x(0).shape[axis:], bias)
    )
    return [dx, dscale, dbias]


def _through_statistics(ctx, dx, dys, centered, rstd, mean):
    """dx with what reaches the optional outputs Mean and InvStdDev (torch's layer_norm returns
    them undifferentiated; here a loss may read them): over the N normalized elements,
    d mean / dx = 1 / N and d rstd / dx = -rstd^3 (x - mean) / N."""
    b = ctx.b
    d_mean = dys[1] if len(dys) > 1 else None
    d_rstd = dys[2] if len(dys) > 2 else None
    if d_mean is None and d_rstd is None:
        return dx
    n = b.cast_like(b.div(b.op("Size", ctx.x(0)), b.op("Size", mean)), dx)
    if d_mean is not None:
        dx = b.add(dx, b.div(b.cast_like(d_mean, dx), n))
    if d_rstd is not None:
        cubed = b.mul(b.mul(rstd, rstd), rstd)
        dx = b.sub(dx, b.div(b.mul(b.mul(b.cast_like(d_rstd, dx), cubed), centered), n))
    return dx
