"""Indexing and rearranging ops: scatters, TopK, Compress, ReverseSequence, Tile, Trilu, CumSum, CumProd.

Each is linear in its float inputs, so each gradient is the matching "transpose" op:
a scatter's gradient gathers, a selection's gradient scatters back, a reversal reverses
again, a tiling sums its copies, a running sum runs the other way.
"""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES
from graphforge.passes.autodiff.rules.shape import _flat_positions, _scatter_flat

gradient, linear, nondifferentiable = RULES.gradient, RULES.linear, RULES.nondifferentiable


def _reduction(ctx) -> str:
    """Scatter reduction: none or add are differentiated; mul/max/min would need the
    overwritten values, which the forward node does not keep."""
    reduction = ctx.attr("reduction", "none")
    if reduction not in ("none", "add"):
        ctx.fail(f"{ctx.node.op} with reduction={reduction!r} is not differentiable (only none and add are)")
    return reduction


@linear("ScatterElements", since=11)
def scatter_elements(ctx, dy):
    # y = data with updates written at indices (added, for reduction=add): linear in data and
    # updates together. d updates: dy read back at the same places; d data: dy, minus the
    # overwritten places.
    indices, axis = ctx.x(1), ctx.attr("axis", 0)
    dupdates = dy.op("GatherElements", indices, axis=axis)
    if _reduction(ctx) == "add":
        return [dy, None, dupdates]
    return [dy.op("ScatterElements", indices, ctx.zeros_like(ctx.x(2)), axis=axis), None, dupdates]


@linear("ScatterND", since=11)
def scatter_nd(ctx, dy):
    indices = ctx.x(1)
    dupdates = dy.op("GatherND", indices)
    if _reduction(ctx) == "add":
        return [dy, None, dupdates]
    return [dy.op("ScatterND", indices, ctx.zeros_like(ctx.x(2))), None, dupdates]


@gradient("TopK", since=11)
def top_k(ctx, dys):
    # the values' gradient goes back to where they were taken from (indices are distinct)
    indices = ctx.ensure_output(1, "topk_indices")
    return [ctx.zeros_like(ctx.x(0)).op("ScatterElements", indices, dys[0], axis=ctx.attr("axis", -1)), None]


@linear("Compress", since=11)
def compress(ctx, dy):
    # compress the tensor of flat positions the same way: where each result element came from
    x = ctx.x(0)
    positions, _ = _flat_positions(ctx, x)
    axis = ctx.attr("axis")
    picked = positions.op("Compress", ctx.x(1), **({} if axis is None else {"axis": axis}))
    return _scatter_flat(ctx, x, picked, dy, accumulate=False)


@linear("ReverseSequence", since=10)
def reverse_sequence(ctx, dy):
    # reversing the same prefixes again is the inverse permutation
    attrs = {"batch_axis": ctx.attr("batch_axis", 1), "time_axis": ctx.attr("time_axis", 0)}
    return dy.op("ReverseSequence", ctx.x(1), **attrs)


@linear("Tile", since=6)
def tile(ctx, dy):
    # view dy as [r0, d0, r1, d1, ...] (copy index, then the input's index) and sum the copies
    x, repeats = ctx.x(0), ctx.x(1)
    r = ctx.rank(x)
    reps = ctx.const_value(1)
    static = ctx.static_shape(x)
    if reps is not None and static is not None:
        shape = ctx.ints([n for i in range(r) for n in (int(reps[i]), static[i])])
    else:
        pieces = []
        for i in range(r):
            rep = (
                ctx.ints([int(reps[i])]) if reps is not None else repeats.op("Slice", ctx.ints([i]), ctx.ints([i + 1]))
            )
            pieces += [rep, ctx.shape(x, i, i + 1)]
        shape = ctx.concat(pieces, axis=0)
    return dy.reshape(shape).sum([2 * i for i in range(r)])


# a fixed mask: the gradient is masked the same way
linear("Trilu", since=14)(lambda ctx, dy: dy.op("Trilu", *ctx.node.inputs[1:], upper=ctx.attr("upper", 1)))


@linear("CumSum", since=11)
def cum_sum(ctx, dy):
    # x_i feeds every y_j with j >= i (j > i when exclusive): a sum running the other way
    reverse = 0 if ctx.attr("reverse", 0) else 1
    return dy.op("CumSum", ctx.x(1), exclusive=ctx.attr("exclusive", 0), reverse=reverse)


@gradient("CumProd", since=26)
def cum_prod(ctx, dys):
    # exact with zeros (torch's cumprod too): where no zero precedes x_i, dx_i = sum_{j >= i} dy_j y_j / x_i;
    # at the first zero, that sum over the running product with the zero taken as 1; after it, 0
    x, axis, dy = ctx.x(0), ctx.x(1), dys[0]
    forward = {"exclusive": ctx.attr("exclusive", 0), "reverse": ctx.attr("reverse", 0)}
    back = {"exclusive": forward["exclusive"], "reverse": 1 - forward["reverse"]}
    zero, one = ctx.scalar(0.0, x), ctx.scalar(1.0, x)
    is_zero = ctx.equal(x, zero)
    clear = ctx.equal(is_zero.cast_like(x).op("CumSum", axis, exclusive=1, reverse=forward["reverse"]), zero)
    first_zero_as_one = ctx.where(is_zero & clear, one, x)
    before = (dy * ctx.y()).op("CumSum", axis, **back) / ctx.where(is_zero, one, x)
    at = (dy * first_zero_as_one.op("CumProd", axis, **forward)).op("CumSum", axis, **back)
    return [ctx.where(clear, ctx.where(is_zero, at, before), zero), None]


# box selection returns integer indices
nondifferentiable("NonMaxSuppression", since=10)
