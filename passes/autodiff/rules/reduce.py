"""Reductions: the gradient of the reduced result is broadcast back over the reduced axes."""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES

gradient = RULES.gradient


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
    return ctx.b.unsqueeze(t, sorted(axes))


def _spread(ctx, dy):
    """The result's gradient broadcast to the input's shape."""
    return ctx.b.expand(_kept(ctx, dy), ctx.shape(ctx.x(0)))


def _rest(ctx):
    return [None] * (len(ctx.node.inputs) - 1)


def _count(ctx, like):
    """Elements reduced into each result element: size(x) / size(y)."""
    b, x, y = ctx.b, ctx.x(0), ctx.y()
    xs, ys = ctx.static_shape(x), ctx.static_shape(y)
    if xs is not None and ys is not None:
        n = 1
        for d in xs:
            n *= d
        for d in ys:
            n //= max(d, 1)
        return ctx.scalar(float(n), like)
    return b.div(b.cast_like(b.op("Size", x), like), b.cast_like(b.op("Size", y), like))


def _noop(ctx) -> bool:
    return _axes(ctx) == []


@gradient("ReduceSum")
def reduce_sum(ctx, dys):
    return [dys[0] if _noop(ctx) else _spread(ctx, dys[0]), *_rest(ctx)]


@gradient("ReduceMean")
def reduce_mean(ctx, dys):
    if _noop(ctx):
        return [dys[0], *_rest(ctx)]
    return [ctx.b.div(_spread(ctx, dys[0]), _count(ctx, dys[0])), *_rest(ctx)]


@gradient("ReduceSumSquare")
def reduce_sum_square(ctx, dys):
    b, x = ctx.b, ctx.x(0)
    return [b.mul(_spread(ctx, dys[0]), b.mul(x, ctx.scalar(2.0, x))), *_rest(ctx)]


@gradient("ReduceL1")
def reduce_l1(ctx, dys):
    return [ctx.b.mul(_spread(ctx, dys[0]), ctx.b.op("Sign", ctx.x(0))), *_rest(ctx)]


@gradient("ReduceL2")
def reduce_l2(ctx, dys):
    # x / ||x||, taken as 0 where the norm is 0 (torch's norm does the same)
    b, x = ctx.b, ctx.x(0)
    norm = _kept(ctx, ctx.y())
    zero = ctx.equal(norm, ctx.scalar(0.0, x))
    safe = b.op("Where", zero, ctx.scalar(1.0, x), norm)
    unit = b.op("Where", zero, ctx.scalar(0.0, x), b.div(x, safe))
    return [b.mul(_spread(ctx, dys[0]), unit), *_rest(ctx)]


@gradient("ReduceLogSumExp")
def reduce_log_sum_exp(ctx, dys):
    b, x = ctx.b, ctx.x(0)
    softmax = b.op("Exp", b.sub(x, _kept(ctx, ctx.y())))
    return [b.mul(_spread(ctx, dys[0]), softmax), *_rest(ctx)]


@gradient("ReduceLogSum")
def reduce_log_sum(ctx, dys):
    b = ctx.b
    total = b.op("Exp", ctx.y())
    return [_spread(ctx, b.div(dys[0], total)), *_rest(ctx)]


@gradient("ReduceProd")
def reduce_prod(ctx, dys):
    # dx_i = dy * (product of the others), exact with zeros (torch's prod too): with no zero in
    # the slice, prod / x_i; with one, the product of the non-zeros at the zero and 0 elsewhere; with more, 0
    b, x = ctx.b, ctx.x(0)
    if _noop(ctx):
        return [dys[0], *_rest(ctx)]
    zero, one = ctx.scalar(0.0, x), ctx.scalar(1.0, x)
    is_zero = ctx.equal(x, zero)
    nonzero = b.op("Where", is_zero, one, x)
    axes = _axes(ctx) if _axes(ctx) is not None else list(range(ctx.rank(x)))
    zeros = b.reduce_sum(b.cast_like(is_zero, x), axes, keepdims=True)
    others = b.axes_op("ReduceProd", nonzero, axes, keepdims=1)
    at_zero = b.op("Where", ctx.equal(zeros, one), others, zero)
    elsewhere = b.op("Where", ctx.equal(zeros, zero), b.div(others, nonzero), zero)
    return [b.mul(_spread(ctx, dys[0]), b.op("Where", is_zero, at_zero, elsewhere)), *_rest(ctx)]


def _reduce_extreme(ctx, dys):
    """ReduceMax/ReduceMin: the gradient is shared evenly by the elements equal to the
    result (torch.amax / amin do the same)."""
    b, x = ctx.b, ctx.x(0)
    hit = b.cast_like(ctx.equal(x, _kept(ctx, ctx.y())), x)
    axes = _axes(ctx)
    count = b.reduce_sum(hit, axes if axes is not None else list(range(ctx.rank(x))), keepdims=True)
    share = b.div(_kept(ctx, dys[0]), count)
    return [b.mul(hit, share), *_rest(ctx)]


gradient("ReduceMax")(_reduce_extreme)
gradient("ReduceMin")(_reduce_extreme)
