"""Spatial rearrangements: Pad, DepthToSpace, SpaceToDepth.

Each moves or copies elements without arithmetic, so each gradient moves them back:
constant padding is undone by cropping, the other pad modes (which copy border cells)
by adding dY back at the positions the same Pad puts each cell, and the depth/space
shuffles by the inverse shuffle.
"""

from __future__ import annotations

import numpy as np
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
    return b.reshape(positions, ctx.shape(x))


@gradient("Pad", since=11)
def pad(ctx, dys):
    b, x, dy = ctx.b, ctx.x(0), dys[0]
    rest = [None] * (len(ctx.node.inputs) - 1)
    axes = [None, ctx.x(3)] if ctx.x(3) is not None else []  # opset 18: pads may name their axes
    mode = ctx.attr("mode", "constant")
    if mode == "constant":  # cropping undoes padding, and zero padding undoes cropping (negative pads)
        return [b.op("Pad", dy, _negated_pads(ctx), *axes), *rest]
    # reflect / edge / wrap copy cells: pad the flat positions alike, then add dY back at them
    if ctx.opset < 16:
        ctx.fail(f"Pad in {mode} mode needs opset 16+ (ScatterElements with reduction=add)")
    picked = b.op("Pad", _flat_positions(ctx, x), ctx.x(1), *axes, mode=mode)
    zeros = b.reshape(b.zeros_like(x), [-1])
    flat = b.op("ScatterElements", zeros, b.reshape(picked, [-1]), b.reshape(dy, [-1]), axis=0, reduction="add")
    return [b.reshape(flat, ctx.shape(x)), *rest]


@gradient("SpaceToDepth")
def space_to_depth(ctx, dys):
    # SpaceToDepth is the exact inverse of DepthToSpace in DCR mode
    return [ctx.b.op("DepthToSpace", dys[0], blocksize=ctx.attr("blocksize"), mode="DCR")]


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
    return [b.reshape(blocks, ctx.shape(x))]
