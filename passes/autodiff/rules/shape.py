"""Data movement: reshapes, transposes, concatenation, splitting, slicing, gathering.

Ops that pick elements (Slice, Gather*) are differentiated by scattering the gradient
back: ScatterElements/ScatterND with ``reduction="add"`` (opset 16+) where an element may
be picked more than once, and a one-hot MatMul for Gather below opset 16.
"""

from __future__ import annotations

import numpy as np
from graphforge.passes.autodiff.registry import RULES
from graphforge.passes.autodiff.values import raw

linear = RULES.linear

# view-like ops: dy in the input's shape
for _op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
    linear(_op)(lambda ctx, dy: dy.reshape_like(ctx.x(0)))


@linear("Transpose")
def transpose(ctx, dy):
    perm = ctx.attr("perm") or list(reversed(range(ctx.rank(ctx.x(0)))))
    return dy.transpose(np.argsort(perm))


linear("Expand")(lambda ctx, dy: ctx.unbroadcast(dy, ctx.y().shape, ctx.x(0)))


def _dim(ctx, t, axis: int):
    """Size of ``t`` along ``axis`` as a 1-element int64 tensor (a constant when static)."""
    return ctx.shape(t, axis, axis + 1 if axis != -1 else None)


def _split(ctx, t, sizes, axis: int, count: int):
    if ctx.opset >= 13:
        return ctx.op("Split", t, sizes, axis=axis, outputs=count)
    static = raw(sizes).values.tolist() if hasattr(raw(sizes), "values") else None
    if static is None:
        ctx.fail("Split before opset 13 needs static sizes")
    return ctx.op("Split", t, axis=axis, split=static, outputs=count)


@linear("Concat")
def concat(ctx, dy):
    axis = ctx.attr("axis")
    if axis < 0:
        axis += ctx.rank(ctx.y())
    inputs = ctx.node.inputs
    static = [ctx.static_shape(x) for x in inputs]
    if all(s is not None for s in static):
        sizes = ctx.ints([s[axis] for s in static])
    else:
        sizes = ctx.concat([_dim(ctx, x, axis) for x in inputs], axis=0)
    return _split(ctx, dy, sizes, axis, len(inputs))


@linear("Split")
def split(ctx, *dys):
    return ctx.concat([ctx.dy_or_zeros(dys, i) for i in range(len(ctx.node.outputs))], axis=ctx.attr("axis", 0))


def _flat_positions(ctx, x):
    """An int64 tensor shaped like ``x`` holding each element's flat position."""
    static = ctx.static_shape(x)
    size = x.op("Size").reshape([1]) if static is None else ctx.ints([int(np.prod(static))])
    count = size.squeeze([0])
    positions = ctx.op("Range", ctx.const(np.array(0, np.int64)), count, ctx.const(np.array(1, np.int64)))
    return positions.reshape_like(x), size


def _scatter_flat(ctx, x, positions, dy, accumulate: bool):
    """A tensor shaped like ``x``: zeros, plus dy added at the given flat positions."""
    zeros = ctx.zeros_like(x).reshape([-1])
    attrs = {"reduction": "add"} if accumulate else {}
    flat = zeros.op("ScatterElements", positions.reshape([-1]), dy.reshape([-1]), axis=0, **attrs)
    return flat.reshape_like(x)


@linear("Slice")
def slice_(ctx, dy):
    # Slice the tensor of flat positions the same way: that says where each result element
    # came from, whatever the starts, ends, steps and clamping; no element is picked twice.
    if ctx.opset < 11:  # no Range or ScatterElements yet: pad the gradient back instead
        return _pad_back(ctx, dy)
    positions, _ = _flat_positions(ctx, ctx.x(0))
    picked = positions.op("Slice", *ctx.node.inputs[1:])
    return _scatter_flat(ctx, ctx.x(0), picked, dy, accumulate=False)


def _pad_back(ctx, dy):
    """A Slice's gradient as zero padding: needs constant starts/ends/axes, unit steps and
    static dims on the sliced axes (attributes before opset 10, inputs at 10)."""
    x = ctx.x(0)
    if ctx.opset < 10:
        starts, ends, axes, steps = ctx.attr("starts"), ctx.attr("ends"), ctx.attr("axes"), None
    else:
        starts, ends, axes, steps = (ctx.const_value(i) for i in (1, 2, 3, 4))
    if starts is None or ends is None or (steps is not None and np.any(np.asarray(steps) != 1)):
        ctx.fail(
            f"Slice at opset {ctx.opset} is differentiable with constant bounds and unit steps only (any from opset 11+)"
        )
    r = ctx.rank(x)
    starts, ends = np.asarray(starts).reshape(-1).tolist(), np.asarray(ends).reshape(-1).tolist()
    axes = range(len(starts)) if axes is None else np.asarray(axes).reshape(-1).tolist()
    pads = [0] * (2 * r)
    for start, end, axis in zip(starts, ends, axes, strict=True):
        axis, dim = axis % r, x.shape[axis % r]
        if not isinstance(dim, int | np.integer):
            ctx.fail(f"Slice at opset {ctx.opset} is differentiable on static dims only (any from opset 11+)")
        start, end = (min(max(v + dim if v < 0 else v, 0), dim) for v in (start, end))
        pads[axis], pads[axis + r] = start, dim - max(end, start)
    return dy.op("Pad", pads=pads)  # an attribute before opset 11


@linear("Gather")
def gather(ctx, dy):
    data, indices = ctx.x(0), ctx.x(1)
    axis = ctx.attr("axis", 0)
    r = ctx.rank(data)
    axis = axis + r if axis < 0 else axis
    if ctx.opset < 16:
        return _gather_one_hot(ctx, data, indices, dy, axis)
    # updates: dy with the index dims flattened into one; indices: broadcast along the rest
    head = [ctx.shape(data, 0, axis)] if axis else []
    tail = [ctx.shape(data, axis + 1)] if axis + 1 < r else []
    updates = dy.reshape(ctx.concat([*head, ctx.ints([-1]), *tail], axis=0))
    positions = indices.reshape([1] * axis + [-1] + [1] * (r - axis - 1)).expand(updates.op("Shape"))
    return ctx.zeros_like(data).op("ScatterElements", positions, updates, axis=axis, reduction="add")


def _gather_one_hot(ctx, data, indices, dy, axis: int):
    """Below opset 16 there is no scatter-add: dx = onehot(indices)^T @ dy, on axis 0."""
    if axis != 0:
        ctx.fail("Gather gradients before opset 16 are supported on axis 0 only")
    values = ctx.const(np.array([0, 1], dtype=data.dtype if data.dtype is not None else np.float32))
    one_hot = ctx.op("OneHot", indices.reshape([-1]), ctx.shape(data, 0, 1), values, axis=-1)  # [n, V]
    rows = dy.reshape(ctx.concat([ctx.ints([-1]), ctx.shape(data, 1)], axis=0)).flatten(1)
    return (one_hot.transpose([1, 0]) @ rows).reshape_like(data)


@linear("GatherElements", since=11)
def gather_elements(ctx, dy):
    if ctx.opset < 16:
        ctx.fail("GatherElements gradients need opset 16+ (ScatterElements with reduction=add)")
    return ctx.zeros_like(ctx.x(0)).op("ScatterElements", ctx.x(1), dy, axis=ctx.attr("axis", 0), reduction="add")


@linear("GatherND", since=11)
def gather_nd(ctx, dy):
    if ctx.attr("batch_dims", 0):
        ctx.fail("GatherND with batch_dims > 0 is not differentiable yet")
    if ctx.opset < 16:
        ctx.fail("GatherND gradients need opset 16+ (ScatterND with reduction=add)")
    return ctx.zeros_like(ctx.x(0)).op("ScatterND", ctx.x(1), dy, reduction="add")


# ----------------------------------------------------------------------------- sequences from a split
#
# The dynamo exporter writes torch.split as SplitToSequence + SequenceAt. The gradient of the
# sequence is carried as one tensor shaped like the split input: each SequenceAt puts its
# part's gradient at that part's place (zeros elsewhere), the driver sums the parts, and
# SplitToSequence passes the sum on.

linear("SplitToSequence", since=11)(lambda ctx, dy: dy)


@linear("SequenceAt", since=11)
def sequence_at(ctx, dy):
    sequence = ctx.node.inputs[0]
    split = sequence.inputs[0] if sequence.inputs else None
    position = ctx.const_value(1)
    if split is None or split.op != "SplitToSequence" or position is None:
        ctx.fail("SequenceAt is differentiable on a SplitToSequence's result at a constant position only")
    split_ctx = ctx.for_node(split)
    x, sizes, axis = split_ctx.x(0), split_ctx.const_value(1), split.attrs.get("axis", 0)
    r = split_ctx.rank(x)
    axis, p = axis % r, int(position.reshape(-1)[0])
    if sizes is None and split_ctx.x(1) is not None:
        ctx.fail("SequenceAt after a SplitToSequence with computed split sizes is not differentiable")
    if sizes is None or sizes.ndim == 0:  # equal parts of `sizes` (1 when absent), the last one shorter
        if p < 0:
            ctx.fail("SequenceAt counting from the end of an equal split is not differentiable")
        start = p * (1 if sizes is None else int(sizes))
        if sizes is None and not split.attrs.get("keepdims", 1):
            dy = dy.unsqueeze([axis])
    else:
        start = int(np.sum(sizes.reshape(-1)[: p % sizes.size]))
    end = ctx.ints([start]) + ctx.shape(dy, axis, axis + 1)
    before = ctx.zeros_like(x.op("Slice", ctx.ints([0]), ctx.ints([start]), ctx.ints([axis])))
    after = ctx.zeros_like(x.op("Slice", end, ctx.ints([2**62]), ctx.ints([axis])))
    return ctx.concat([before, dy, after], axis=axis)
