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

gradient = RULES.gradient


def _negated_pads(ctx):
    pads = ctx.const_value(1)
    if pads is not None:
        return ctx.b.ints([-int(p) for p in pads.reshape(-1)])
    return ctx.b.neg(ctx.x(1))


def _flat_positions(ctx, x):
    """An int64 tensor shaped like ``x`` holding each element's flat position."""
    b = ctx.b
    count = b.squeeze(b.reshape(b.op("Size", x), [1]), [0])
    positions = b.op("Range", b.constant(np.array(0, np.int64)), count, b.constant(np.array(1, np.int64)))
    return b.reshape_like(positions, x)


@gradient("Pad", since=11, settings={2: "the value padded with, a number in torch"})
def pad(ctx, dys):
    b, x, dy = ctx.b, ctx.x(0), dys[0]
    rest = [None] * (len(ctx.node.inputs) - 1)
    axes = [None, ctx.x(3)] if ctx.x(3) is not None else []  # opset 18: pads may name their axes
    mode = ctx.attr("mode", "constant")
    if mode == "constant":  # cropping undoes padding, and zero padding undoes cropping (negative pads)
        dx = b.op("Pad", dy, _negated_pads(ctx), *axes)
        value = ctx.x(2)
        if value is not None and ctx.wants(value):  # the value fills what dy holds beyond x's cells
            beyond = b.sub(b.axes_op("ReduceSum", dy, None, keepdims=0), b.axes_op("ReduceSum", dx, None, keepdims=0))
            rest[1] = b.reshape_like(beyond, value)
        return [dx, *rest]
    # reflect / edge / wrap copy cells: pad the flat positions alike, then add dY back at them
    if ctx.opset < 16:
        ctx.fail(f"Pad in {mode} mode needs opset 16+ (ScatterElements with reduction=add)")
    picked = b.op("Pad", _flat_positions(ctx, x), ctx.x(1), *axes, mode=mode)
    zeros = b.reshape(b.zeros_like(x), [-1])
    flat = b.op("ScatterElements", zeros, b.reshape(picked, [-1]), b.reshape(dy, [-1]), axis=0, reduction="add")
    return [b.reshape_like(flat, x), *rest]


@gradient("SpaceToDepth")
def space_to_depth(ctx, dys):
    # SpaceToDepth is the exact inverse of DepthToSpace in DCR mode
    mode = {"mode": "DCR"} if ctx.opset >= 11 else {}  # DCR was the only mode before opset 11
    return [ctx.b.op("DepthToSpace", dys[0], blocksize=ctx.attr("blocksize"), **mode)]


@gradient("DepthToSpace")
def depth_to_space(ctx, dys):
    b, x, dy, bs = ctx.b, ctx.x(0), dys[0], ctx.attr("blocksize")
    if ctx.attr("mode", "DCR") == "DCR":
        return [b.op("SpaceToDepth", dy, blocksize=bs)]
    # CRD: y = reshape(transpose(x as [N, C', bs, bs, H, W], [0, 1, 4, 2, 5, 3])); undo each step
    split = b.op(
        "Concat", b.shape(ctx.y(), 0, 2), b.shape(x, 2, 3), b.ints([bs]), b.shape(x, 3, 4), b.ints([bs]), axis=0
    )
    blocks = b.transpose(b.reshape(dy, split), [0, 1, 3, 5, 2, 4])
    return [b.reshape_like(blocks, x)]


# ----------------------------------------------------------------------------- GridSample, decomposed
#
# GridSample (4-D, linear or nearest, zeros or border padding) is rewritten in gathers and
# arithmetic exactly as the spec defines it; its gradient is that rewrite's (expand.decomposed):
# the input's through GatherElements, the grid's through the interpolation weights (torch's too).


def _grid_sample(ctx, b):
    x, grid = ctx.x(0), ctx.x(1)
    mode, padding = ctx.attr("mode", "bilinear"), ctx.attr("padding_mode", "zeros")
    if ctx.rank(x) != 4 or mode not in ("bilinear", "linear", "nearest") or padding not in ("zeros", "border"):
        ctx.fail(
            f"GridSample is differentiable on 4-D inputs, linear/nearest, zeros/border padding (not {mode}, {padding})"
        )
    shape = b.shape(x)
    h, w = (b.cast_like(b.op("Gather", shape, b.constant(np.array(i, np.int64))), grid) for i in (2, 3))
    ix, iy = (
        _unnormalize(ctx, b, b.op("Gather", grid, b.constant(np.array(i, np.int64)), axis=3), n)
        for i, n in ((0, w), (1, h))
    )
    if padding == "border":
        ix, iy = _clip(ctx, b, ix, w), _clip(ctx, b, iy, h)
    if mode == "nearest":
        corners = [(b.op("Round", ix), b.op("Round", iy), None)]
    else:
        x0, y0 = b.op("Floor", ix), b.op("Floor", iy)
        one = ctx.scalar(1.0, grid)
        x1, y1 = b.add(x0, one), b.add(y0, one)
        wx1, wy1 = b.sub(ix, x0), b.sub(iy, y0)
        wx0, wy0 = b.sub(one, wx1), b.sub(one, wy1)
        corners = [
            (x0, y0, b.mul(wx0, wy0)),
            (x1, y0, b.mul(wx1, wy0)),
            (x0, y1, b.mul(wx0, wy1)),
            (x1, y1, b.mul(wx1, wy1)),
        ]
    flat = b.reshape(x, b.op("Concat", b.shape(x, 0, 2), b.ints([-1]), axis=0))
    out_shape = b.op("Concat", b.shape(x, 0, 2), b.shape(grid, 1, 3), axis=0)
    return [b.sum([_pick(ctx, b, flat, out_shape, xi, yi, weight, h, w) for xi, yi, weight in corners])]


def _unnormalize(ctx, b, coord, size):
    """Grid coordinates in [-1, 1] to pixel positions (the spec's align_corners rule)."""
    one = ctx.scalar(1.0, coord)
    if ctx.attr("align_corners", 0):
        return b.mul(b.div(b.add(coord, one), ctx.scalar(2.0, coord)), b.sub(size, one))
    return b.div(b.sub(b.mul(b.add(coord, one), size), one), ctx.scalar(2.0, coord))


def _clip(ctx, b, pos, size):
    return b.op("Clip", pos, ctx.scalar(0.0, pos), b.sub(size, ctx.scalar(1.0, pos)))


def _pick(ctx, b, flat, out_shape, xi, yi, weight, h, w):
    """weight * x[n, c, yi, xi] (0 where the position falls outside the input)."""
    zero, one = ctx.scalar(0.0, xi), ctx.scalar(1.0, xi)
    inside = b.op("And", b.op("And", b.op("GreaterOrEqual", xi, zero), b.op("LessOrEqual", xi, b.sub(w, one))),
                  b.op("And", b.op("GreaterOrEqual", yi, zero), b.op("LessOrEqual", yi, b.sub(h, one))))  # fmt: skip
    index = b.add(b.mul(_clip(ctx, b, yi, h), w), _clip(ctx, b, xi, w))
    index = b.reshape(b.cast(index, np.int64), b.op("Concat", b.shape(index, 0, 1), b.ints([1, -1]), axis=0))
    index = b.expand(index, b.op("Concat", b.ints([1]), b.shape(flat, 1, 2), b.ints([1]), axis=0))
    picked = b.reshape(b.op("GatherElements", flat, index, axis=2), out_shape)
    scale = b.cast_like(inside, xi) if weight is None else b.op("Where", inside, weight, zero)
    return b.mul(picked, b.unsqueeze(scale, [1]))


gradient("GridSample", since=16)(decomposed(_grid_sample))


@gradient("AffineGrid", since=20)
def affine_grid(ctx, dys):
    """``grid[n, p] = theta[n] @ (base[p], 1)`` over the k-D positions p, so ``dtheta[n] =
    dgrid[n]ᵀ @ (base, 1)``. The base positions are AffineGrid's own at the identity transform
    (exact: each coordinate times 1 plus zeros), for one image; the size takes no gradient."""
    b, theta, dy = ctx.b, ctx.x(0), dys[0]
    k = ctx.rank(ctx.y()) - 2  # 2-D ([N, H, W, 2]) or 3-D ([N, D, H, W, 3])
    identity = b.cast_like(b.constant(np.eye(k, k + 1, dtype=np.float32)[None]), theta)
    one_image = b.op("Concat", b.ints([1]), b.slice(ctx.x(1), 0, 1), axis=0)
    base = b.op("AffineGrid", identity, one_image, align_corners=ctx.attr("align_corners", 0))
    base = b.reshape(base, [1, -1, k])
    base.dtype = theta.dtype  # the ones beside it take its type
    homogeneous = b.op("Concat", base, b.ones_like(b.slice(base, 2, 0, 1)), axis=2)  # [1, P, k + 1]
    positions = b.transpose(b.reshape(dy, [0, -1, k]), [0, 2, 1])  # [N, k, P]
    return [b.matmul(positions, homogeneous), None]
