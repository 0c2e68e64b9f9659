"""Data movement: reshapes, transposes, concatenation, splitting, slicing, gathering.

Ops that pick elements (Slice, Gather*) are differentiated by scattering the gradient
back: ScatterElements/ScatterND with ``reduction="add"`` (opset 16+) where an element may
be picked more than once, and a one-hot MatMul for Gather below opset 16.
"""

from __future__ import annotations

import numpy as np
from graphforge.passes.autodiff.registry import RULES

gradient = RULES.gradient


def _like_input(ctx, dy):
    """dy reshaped to the first input's shape: the whole rule for view-like ops."""
    return [ctx.b.reshape_like(dy[0], ctx.x(0)), *[None] * (len(ctx.node.inputs) - 1)]


for _op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
    gradient(_op)(_like_input)


@gradient("Transpose")
def transpose(ctx, dys):
    perm = ctx.attr("perm") or list(reversed(range(ctx.rank(ctx.x(0)))))
    return [ctx.b.transpose(dys[0], list(np.argsort(perm)))]


@gradient("Expand")
def expand(ctx, dys):
    return [ctx.unbroadcast(dys[0], ctx.y().shape, ctx.x(0)), None]


def _dim(ctx, t, axis: int):
    """Size of ``t`` along ``axis`` as a 1-element int64 tensor (a constant when static)."""
    return ctx.b.shape(t, axis, axis + 1 if axis != -1 else None)


def _split(ctx, t, sizes, axis: int, count: int):
    b = ctx.b
    if ctx.opset >= 13:
        return b.op("Split", t, sizes, axis=axis, outputs=count)
    static = sizes.values.tolist() if hasattr(sizes, "values") else None
    if static is None:
        ctx.fail("Split before opset 13 needs static sizes")
    return b.op("Split", t, axis=axis, split=static, outputs=count)


@gradient("Concat")
def concat(ctx, dys):
    axis = ctx.attr("axis")
    if axis < 0:
        axis += ctx.rank(ctx.y())
    inputs = ctx.node.inputs
    static = [ctx.static_shape(x) for x in inputs]
    if all(s is not None for s in static):
        sizes = ctx.b.ints([s[axis] for s in static])
    else:
        sizes = ctx.b.op("Concat", *[_dim(ctx, x, axis) for x in inputs], axis=0)
    parts = _split(ctx, dys[0], sizes, axis, len(inputs))
    return parts if len(inputs) > 1 else [parts]


@gradient("Split")
def split(ctx, dys):
    axis = ctx.attr("axis", 0)
    parts = [ctx.dy_or_zeros(dys, i) for i in range(len(ctx.node.outputs))]
    return [ctx.b.op("Concat", *parts, axis=axis), *[None] * (len(ctx.node.inputs) - 1)]


def _flat_positions(ctx, x):
    """An int64 tensor shaped like ``x`` holding each element's flat position."""
    b = ctx.b
    size = (
        b.reshape(b.op("Size", x), [1]) if ctx.static_shape(x) is None else b.ints([int(np.prod(ctx.static_shape(x)))])
    )
    count = b.squeeze(size, [0])
    positions = b.op("Range", b.constant(np.array(0, np.int64)), count, b.constant(np.array(1, np.int64)))
    return b.reshape_like(positions, x), size


def _scatter_flat(ctx, x, positions, dy, accumulate: bool):
    """A tensor shaped like ``x``: zeros, plus dy added at the given flat positions."""
    b = ctx.b
    zeros = b.reshape(b.zeros_like(x), [-1])
    attrs = {"reduction": "add"} if accumulate else {}
    flat = b.op("ScatterElements", zeros, b.reshape(positions, [-1]), b.reshape(dy, [-1]), axis=0, **attrs)
    return b.reshape_like(flat, x)


@gradient("Slice")
def slice_(ctx, dys):
    # Slice the tensor of flat positions the same way: that says where each result element
    # came from, whatever the starts, ends, steps and clamping; no element is picked twice.
    if ctx.opset < 11:  # no Range or ScatterElements yet: pad the gradient back instead
        return [_pad_back(ctx, dys[0]), *[None] * (len(ctx.node.inputs) - 1)]
    positions, _ = _flat_positions(ctx, ctx.x(0))
    picked = ctx.b.op("Slice", positions, *ctx.node.inputs[1:])
    return [_scatter_flat(ctx, ctx.x(0), picked, dys[0], accumulate=False), *[None] * (len(ctx.node.inputs) - 1)]


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
    return ctx.b.op("Pad", dy, pads=pads)  # an attribute before opset 11


@gradient("Gather")
def gather(ctx, dys):
    b, data, indices, dy = ctx.b, ctx.x(0), ctx.x(1), dys[0]
    axis = ctx.attr("axis", 0)
    r = ctx.rank(data)
    axis = axis + r if axis < 0 else axis
    if ctx.opset < 16:
        return [_gather_one_hot(ctx, data, indices, dy, axis), None]
    # updates: dy with the index dims flattened into one; indices: broadcast along the rest
    head = [b.shape(data, 0, axis)] if axis else []
    tail = [b.shape(data, axis + 1)] if axis + 1 < r else []
    updates_shape = b.op("Concat", *head, b.ints([-1]), *tail, axis=0)
    updates = b.reshape(dy, updates_shape)
    flat_idx = b.reshape(indices, [1] * axis + [-1] + [1] * (r - axis - 1))
    idx = b.expand(flat_idx, b.op("Shape", updates))
    dx = b.op("ScatterElements", b.zeros_like(data), idx, updates, axis=axis, reduction="add")
    return [dx, None]


def _gather_one_hot(ctx, data, indices, dy, axis: int):
    """Below opset 16 there is no scatter-add: dx = onehot(indices)^T @ dy, on axis 0."""
    b = ctx.b
    if axis != 0:
        ctx.fail("Gather gradients before opset 16 are supported on axis 0 only")
    values = b.constant(np.array([0, 1], dtype=data.dtype if data.dtype is not None else np.float32))
    one_hot = b.op("OneHot", b.reshape(indices, [-1]), b.shape(data, 0, 1), values, axis=-1)  # [n, V]
    rows = b.op("Flatten", b.reshape(dy, b.op("Concat", b.ints([-1]), b.shape(data, 1), axis=0)), axis=1)
    dx = b.matmul(b.transpose(one_hot, [1, 0]), rows)
    return b.reshape_like(dx, data)


@gradient("GatherElements", since=11)
def gather_elements(ctx, dys):
    b = ctx.b
    if ctx.opset < 16:
        ctx.fail("GatherElements gradients need opset 16+ (ScatterElements with reduction=add)")
    dx = b.op("ScatterElements", b.zeros_like(ctx.x(0)), ctx.x(1), dys[0], axis=ctx.attr("axis", 0), reduction="add")
    return [dx, None]


@gradient("GatherND", since=11)
def gather_nd(ctx, dys):
    b = ctx.b
    if ctx.attr("batch_dims", 0):
        ctx.fail("GatherND with batch_dims > 0 is not differentiable yet")
    if ctx.opset < 16:
        ctx.fail("GatherND gradients need opset 16+ (ScatterND with reduction=add)")
    return [b.op("ScatterND", b.zeros_like(ctx.x(0)), ctx.x(1), dys[0], reduction="add"), None]


# ----------------------------------------------------------------------------- sequences from a split
#
# The dynamo exporter writes torch.split as SplitToSequence + SequenceAt. The gradient of the
# sequence is carried as one tensor shaped like the split input: each SequenceAt puts its
# part's gradient at that part's place (zeros elsewhere), the driver sums the parts, and
# SplitToSequence passes the sum on.


@gradient("SplitToSequence", since=11)
def split_to_sequence(ctx, dys):
    return [dys[0], None]


@gradient("SequenceAt", since=11)
def sequence_at(ctx, dys):
    b, dy = ctx.b, dys[0]
    split = ctx.x(0).inputs[0] if ctx.x(0).inputs else None
    position = ctx.const_value(1)
    if split is None or split.op != "SplitToSequence" or position is None:
        ctx.fail("SequenceAt is differentiable on a SplitToSequence's result at a constant position only")
    split_ctx = ctx.for_node(split)
    x, sizes, axis = split.inputs[0], split_ctx.const_value(1), split.attrs.get("axis", 0)
    r = split_ctx.rank(x)
    axis, p = axis % r, int(position.reshape(-1)[0])
    if sizes is None and split_ctx.x(1) is not None:
        ctx.fail("SequenceAt after a SplitToSequence with computed split sizes is not differentiable")
    if sizes is None or sizes.ndim == 0:  # equal parts of `sizes` (1 when absent), the last one shorter
        if p < 0:
            ctx.fail("SequenceAt counting from the end of an equal split is not differentiable")
        start = p * (1 if sizes is None else int(sizes))
        if sizes is None and not split.attrs.get("keepdims", 1):
            dy = b.unsqueeze(dy, [axis])
    else:
        start = int(np.sum(sizes.reshape(-1)[: p % sizes.size]))
    end = b.add(b.ints([start]), b.shape(dy, axis, axis + 1))
    before = b.zeros_like(b.op("Slice", x, b.ints([0]), b.ints([start]), b.ints([axis])))
    after = b.zeros_like(b.op("Slice", x, end, b.ints([2**62]), b.ints([axis])))
    return [b.op("Concat", before, dy, after, axis=axis), None]
