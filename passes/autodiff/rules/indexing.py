"""Indexing and rearranging ops: scatters, TopK, Compress, ReverseSequence, Tile, Trilu, CumSum, CumProd.

Each is linear in its float inputs, so each gradient is the matching "transpose" op:
a scatter's gradient gathers, a selection's gradient scatters back, a reversal reverses
again, a tiling sums its copies, a running sum runs the other way.
"""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES
from graphforge.passes.autodiff.rules.shape import _flat_positions, _scatter_flat

gradient, nondifferentiable = RULES.gradient, RULES.nondifferentiable


def _reduction(ctx) -> str:
    """Scatter reduction: none or add are differentiated; mul/max/min would need the
    overwritten values, which the forward node does not keep."""
    reduction = ctx.attr("reduction", "none")
    if reduction not in ("none", "add"):
        ctx.fail(f"{ctx.node.op} with reduction={reduction!r} is not differentiable (only none and add are)")
    return reduction


@gradient("ScatterElements", since=11)
def scatter_elements(ctx, dys):
    # y = data with updates written at indices (added, for reduction=add).
    # d updates: dy read back at the same places; d data: dy, minus the overwritten places.
    b, indices, updates, dy = ctx.b, ctx.x(1), ctx.x(2), dys[0]
    axis = ctx.attr("axis", 0)
    dupdates = b.op("GatherElements", dy, indices, axis=axis)
    if _reduction(ctx) == "add":
        return [dy, None, dupdates]
    return [b.op("ScatterElements", dy, indices, b.zeros_like(updates), axis=axis), None, dupdates]


@gradient("ScatterND", since=11)
def scatter_nd(ctx, dys):
    b, indices, updates, dy = ctx.b, ctx.x(1), ctx.x(2), dys[0]
    dupdates = b.op("GatherND", dy, indices)
    if _reduction(ctx) == "add":
        return [dy, None, dupdates]
    return [b.op("ScatterND", dy, indices, b.zeros_like(updates)), None, dupdates]


@gradient("TopK", since=11)
def top_k(ctx, dys):
    # the values' gradient goes back to where they were taken from (indices are distinct)
    b, x = ctx.b, ctx.x(0)
    indices = ctx.ensure_output(1, "topk_indices")
    dx = b.op("ScatterElements", b.zeros_like(x), indices, dys[0], axis=ctx.attr("axis", -1))
    return [dx, None]


@gradient("Compress", since=11)
def compress(ctx, dys):
    # compress the tensor of flat positions the same way: where each result element came from
    b, x = ctx.b, ctx.x(0)
    positions, _ = _flat_positions(ctx, x)
    axis = ctx.attr("axis")
    picked = b.op("Compress", positions, ctx.x(1), **({} if axis is None else {"axis": axis}))
    return [_scatter_flat(ctx, x, picked, dys[0], accumulate=False), None]


@gradient("ReverseSequence", since=10)
def reverse_sequence(ctx, dys):
    # reversing the same prefixes again is the inverse permutation
    attrs = {"batch_axis": ctx.attr("batch_axis", 1), "time_axis": ctx.attr("time_axis", 0)}
    return [ctx.b.op("ReverseSequence", dys[0], ctx.x(1), **attrs), None]


@gradient("Tile", since=6)
def tile(ctx, dys):
    # view dy as [r0, d0, r1, d1, ...] (copy index, then the input's index) and sum the copies
    b, x, repeats = ctx.b, ctx.x(0), ctx.x(1)
    r = ctx.rank(x)
    reps = ctx.const_value(1)
    static = ctx.static_shape(x)
    if reps is not None and static is not None:
        shape = b.ints([n for i in range(r) for n in (int(reps[i]), static[i])])
    else:
        pieces = []
        for i in range(r):
            rep = b.ints([int(reps[i])]) if reps is not None else b.op("Slice", repeats, b.ints([i]), b.ints([i + 1]))
            pieces += [rep, b.shape(x, i, i + 1)]
        shape = b.op("Concat", *pieces, axis=0)
    return [b.reduce_sum(b.reshape(dys[0], shape), [2 * i for i in range(r)], keepdims=False), None]


@gradient("Trilu", since=14)
def trilu(ctx, dys):
    # a fixed mask: the gradient is masked the same way
    return [ctx.b.op("Trilu", dys[0], *ctx.node.inputs[1:], upper=ctx.attr("upper", 1)), None]


@gradient("CumSum", since=11)
def cum_sum(ctx, dys):
    # x_i feeds every y_j with j >= i (j > i when exclusive): a sum running the other way
    reverse = 0 if ctx.attr("reverse", 0) else 1
    dx = ctx.b.op("CumSum", dys[0], ctx.x(1), exclusive=ctx.attr("exclusive", 0), reverse=reverse)
    return [dx, None]


@gradient("CumProd", since=26)
def cum_prod(ctx, dys):
    # exact with zeros (torch's cumprod too): where no zero precedes x_i, dx_i = sum_{j >= i} dy_j y_j / x_i;
    # at the first zero, that sum over the running product with the zero taken as 1; after it, 0
    b, x, axis, dy = ctx.b, ctx.x(0), ctx.x(1), dys[0]
    forward = {"exclusive": ctx.attr("exclusive", 0), "reverse": ctx.attr("reverse", 0)}
    back = {"exclusive": forward["exclusive"], "reverse": 1 - forward["reverse"]}
    zero, one = ctx.scalar(0.0, x), ctx.scalar(1.0, x)
    is_zero = ctx.equal(x, zero)
    clear = ctx.equal(b.op("CumSum", b.cast_like(is_zero, x), axis, exclusive=1, reverse=forward["reverse"]), zero)
    first_zero_as_one = b.op("Where", b.op("And", is_zero, clear), one, x)
    before = b.div(b.op("CumSum", b.mul(dy, ctx.y()), axis, **back), b.op("Where", is_zero, one, x))
    at = b.op("CumSum", b.mul(dy, b.op("CumProd", first_zero_as_one, axis, **forward)), axis, **back)
    return [b.op("Where", clear, b.op("Where", is_zero, at, before), zero), None]


# box selection returns integer indices
nondifferentiable("NonMaxSuppression", since=10)
