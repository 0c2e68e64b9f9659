"""Less common math: Mod, Shrink, MeanVarianceNormalization, and Hardmax (no gradient)."""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES

gradient, nondifferentiable = RULES.gradient, RULES.nondifferentiable


@gradient("Mod", since=10, broadcast=True)
def mod(ctx, dys):
    # y = a - b * q with q = trunc(a / b) (fmod=1, C's fmod) or floor(a / b) (fmod=0, Python's %);
    # q is piecewise constant, so da = dy and db = -dy * q. Integer Mods carry no gradient.
    b, a, d, dy = ctx.b, ctx.x(0), ctx.x(1), dys[0]
    ratio = b.div(a, d)
    if ctx.attr("fmod", 0):
        negative = b.op("Less", ratio, ctx.scalar(0.0, a))
        q = b.op("Where", negative, b.op("Ceil", ratio), b.op("Floor", ratio))
    else:
        q = b.op("Floor", ratio)
    return [dy, b.neg(b.mul(dy, q))]


@gradient("Shrink", since=9)
def shrink(ctx, dys):
    # y = x -/+ bias outside [-lambd, lambd], 0 inside: slope 1 outside, 0 inside
    b, x = ctx.b, ctx.x(0)
    outside = b.op("Greater", b.op("Abs", x), ctx.scalar(ctx.attr("lambd", 0.5), x))
    return [b.op("Where", outside, dys[0], ctx.scalar(0.0, x))]


@gradient("MeanVarianceNormalization", since=9)
def mean_variance_normalization(ctx, dys):
    # ONNX's function body: y = c / (s + 1e-9), c = x - mean(x), s = sqrt(mean(c^2)) over `axes`.
    # With g = dy / (s + eps):  dx = g - mean(g) - c * mean(g * c) / ((s + eps) * s)
    b, x = ctx.b, ctx.x(0)
    r = ctx.rank(x)
    axes = sorted(a % r for a in ctx.attr("axes", [0, 2, 3]))

    def mean(t):
        return b.axes_op("ReduceMean", t, axes, keepdims=1)

    c = b.sub(x, mean(x))
    s = b.op("Sqrt", mean(b.mul(c, c)))
    denom = b.add(s, ctx.scalar(1e-9, x))
    g = b.div(dys[0], denom)
    correction = b.div(b.mul(c, mean(b.mul(g, c))), b.mul(denom, s))
    return [b.sub(b.sub(g, mean(g)), correction)]


# a one-hot of the argmax: zero derivative almost everywhere
nondifferentiable("Hardmax")
