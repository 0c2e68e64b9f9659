"""Reductions: the gradient of the reduced result is broadcast back over the reduced axes."""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES

gradient, linear = RULES.gradient, RULES.linear


def _axes(ctx) -> list[int] | None:
    """Reduced axes (non-negative), or None for all axes; [] means nothing is reduced."""
    axes = ctx.axes(1)
    if axes is not None and len(axes) == 0:
        return [] if ctx.attr("noop_with_empty_axes", 0) else None
    return axes


def _kept(ctx, t):
    """``t`` (shaped like the result) with the reduced axes put back as size 1."""
    axes = _axes(ctx)
    if ctx.attr("keepdims", 1) or axes is None:
        return t  # kept already, or a full reduction whose result broadcasts as it is
    return t.unsqueeze(sorted(axes))


def _spread(ctx, dy):
    """The result's gradient broadcast to the input's shape."""
    return _kept(ctx, dy).expand(ctx.shape(ctx.x(0)))


def _rest(ctx):
    return [None] * (len(ctx.node.inputs) - 1)


def _count(ctx, like):
    """Elements reduced into each result element: size(x) / size(y)."""
    x, y = ctx.x(0), ctx.y()
    xs, ys = ctx.static_shape(x), ctx.static_shape(y)
    if xs is not None and ys is not None:
        n = 1
        for d in xs:
            n *= d
        for d in ys:
            n //= max(d, 1)
        return ctx.scalar(float(n), like)
    return x.op("Size").cast_like(like) / y.op("Size").cast_like(like)


def _noop(ctx) -> bool:
    return _axes(ctx) == []


linear("ReduceSum")(lambda ctx, dy: dy if _noop(ctx) else _spread(ctx, dy))
linear("ReduceMean")(lambda ctx, dy: dy if _noop(ctx) else _spread(ctx, dy) / _count(ctx, dy))


@gradient("ReduceSumSquare")
def reduce_sum_square(ctx, dys):
    x = ctx.x(0)
    return [_spread(ctx, dys[0]) * (x * 2), *_rest(ctx)]


@gradient("ReduceL1")
def reduce_l1(ctx, dys):
    return [_spread(ctx, dys[0]) * ctx.x(0).sign(), *_rest(ctx)]


@gradient("ReduceL2")
def reduce_l2(ctx, dys):
    # x / ||x||, taken as 0 where the norm is 0 (torch's norm does the same)
    x = ctx.x(0)
    norm = _kept(ctx, ctx.y())
    zero = ctx.equal(norm, ctx.scalar(0.0, x))
    safe = ctx.where(zero, ctx.scalar(1.0, x), norm)
    unit = ctx.where(zero, ctx.scalar(0.0, x), x / safe)
    return [_spread(ctx, dys[0]) * unit, *_rest(ctx)]


@gradient("ReduceLogSumExp")
def reduce_log_sum_exp(ctx, dys):
    softmax = (ctx.x(0) - _kept(ctx, ctx.y())).exp()
    return [_spread(ctx, dys[0]) * softmax, *_rest(ctx)]


@gradient("ReduceLogSum")
def reduce_log_sum(ctx, dys):
    return [_spread(ctx, dys[0] / ctx.y().exp()), *_rest(ctx)]


@gradient("ReduceProd")
def reduce_prod(ctx, dys):
    # dx_i = dy * (product of the others), exact with zeros (torch's prod too): with no zero in
    # the slice, prod / x_i; with one, the product of the non-zeros at the zero and 0 elsewhere; with more, 0
    x = ctx.x(0)
    if _noop(ctx):
        return [dys[0], *_rest(ctx)]
    zero, one = ctx.scalar(0.0, x), ctx.scalar(1.0, x)
    is_zero = ctx.equal(x, zero)
    nonzero = ctx.where(is_zero, one, x)
    axes = _axes(ctx) if _axes(ctx) is not None else list(range(ctx.rank(x)))
    zeros = is_zero.cast_like(x).sum(axes, keepdims=True)
    others = nonzero.reduce("ReduceProd", axes, keepdims=True)
    at_zero = ctx.where(ctx.equal(zeros, one), others, zero)
    elsewhere = ctx.where(ctx.equal(zeros, zero), others / nonzero, zero)
    return [_spread(ctx, dys[0]) * ctx.where(is_zero, at_zero, elsewhere), *_rest(ctx)]


def _reduce_extreme(ctx, dys):
    """ReduceMax/ReduceMin: the gradient is shared evenly by the elements equal to the
    result (torch.amax / amin do the same)."""
    x = ctx.x(0)
    hit = ctx.equal(x, _kept(ctx, ctx.y())).cast_like(x)
    axes = _axes(ctx)
    count = hit.sum(axes if axes is not None else list(range(ctx.rank(x))), keepdims=True)
    return [hit * (_kept(ctx, dys[0]) / count), *_rest(ctx)]


gradient("ReduceMax")(_reduce_extreme)
gradient("ReduceMin")(_reduce_extreme)
