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
    y, dy = ctx.y(), dys[0]
    return [y * (dy - (dy * y).sum([_softmax_axis(ctx)], keepdims=True))]


@gradient("LogSoftmax")
def log_softmax(ctx, dys):
    # dx = dy - softmax * sum(dy, axis); under an NLL loss, a fused form (rules/loss.py)
    fused = fused_log_softmax_grad(ctx)
    if fused is not None:
        return [fused]
    y, dy = ctx.y(), dys[0]
    total = dy.sum([_softmax_axis(ctx)], keepdims=True)
    return [dy - y.exp() * total]


@gradient("LayerNormalization", since=17)
def layer_norm(ctx, dys):
    # y = (x - mean) * rstd * scale + bias over the axes from `axis` on.
    # With xhat = (x - mean) * rstd and g = dy * scale:
    #   dx = rstd * (g - mean(g) - xhat * mean(g * xhat));  dscale = sum(dy * xhat);  dbias = sum(dy)
    x, scale, bias, dy = ctx.x(0), ctx.x(1), ctx.x(2), dys[0]
    r = ctx.rank(x)
    axis = ctx.attr("axis", -1) % r
    norm_axes = list(range(axis, r))
    mean = x.mean(norm_axes, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(norm_axes, keepdims=True)
    rstd = (var + ctx.attr("epsilon", 1e-5)).sqrt().reciprocal()
    xhat = centered * rstd
    g = dy * scale
    mean_g = g.mean(norm_axes, keepdims=True)
    mean_gx = (g * xhat).mean(norm_axes, keepdims=True)
    dx = rstd * (g - mean_g - xhat * mean_gx)
    dx = _through_statistics(ctx, dx, dys, centered, rstd, mean)
    outer, shape = list(range(axis)), x.shape[axis:]
    dscale = ctx.unbroadcast((dy * xhat).sum(outer), shape, scale)
    dbias = None if bias is None else ctx.unbroadcast(dy.sum(outer), shape, bias)
    return [dx, dscale, dbias]


def _through_statistics(ctx, dx, dys, centered, rstd, mean):
    """dx with what reaches the optional outputs Mean and InvStdDev (torch's layer_norm returns
    them undifferentiated; here a loss may read them): over the N normalized elements,
    d mean / dx = 1 / N and d rstd / dx = -rstd^3 (x - mean) / N."""
    d_mean = dys[1] if len(dys) > 1 else None
    d_rstd = dys[2] if len(dys) > 2 else None
    if d_mean is None and d_rstd is None:
        return dx
    n = (ctx.x(0).op("Size") / mean.op("Size")).cast_like(dx)
    if d_mean is not None:
        dx = dx + d_mean.cast_like(dx) / n
    if d_rstd is not None:
        cubed = rstd * rstd * rstd
        dx = dx - d_rstd.cast_like(dx) * cubed * centered / n
    return dx
