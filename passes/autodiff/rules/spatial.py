"""Spatial rearrangements: Pad, DepthToSpace, SpaceToDepth, GridSample, AffineGrid.

Each moves or copies elements without arithmetic, so each gradient moves them back:
constant padding is undone by cropping, the other pad modes (which copy border cells)
by adding dY back at the positions the same Pad puts each cell, and the depth/space
shuffles by the inverse shuffle. AffineGrid is linear in its transform: its gradient is a
product with the grid's base positions.
"""

from __future__ import annotations

import numpy as np
from graphforge.passes.autodiff.expand import decomposed
from graphforge.passes.autodiff.registry import RULES

gradient, linear = RULES.gradient, RULES.linear


def _negated_pads(ctx):
    pads = ctx.const_value(1)
    if pads is not None:
        return ctx.ints([-int(p) for p in pads.reshape(-1)])
    return -ctx.x(1)


def _flat_positions(ctx, x):
    """An int64 tensor shaped like ``x`` holding each element's flat position."""
    count = x.op("Size").reshape([1]).squeeze([0])
    return ctx.op("Range", ctx.const(np.array(0, np.int64)), count, ctx.const(np.array(1, np.int64))).reshape_like(x)


@gradient("Pad", since=11, settings={2: "the value padded with, a number in torch"})
def pad(ctx, dys):
    x, dy = ctx.x(0), dys[0]
    rest = [None] * (len(ctx.node.inputs) - 1)
    axes = [None, ctx.x(3)] if ctx.x(3) is not None else []  # opset 18: pads may name their axes
    mode = ctx.attr("mode", "constant")
    if mode == "constant":  # cropping undoes padding, and zero padding undoes cropping (negative pads)
        dx = dy.op("Pad", _negated_pads(ctx), *axes)
        value = ctx.x(2)
        if value is not None and ctx.wants(value):  # the value fills what dy holds beyond x's cells
            rest[1] = (dy.sum(keepdims=False) - dx.sum(keepdims=False)).reshape_like(value)
        return [dx, *rest]
    # reflect / edge / wrap copy cells: pad the flat positions alike, then add dY back at them
    if ctx.opset < 16:
        ctx.fail(f"Pad in {mode} mode needs opset 16+ (ScatterElements with reduction=add)")
    picked = _flat_positions(ctx, x).op("Pad", ctx.x(1), *axes, mode=mode)
    zeros = ctx.zeros_like(x).reshape([-1])
    flat = zeros.op("ScatterElements", picked.reshape([-1]), dy.reshape([-1]), axis=0, reduction="add")
    return [flat.reshape_like(x), *rest]


@linear("SpaceToDepth")
def space_to_depth(ctx, dy):
    # SpaceToDepth is the exact inverse of DepthToSpace in DCR mode
    mode = {"mode": "DCR"} if ctx.opset >= 11 else {}  # DCR was the only mode before opset 11
    return dy.op("DepthToSpace", blocksize=ctx.attr("blocksize"), **mode)


@linear("DepthToSpace")
def depth_to_space(ctx, dy):
    x, bs = ctx.x(0), ctx.attr("blocksize")
    if ctx.attr("mode", "DCR") == "DCR":
        return dy.op("SpaceToDepth", blocksize=bs)
    # CRD: y = reshape(transpose(x as [N, C', bs, bs, H, W], [0, 1, 4, 2, 5, 3])); undo each step
    split = ctx.concat(
        [ctx.shape(ctx.y(), 0, 2), ctx.shape(x, 2, 3), ctx.ints([bs]), ctx.shape(x, 3, 4), ctx.ints([bs])], axis=0
    )
    return dy.reshape(split).transpose([0, 1, 3, 5, 2, 4]).reshape_like(x)


# ----------------------------------------------------------------------------- GridSample, decomposed
#
# GridSample (4-D, linear or nearest, zeros or border padding) is rewritten in gathers and
# arithmetic exactly as the spec defines it; its gradient is that rewrite's (expand.decomposed):
# the input's through GatherElements, the grid's through the interpolation weights (torch's too).


def _grid_sample(ctx):
    x, grid = ctx.x(0), ctx.x(1)
    mode, padding = ctx.attr("mode", "bilinear"), ctx.attr("padding_mode", "zeros")
    if ctx.rank(x) != 4 or mode not in ("bilinear", "linear", "nearest") or padding not in ("zeros", "border"):
        ctx.fail(
            f"GridSample is differentiable on 4-D inputs, linear/nearest, zeros/border padding (not {mode}, {padding})"
        )
    shape = ctx.shape(x)
    h, w = (shape.op("Gather", ctx.const(np.array(i, np.int64))).cast_like(grid) for i in (2, 3))
    ix, iy = (
        _unnormalize(ctx, grid.op("Gather", ctx.const(np.array(i, np.int64)), axis=3), n) for i, n in ((0, w), (1, h))
    )
    if padding == "border":
        ix, iy = _clip(ctx, ix, w), _clip(ctx, iy, h)
    if mode == "nearest":
        corners = [(ix.op("Round"), iy.op("Round"), None)]
    else:
        x0, y0 = ix.op("Floor"), iy.op("Floor")
        one = ctx.scalar(1.0, grid)
        x1, y1 = x0 + one, y0 + one
        wx1, wy1 = ix - x0, iy - y0
        wx0, wy0 = one - wx1, one - wy1
        corners = [(x0, y0, wx0 * wy0), (x1, y0, wx1 * wy0), (x0, y1, wx0 * wy1), (x1, y1, wx1 * wy1)]
    flat = x.reshape(ctx.concat([ctx.shape(x, 0, 2), ctx.ints([-1])], axis=0))
    out_shape = ctx.concat([ctx.shape(x, 0, 2), ctx.shape(grid, 1, 3)], axis=0)
    return [ctx.sum([_pick(ctx, flat, out_shape, xi, yi, weight, h, w) for xi, yi, weight in corners])]


def _unnormalize(ctx, coord, size):
    """Grid coordinates in [-1, 1] to pixel positions (the spec's align_corners rule)."""
    one = ctx.scalar(1.0, coord)
    if ctx.attr("align_corners", 0):
        return (coord + one) / 2 * (size - one)
    return ((coord + one) * size - one) / 2


def _clip(ctx, pos, size):
    return pos.op("Clip", ctx.scalar(0.0, pos), size - 1)


def _pick(ctx, flat, out_shape, xi, yi, weight, h, w):
    """weight * x[n, c, yi, xi] (0 where the position falls outside the input)."""
    zero, one = ctx.scalar(0.0, xi), ctx.scalar(1.0, xi)
    inside = (ctx.at_least(xi, zero) & ctx.at_most(xi, w - one)) & (ctx.at_least(yi, zero) & ctx.at_most(yi, h - one))
    position = _clip(ctx, yi, h) * w + _clip(ctx, xi, w)
    index = position.cast(np.int64).reshape(ctx.concat([ctx.shape(position, 0, 1), ctx.ints([1, -1])], axis=0))
    index = index.expand(ctx.concat([ctx.ints([1]), ctx.shape(flat, 1, 2), ctx.ints([1])], axis=0))
    picked = flat.op("GatherElements", index, axis=2).reshape(out_shape)
    scale = inside.cast_like(xi) if weight is None else ctx.where(inside, weight, zero)
    return picked * scale.unsqueeze([1])


gradient("GridSample", since=16)(decomposed(_grid_sample))


@linear("AffineGrid", since=20)
def affine_grid(ctx, dy):
    """``grid[n, p] = theta[n] @ (base[p], 1)`` over the k-D positions p, so ``dtheta[n] =
    dgrid[n]ᵀ @ (base, 1)``. The base positions are AffineGrid's own at the identity transform
    (exact: each coordinate times 1 plus zeros), for one image; the size takes no gradient."""
    theta = ctx.x(0)
    k = ctx.rank(ctx.y()) - 2  # 2-D ([N, H, W, 2]) or 3-D ([N, D, H, W, 3])
    identity = ctx.const(np.eye(k, k + 1, dtype=np.float32)[None]).cast_like(theta)
    one_image = ctx.concat([ctx.ints([1]), ctx.x(1).slice(0, 1)], axis=0)  # the size without its batch
    base = identity.op("AffineGrid", one_image, align_corners=ctx.attr("align_corners", 0)).reshape([1, -1, k])
    base.dtype = theta.dtype  # the ones beside it take its type
    homogeneous = ctx.concat([base, ctx.ones_like(base.slice(2, 0, 1))], axis=2)  # [1, P, k + 1]
    positions = dy.reshape([0, -1, k]).transpose([0, 2, 1])  # [N, k, P]
    return positions @ homogeneous
