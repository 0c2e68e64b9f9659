"""Less common math: Mod, Shrink, MeanVarianceNormalization, and Hardmax (no gradient)."""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES

gradient, nondifferentiable = RULES.gradient, RULES.nondifferentiable


@gradient("Mod", since=10, broadcast=True)
def mod(ctx, dys):
    # y = a - b * q with q = trunc(a / b) (fmod=1, C's fmod) or floor(a / b) (fmod=0, Python's %);
    # q is piecewise constant, so da = dy and db = -dy * q. Integer Mods carry no gradient.
    a, dy = ctx.x(0), dys[0]
    ratio = a / ctx.x(1)
    q = ctx.where(ratio < 0, ratio.op("Ceil"), ratio.op("Floor")) if ctx.attr("fmod", 0) else ratio.op("Floor")
    return [dy, -(dy * q)]


@gradient("Shrink", since=9)
def shrink(ctx, dys):
    # y = x -/+ bias outside [-lambd, lambd], 0 inside: slope 1 outside, 0 inside
    x = ctx.x(0)
    return [ctx.where(x.abs() > ctx.attr("lambd", 0.5), dys[0], ctx.scalar(0.0, x))]


@gradient("MeanVarianceNormalization", since=9)
def mean_variance_normalization(ctx, dys):
    # ONNX's function body: y = c / (s + 1e-9), c = x - mean(x), s = sqrt(mean(c^2)) over `axes`.
    # With g = dy / (s + eps):  dx = g - mean(g) - c * mean(g * c) / ((s + eps) * s)
    x = ctx.x(0)
    r = ctx.rank(x)
    axes = sorted(a % r for a in ctx.attr("axes", [0, 2, 3]))
    c = x - x.mean(axes, keepdims=True)
    s = (c * c).mean(axes, keepdims=True).sqrt()
    denom = s + 1e-9
    g = dys[0] / denom
    correction = c * (g * c).mean(axes, keepdims=True) / (denom * s)
    return [g - g.mean(axes, keepdims=True) - correction]


# a one-hot of the argmax: zero derivative almost everywhere
nondifferentiable("Hardmax")
