"""A convolution's input gradient on onnxruntime's blocked-channel (NCHWc) CPU kernels.

autodiff writes a Conv's input gradient as ConvTranspose(dY, W). With stride 1 it is also a
Conv of dY with W's two channel axes swapped and its kernel flipped, and onnxruntime's fast
CPU convolutions are its NCHWc ones (com.microsoft.nchwc: channels in blocks of 8 or 16 for
the CPU's vector width), which its own optimizer only uses for constant weights, never for a
training program's. So the rule writes them itself: dY reordered into blocks, the weights
swapped, flipped and blocked each step (they change every step), one NCHWc Conv, the result
reordered back.

Measured (benchmarks/fusion_kernels.py, 7 shapes at 1 and 2 threads): 1.1-2.1× faster than
ConvTranspose where the gradient has at least 16×16 positions per image, slower at 8×8 and
below (the per-step weight reorder and the blocked kernel's fixed costs are not paid back on
few positions): hence the rule's floor, MIN_POSITIONS.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from graphforge.builder import Builder, static_shape
from graphforge.ort_compat import CPU, NCHWC_DOMAIN, NCHWC_WEIGHT_PERM, nchwc_block_size

from ..engine import Context, Match, Pattern, Rule

#: spatial positions per image below which the NCHWc form was slower (measured: 16×16 and
#: larger faster at 1 and 2 threads; 8×8, 4×4 and 2×2 slower)
MIN_POSITIONS = 256


def _pattern(p: Pattern):
    return p.op("ConvTranspose", p.var("dy"), p.var("w"))


def _flat(node: gs.Node, name: str, n: int, fill: int) -> list[int]:
    return list(node.attrs.get(name, [fill] * n))


def input_grad_check(m: Match, context: Context) -> str | None:
    """A stride-1, undilated, single-group ConvTranspose over 2 spatial axes, float32, static
    weights whose channel counts the block divides, pads below the kernel, and a static output
    of at least MIN_POSITIONS positions per image; onnxruntime's CPU NCHWc kernels present."""
    node, w = m.root, m.vars["w"]
    if context.provider != CPU:
        return f"NCHWc kernels are CPU kernels, the program is for {context.provider}"
    block = nchwc_block_size()
    if block is None:
        return "this onnxruntime build and CPU have no NCHWc kernels"
    shape = static_shape(w)
    if shape is None or len(shape) != 4:
        return "the weights are not a static 2-D kernel"
    if node.attrs.get("group", 1) != 1 or node.attrs.get("auto_pad", "NOTSET") != "NOTSET":
        return "groups or auto_pad"
    if "output_shape" in node.attrs or any(_flat(node, "output_padding", 2, 0)):
        return "an output shape or output padding"
    if any(s != 1 for s in _flat(node, "strides", 2, 1)) or any(d != 1 for d in _flat(node, "dilations", 2, 1)):
        return "strides or dilations other than 1"
    if m.vars["dy"].dtype != np.float32:
        return "not float32"
    pads = _flat(node, "pads", 4, 0)
    if any(p > k - 1 for p, k in zip(pads, [*shape[2:], *shape[2:]], strict=True)):
        return "pads as large as the kernel"
    out, channels = _spatial(node.outputs[0]), shape[:2]
    if out is None:
        return "the gradient's spatial size is not static"
    if math.prod(out) < MIN_POSITIONS:
        return f"fewer than {MIN_POSITIONS} positions per image"
    if any(c % block for c in channels):
        return f"channels not a multiple of the block ({block})"
    return None


def _spatial(t: gs.Tensor) -> list[int] | None:
    """The static spatial dims (after batch and channels) of ``t``, or None."""
    shape = t.shape
    if shape is None or len(shape) != 4 or not all(isinstance(d, int | np.integer) for d in shape[2:]):
        return None
    return [int(d) for d in shape[2:]]


def input_grad_replace(b: Builder, m: Match, _: Context) -> list[gs.Tensor]:
    node, dy, w = m.root, m.vars["dy"], m.vars["w"]
    block = nchwc_block_size()
    out_channels, in_channels, kh, kw = static_shape(w)  # the forward Conv's O and C
    # W'[c, o] = W[o, c] flipped in both spatial axes: the Conv that the stride-1 ConvTranspose is
    swapped = b.op("Transpose", w, perm=[1, 0, 2, 3])  # of w itself: see stacked._stacked
    flipped = b.op("Slice", swapped, b.ints([-1, -1]), b.ints([-(2**62), -(2**62)]), b.ints([2, 3]), b.ints([-1, -1]))
    blocked = b.reshape(flipped, [in_channels // block, block, out_channels // block, block, kh, kw])
    weights = b.reshape(b.transpose(blocked, list(NCHWC_WEIGHT_PERM)), [in_channels, out_channels, kh, kw])
    pads = [k - 1 - p for p, k in zip(_flat(node, "pads", 4, 0), [kh, kw, kh, kw], strict=True)]
    reordered = b.op("ReorderInput", dy, domain=NCHWC_DOMAIN)
    conv = b.op("Conv", reordered, weights, domain=NCHWC_DOMAIN, kernel_shape=[kh, kw], pads=pads)
    return [b.op("ReorderOutput", conv, domain=NCHWC_DOMAIN, channels=in_channels)]


CONV_INPUT_GRAD_NCHWC = Rule(
    "conv_input_grad_nchwc",
    Pattern.of(_pattern),
    input_grad_check,
    input_grad_replace,
    why=(
        "a stride-1 Conv's input gradient as onnxruntime's NCHWc Conv of dY with the weights swapped, "
        "flipped and blocked, instead of ConvTranspose: 1.96 vs 3.71 ms (dY 32×64×16×16 → 32 channels) "
        "and 18.9 vs 40.1 ms (16×64×56×56) at 2 threads, 1.1-1.9× at 1; slower at 8×8 and below."
    ),
    shapes=True,
)
