"""Convolutions over small images as one convolution over the batch stacked into one tall image.

onnxruntime's CPU Conv and ConvTranspose run image by image: per image one GEMM whose width
is the image's output positions (for ConvTranspose, its input's). At 2×2 or 4×4 positions
that GEMM is 4 or 16 columns wide, far below the rate MLAS reaches on wide ones, and the
weights are streamed once per image. Stacked along the first spatial axis, with enough zero
rows between two images that no window reaches from one into the next, the whole batch is one
image and one GEMM as wide as the batch's positions (plus the gap rows': at most half more
here). The gap rows' outputs are cut away; the rest are the same sums of the same products.

Measured (``benchmarks/fusion_kernels.py small_conv``: ResNet-18's 3×3 layers at 3×64×64,
batch 16, at 1 and 2 threads): at 2×2 positions 1.9-3.1× faster forward and 3.8-5.9× for the
input gradient; at 4×4 0.9-1.5× forward and 1.2-1.6× for the input gradient; at 8×8 0.8-1.2×
and at 16×16 0.8×, where the per-image GEMM is 64 or more columns wide already: hence
MAX_POSITIONS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graphforge.builder import Builder, static_shape
from graphforge.ort_compat import CPU

from ..engine import Context, Match, Pattern, Rule

#: positions per image (the GEMM's width in onnxruntime's per-image loop) above which stacking
#: did not pay: 16 (4×4) and below faster but for one forward shape at one thread count, 64
#: (8×8) slower at 1 thread and for the input gradient
MAX_POSITIONS = 16


@dataclass(frozen=True)
class _Stacking:
    """How a batch of images ``height`` rows tall stacks along its first spatial axis: each
    image gets ``rows`` rows (its own and zero rows below), a multiple of the stride, so that
    image n's windows start at row n * rows and no window reads or writes another image's rows.
    ``out_height``: the image's rows on the other side of the convolution (Conv: its output;
    ConvTranspose: its input). ``pads`` and ``extra``: the stacked node's pads and, for a
    ConvTranspose, its first axis's output padding, which make the stacked result exactly
    ``rows`` (Conv: ``out_rows``) per image."""

    height: int
    out_height: int
    rows: int
    stride: int
    pads: list[int]
    extra: int

    @classmethod
    def of(cls, node: gs.Node, height: int, out_height: int) -> _Stacking:
        kernel = static_shape(node.inputs[1])[2:]
        strides, dilations, pads = _attrs(node, len(kernel))
        stride, pad, reach = strides[0], pads[0], dilations[0] * (kernel[0] - 1) + 1
        # above: the image before's gap covers this one's begin pad; below: the last window
        # (or the last row a ConvTranspose writes) ends inside this image's own rows
        rows = max(height + pad, (out_height - 1) * stride - pad + reach, out_height * stride)
        # Conv: (N * rows + pad + end - reach) // stride + 1 windows make N * rows // stride;
        # ConvTranspose: stride * (N * rows // stride - 1) + extra + reach - pad - end rows make N * rows
        end, extra = max(0, reach - pad - stride), max(0, pad + stride - reach)
        n = len(kernel)
        return cls(height, out_height, rows + (-rows) % stride, stride, [pad, *pads[1:n], end, *pads[n + 1 :]], extra)

    @property
    def out_rows(self) -> int:
        return self.rows // self.stride


def _attrs(node: gs.Node, spatial: int) -> tuple[list[int], list[int], list[int]]:
    a = node.attrs
    return (
        list(a.get("strides", [1] * spatial)),
        list(a.get("dilations", [1] * spatial)),
        list(a.get("pads", [0] * 2 * spatial)),
    )


def _check(m: Match, context: Context, image: gs.Tensor, other: gs.Tensor) -> str | None:
    """What both rules need: the CPU, a static kernel, channels and image dims, a batch that
    is not one image, explicit pads smaller than the kernel, few positions per image
    (``image`` is the side whose positions set the per-image GEMM's width; ``other`` the
    other side, for its static spatial dims)."""
    node = m.root
    if context.provider != CPU:
        return f"a CPU kernel's per-image loop; the program is for {context.provider}"
    if node.domain not in (None, "", "ai.onnx"):
        return "not a standard-domain op"
    if context.opset < 11:
        return "opset below 11 (Pad takes its amounts as an input from 11)"
    w = static_shape(m.vars["w"])
    if w is None or len(w) < 3:
        return "the weights' shape is not static"
    spatial = len(w) - 2
    for t in (image, other):
        if t.shape is None or len(t.shape) != spatial + 2:
            return "an image's rank is unknown"
        if not all(isinstance(d, int | np.integer) for d in t.shape[1:]):
            return "the channels or image dims are not static"
    batch = image.shape[0]
    if isinstance(batch, int | np.integer) and batch < 2:
        return "a batch of one image"
    if node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return "auto_pad SAME"
    if "output_shape" in node.attrs:
        return "an output shape"
    _, dilations, pads = _attrs(node, spatial)
    if pads[0] >= dilations[0] * (w[2] - 1) + 1:
        return "a pad as large as the kernel"
    positions = math.prod(int(d) for d in image.shape[2:])
    if positions > MAX_POSITIONS:
        return f"more than {MAX_POSITIONS} positions per image"
    return None


def _stacked(b: Builder, x: gs.Tensor, rows: int, height: int) -> gs.Tensor:
    """[N, C, height, ...] as one image [1, C, N * rows, ...], each image followed by zero rows."""
    spatial = len(x.shape) - 2
    # not b.transpose, which would read the source of a Transpose producing x: prune puts a
    # forward Conv back onto x itself, so x must stay (onnxruntime merges the two Transposes)
    moved = b.op("Transpose", x, perm=[1, 0, *range(2, spatial + 2)])
    if rows > height:
        ends = [0, 0, rows - height] + [0] * (spatial - 1)
        moved = b.op("Pad", moved, b.ints([0] * (spatial + 2) + ends))
    return b.reshape(moved, [1, int(x.shape[1]), -1, *(int(d) for d in x.shape[3:])])


def _unstacked(b: Builder, y: gs.Tensor, channels: int, rows: int, height: int, rest: list[int]) -> gs.Tensor:
    """The inverse for a result [1, C, N * rows, ...]: [N, C, height, ...], the gap rows cut."""
    blocks = b.reshape(y, [channels, -1, rows, *rest])
    if rows > height:
        blocks = b.slice(blocks, 2, 0, height)
    return b.transpose(blocks, [1, 0, *range(2, len(rest) + 3)])


# --------------------------------------------------------------------------- Conv


def _conv_pattern(p: Pattern):
    return p.op("Conv", p.var("x"), p.var("w"), optional=1)


def conv_check(m: Match, context: Context) -> str | None:
    """A Conv with at most MAX_POSITIONS output positions per image; see ``_check``."""
    return _check(m, context, m.root.outputs[0], m.vars["x"])


def conv_replace(b: Builder, m: Match, _: Context) -> list[gs.Tensor]:
    node, x, y = m.root, m.vars["x"], m.root.outputs[0]
    stack = _Stacking.of(node, int(x.shape[2]), int(y.shape[2]))
    attrs = {k: v for k, v in node.attrs.items() if k not in ("pads", "auto_pad")}
    stacked = b.op("Conv", _stacked(b, x, stack.rows, stack.height), *node.inputs[1:], **attrs, pads=stack.pads)
    rest = [int(d) for d in y.shape[3:]]
    return [_unstacked(b, stacked, int(y.shape[1]), stack.out_rows, stack.out_height, rest)]


CONV_STACKED = Rule(
    "conv_stacked",
    Pattern.of(_conv_pattern),
    conv_check,
    conv_replace,
    why=(
        "a convolution with at most 16 output positions per image as one Conv over the batch stacked into "
        "one tall image: onnxruntime's per-image GEMMs are that narrow. 10.6 vs 5.2 ms (16×512×2×2, 3×3) and "
        "5.6 vs 2.7 ms (16×256×4×4 → 512, stride 2) at 2 threads. prune puts the Conv back in an export."
    ),
    shapes=True,
)


# --------------------------------------------------------------------------- ConvTranspose


def _transpose_pattern(p: Pattern):
    return p.op("ConvTranspose", p.var("dy"), p.var("w"), optional=1)


def transpose_check(m: Match, context: Context) -> str | None:
    """A ConvTranspose (autodiff writes a Conv's input gradient as one) whose input has at most
    MAX_POSITIONS positions per image; see ``_check``."""
    return _check(m, context, m.vars["dy"], m.root.outputs[0])


def transpose_replace(b: Builder, m: Match, _: Context) -> list[gs.Tensor]:
    node, dy, x = m.root, m.vars["dy"], m.root.outputs[0]
    stack = _Stacking.of(node, int(x.shape[2]), int(dy.shape[2]))
    out_pad = list(node.attrs.get("output_padding", [0] * (len(x.shape) - 2)))
    attrs = {k: v for k, v in node.attrs.items() if k not in ("pads", "auto_pad", "output_padding")}
    stacked = b.op(
        "ConvTranspose",
        _stacked(b, dy, stack.out_rows, stack.out_height),
        *node.inputs[1:],
        **attrs,
        pads=stack.pads,
        output_padding=[stack.extra, *out_pad[1:]],
    )
    rest = [int(d) for d in x.shape[3:]]
    return [_unstacked(b, stacked, int(x.shape[1]), stack.rows, stack.height, rest)]


CONV_TRANSPOSE_STACKED = Rule(
    "conv_transpose_stacked",
    Pattern.of(_transpose_pattern),
    transpose_check,
    transpose_replace,
    why=(
        "a convolution's input gradient over images of at most 16 positions as one ConvTranspose over the "
        "batch stacked into one tall image: onnxruntime's per-image GEMMs are that narrow. 20.5 vs 4.6 ms "
        "(dY 16×512×2×2, 3×3) and 6.4 vs 4.6 ms (16×256×4×4) at 2 threads."
    ),
    shapes=True,
)
