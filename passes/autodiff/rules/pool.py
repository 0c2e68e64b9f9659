"""Pooling and resampling.

MaxPool routes each output's gradient to the element its Indices output names (added to
the forward node when the model did not ask for it). AveragePool and Resize are linear
and separable: each acts on every spatial axis by a fixed matrix, which the rule gets by
applying the same op, restricted to that axis, to an identity matrix (one basis vector
per batch row); dX is dY contracted with those matrices. That reproduces every attribute
(pads, ceil_mode, count_include_pad, coordinate modes, cubic coefficients, antialias)
exactly as the forward kernel computes it, at the cost of a MatMul per axis.
"""

from __future__ import annotations

import numpy as np
from graphforge.passes.autodiff.registry import RULES
from onnx.numpy_helper import from_array

gradient, linear = RULES.gradient, RULES.linear


def _spatial_axes(ctx) -> list[int]:
    return list(range(2, ctx.rank(ctx.x(0))))


# ---------------------------------------------------------------- separable linear maps


def _basis(ctx, x, axis: int, middle: int):
    """The identity of size x.shape[axis], shaped [L, 1 (x middle), L]: row j is basis vector j.
    Made at run time by EyeLike, so big static dims do not put big constants in the model."""
    dtype = x.dtype if x.dtype is not None else np.float32
    if ctx.opset < 9:  # no EyeLike yet: a constant, which needs the dim to be static
        dim = x.shape[axis] if x.shape is not None else None
        if not isinstance(dim, int | np.integer):
            ctx.fail(f"this gradient needs opset 9+ (EyeLike) when axis {axis} is symbolic")
        return ctx.const(np.eye(int(dim), dtype=dtype).reshape(int(dim), *[1] * middle, int(dim)))
    length = ctx.shape(x, axis, axis + 1)
    zeros = ctx.concat([length, length], axis=0).op("ConstantOfShape", value=from_array(np.zeros(1, dtype)))
    return zeros.op("EyeLike").unsqueeze(list(range(1, middle + 1)))


def _per_axis_adjoint(ctx, dy, axes: list[int], matrix):
    """dX of a map acting on each of ``axes`` by a matrix: ``matrix(axis)`` is [X_axis, Y_axis]
    (row j: what input element j contributes to each output), so dX = dY @ matrix^T per axis."""
    r, g = ctx.rank(ctx.x(0)), dy
    for axis in axes:
        to_last = [a for a in range(r) if a != axis] + [axis]
        moved = g.transpose(to_last) if axis != r - 1 else g
        contracted = moved @ matrix(axis).transpose([1, 0])
        g = contracted.transpose(np.argsort(to_last)) if axis != r - 1 else contracted
    return g


def _one_axis(ctx, i: int, n: int) -> dict:
    """The node's pooling attributes restricted to spatial axis i of n."""
    attrs = dict(ctx.node.attrs)
    for name in ("kernel_shape", "strides", "dilations"):
        if name in attrs:
            attrs[name] = [attrs[name][i]]
    if "pads" in attrs:
        attrs["pads"] = [attrs["pads"][i], attrs["pads"][i + n]]
    return attrs


@linear("AveragePool")
def average_pool(ctx, dy):
    x, axes = ctx.x(0), _spatial_axes(ctx)

    def matrix(axis):  # a 1-D AveragePool over the basis: [L, 1, L] -> [L, 1, Y] -> [L, Y]
        pooled = _basis(ctx, x, axis, 1).op("AveragePool", **_one_axis(ctx, axis - 2, len(axes)))
        return pooled.flatten(1)

    return _per_axis_adjoint(ctx, dy, axes, matrix)


@linear("GlobalAveragePool")
def global_average_pool(ctx, dy):
    x = ctx.x(0)
    xs = ctx.static_shape(x)
    if xs is not None:
        count = ctx.scalar(float(np.prod(xs[2:])), x)
    else:  # elements per (batch, channel): size(X) / size(Y)
        count = x.op("Size").cast_like(x) / ctx.y().op("Size").cast_like(x)
    return dy.expand(ctx.shape(x)) / count


@gradient("GlobalMaxPool")
def global_max_pool(ctx, dys):
    # shared evenly by the elements equal to the maximum, as ReduceMax's rule does
    x = ctx.x(0)
    hit = ctx.equal(x, ctx.y()).cast_like(x)
    return [hit * (dys[0] / hit.sum(_spatial_axes(ctx), keepdims=True))]


# ---------------------------------------------------------------- MaxPool


def _row_major(ctx, idx):
    """storage_order=1 Indices count the spatial position column-major: recount it row-major."""
    dims = [ctx.shape(ctx.x(0), a, a + 1) for a in _spatial_axes(ctx)]
    size = dims[0]
    for d in dims[1:]:
        size = size * d
    position = rest = idx.op("Mod", size)  # within the (batch, channel) plane
    coords = []
    for d in dims:  # the first spatial axis varies fastest
        coords.append(rest.op("Mod", d))
        rest = rest / d
    row = coords[0]
    for c, d in zip(coords[1:], dims[1:], strict=True):
        row = row * d + c
    return idx - position + row


def _overlapping(ctx) -> bool:
    kernel, n = ctx.attr("kernel_shape"), len(ctx.attr("kernel_shape"))
    strides, dilations = ctx.attr("strides") or [1] * n, ctx.attr("dilations") or [1] * n
    return any(s < (k - 1) * d + 1 for k, s, d in zip(kernel, strides, dilations, strict=True))


@gradient("MaxPool", since=8)
def max_pool(ctx, dys):
    # Indices are flat positions in X (batch and channel included, pads not counted)
    x = ctx.x(0)
    add = _overlapping(ctx)
    if add and ctx.opset < 16:
        ctx.fail("MaxPool with overlapping windows needs opset 16+ (ScatterElements with reduction=add)")
    if ctx.opset < 11:
        ctx.fail("MaxPool gradients need opset 11+ (ScatterElements)")
    idx = ctx.ensure_output(1, "indices")
    if ctx.attr("storage_order", 0):
        idx = _row_major(ctx, idx)
    flat = ctx.zeros_like(x).reshape([-1])
    attrs = {"reduction": "add"} if add else {}
    dx = flat.op("ScatterElements", idx.reshape([-1]), dys[0].reshape([-1]), axis=0, **attrs)
    return [dx.reshape_like(x)]


# ---------------------------------------------------------------- Resize


def _resize_inputs(ctx):
    """(roi, scales, sizes) of the node, whatever its opset (Resize-10 has scales only)."""
    if ctx.opset < 11:
        return None, ctx.x(1), None
    return ctx.x(1), ctx.x(2), ctx.x(3)


def _resized_axes(ctx) -> list[tuple[int, int]]:
    """(axis, position in scales/sizes) for every axis that may change: an axis whose scale
    is a constant 1, or whose size is known to stay, maps by the identity (except for
    tf_crop_and_resize, whose roi moves even an unscaled axis)."""
    x, y, r = ctx.x(0), ctx.y(), ctx.rank(ctx.x(0))
    listed = [a % r for a in ctx.attr("axes")] if ctx.attr("axes") else list(range(r))
    crop = ctx.attr("coordinate_transformation_mode") == "tf_crop_and_resize"
    by_scales = _uses_scales(ctx, _resize_inputs(ctx)[1])
    scales = ctx.const_value(2 if ctx.opset >= 11 else 1) if by_scales else None
    kept = []
    for j, axis in enumerate(listed):
        if not crop and scales is not None and float(scales.reshape(-1)[j]) == 1.0:
            continue
        same = x.shape is not None and y.shape is not None and x.shape[axis] == y.shape[axis]
        if not crop and not by_scales and same and x.shape[axis] not in (None, ""):
            continue
        kept.append((axis, j))
    return kept


def _axis_roi(ctx, j: int, count: int):
    """The roi input of a one-axis Resize: entry j of the node's roi on the last axis (only
    tf_crop_and_resize reads it), an empty tensor where the opset requires the input."""
    roi = _resize_inputs(ctx)[0]
    if roi is not None and ctx.attr("coordinate_transformation_mode") == "tf_crop_and_resize":
        roi = roi.cast(np.float32)
        start, end = roi.op("Gather", ctx.ints([j])), roi.op("Gather", ctx.ints([j + count]))
        zeros, ones = ctx.const(np.zeros(3, np.float32)), ctx.const(np.ones(3, np.float32))
        return ctx.concat([zeros, start, ones, end], axis=0)
    return ctx.const(np.zeros(0, np.float32)) if ctx.opset < 13 else None


def _axis_scales_sizes(ctx, axis: int, j: int):
    """(scales, sizes) of a one-axis Resize of the basis [L, 1, 1, L]: entry j of the node's."""
    _, scales, sizes = _resize_inputs(ctx)
    if _uses_scales(ctx, scales):  # the scale itself, not Y/X: coordinate modes read it
        return ctx.concat([ctx.const(np.ones(3, np.float32)), scales.op("Gather", ctx.ints([j]))], axis=0), None
    sizes = ctx.concat(
        [ctx.shape(ctx.x(0), axis, axis + 1), ctx.ints([1, 1]), sizes.op("Gather", ctx.ints([j]))], axis=0
    )
    return (ctx.const(np.zeros(0, np.float32)) if ctx.opset < 13 else None), sizes


def _resize_matrix(ctx, axis: int, j: int, count: int):
    """[X_axis, Y_axis]: the node's Resize applied to the basis along its last axis only."""
    attrs = {k: v for k, v in ctx.node.attrs.items() if k not in ("axes", "keep_aspect_ratio_policy")}
    if ctx.opset >= 11:
        attrs["extrapolation_value"] = 0.0  # outside the roi the output is a constant, not x
    scales, sizes = _axis_scales_sizes(ctx, axis, j)
    inputs = (scales,) if ctx.opset < 11 else (_axis_roi(ctx, j, count), scales, sizes)
    return _basis(ctx, ctx.x(0), axis, 2).op("Resize", *inputs, **attrs).flatten(1)


def _uses_scales(ctx, scales) -> bool:
    """Whether the node resizes by scales (before opset 13 an empty scales means: by sizes)."""
    value = ctx.const_value(2 if ctx.opset >= 11 else 1)
    return scales is not None and (value is None or value.size > 0)


@linear(
    "Resize",
    since=10,
    settings={
        1: "roi: where to sample, which torch's interpolate takes as numbers",
        2: "scales: how densely to sample, which torch's interpolate takes as numbers",
    },
)
def resize(ctx, dy):
    if ctx.attr("keep_aspect_ratio_policy", "stretch") != "stretch" and not _uses_scales(ctx, _resize_inputs(ctx)[1]):
        # sizes are then turned into one common scale and new sizes: not one Resize per axis
        ctx.fail("Resize by sizes with keep_aspect_ratio_policy other than stretch is not differentiable yet")
    count = len(ctx.attr("axes") or range(ctx.rank(ctx.x(0))))
    position = dict(_resized_axes(ctx))  # axis -> its entry in scales/sizes/roi
    return _per_axis_adjoint(ctx, dy, list(position), lambda a: _resize_matrix(ctx, a, position[a], count))
