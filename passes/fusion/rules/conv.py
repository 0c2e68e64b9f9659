"""Convolutions on onnxruntime's blocked-channel (NCHWc) CPU kernels: a Conv's input gradient,
and the forward Conv itself.

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

The forward Conv is the same story (rule conv_nchwc): onnxruntime's NCHW Conv is im2col + GEMM
image by image, its NCHWc Conv a direct blocked kernel, which its session optimizer picks only
for constant weights. So the rule blocks the weights each step, reorders x into blocks, runs
the NCHWc Conv and reorders the result back. Measured (onnxruntime 1.31, an AMD EPYC whose
block is 16, 2 threads, the fastest of 40 runs taking turns, on a busy machine; the A/B of
``benchmarks/fusion_kernels.py conv_forward``):
16×64×16×16 → 64, 3×3: 1.5 vs 3.4 ms; 32×32×16×16 → 64 with its Relu: 1.9 vs 2.0 ms
(1 thread 2.5 vs 3.4); 16×128×8×8 → 128: 2.5 vs 3.0 ms; stride 2 from 16×16 to 8×8: 1.4 vs
1.5 ms. Slower where the output has fewer than 8×8 positions (4×4: 4.0 vs 3.3 ms; stride 2 to
4×4: 2.3 vs 1.6 ms) and for a 1×1 kernel, which onnxruntime runs as one GEMM per image
(0.27 vs 0.19 ms): hence MIN_FORWARD_POSITIONS and the kernel check. prune puts the user's Conv
back in an export.
In the training step (fuse with and without it, onnxruntime alone, blocks taking turns): the
benchmark CNN 1.10× (quartiles 1.03-1.15), ResNet-18 3×64×64 1.09× (1.01-1.12), each at a
load average near 2; a second ResNet-18 run at a load average near 5 gave 0.99× (0.95-1.16).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.builder import Builder, static_shape
from graphforge.ort_compat import CPU, NCHWC_DOMAIN, NCHWC_WEIGHT_PERM, nchwc_block_size

from ..engine import Context, Match, Pattern, Rule

#: spatial positions per image below which the NCHWc form was slower (measured: 16×16 and
#: larger faster at 1 and 2 threads; 8×8, 4×4 and 2×2 slower)
MIN_POSITIONS = 256
#: output positions per image below which the forward NCHWc Conv was slower (measured: 8×8 and
#: larger faster at 1 and 2 threads; 4×4 and 2×2 slower, where conv_stacked takes over)
MIN_FORWARD_POSITIONS = 64


def _pattern(p: Pattern):
    return p.op("ConvTranspose", p.var("dy"), p.var("w"))


def _flat(node: gs.Node, name: str, n: int, fill: int) -> list[int]:
    return list(node.attrs.get(name, [fill] * n))


def input_grad_check(m: Match, context: Context) -> str | None:
    """A stride-1, undilated, single-group ConvTranspose over 2 spatial axes, float32, static
    weights whose channel counts the block divides, pads below the kernel, and a static output
    of at least MIN_POSITIONS positions per image; onnxruntime's CPU NCHWc kernels present."""
    node, w = m.root, m.vars["w"]
    no_kernels = _nchwc_kernels(context)
    if no_kernels:
        return no_kernels
    block = nchwc_block_size()
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


# --------------------------------------------------------------------------- the forward Conv


def _forward_pattern(p: Pattern):
    return p.op("Conv", p.var("x"), p.var("w"), optional=1)


def _nchwc_kernels(context: Context) -> str | None:
    """Why there are no NCHWc kernels for the program, or None."""
    if context.provider != CPU:
        return f"NCHWc kernels are CPU kernels, the program is for {context.provider}"
    if nchwc_block_size() is None:
        return "this onnxruntime build and CPU have no NCHWc kernels"
    return None


def forward_check(m: Match, context: Context) -> str | None:
    """A forward (the user's) standard-domain Conv over 2 spatial axes, float32, undilated, one
    group, explicit pads, static weights of a kernel larger than 1×1 whose channel counts the
    block divides, and a static output of at least MIN_FORWARD_POSITIONS positions per image;
    onnxruntime's CPU NCHWc kernels present."""
    node, w = m.root, m.vars["w"]
    no_kernels = _nchwc_kernels(context)
    if no_kernels:
        return no_kernels
    if roles.node_origin(node.name or "") is not None or node.domain not in (None, "", "ai.onnx"):
        return "not a forward convolution"
    shape = static_shape(w)
    if shape is None or len(shape) != 4:
        return "the weights are not a static 2-D kernel"
    if shape[2] * shape[3] == 1:
        return "a 1×1 kernel (one GEMM per image already)"
    if node.attrs.get("group", 1) != 1 or node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return "groups or auto_pad SAME"
    if any(d != 1 for d in _flat(node, "dilations", 2, 1)):
        return "dilations other than 1"
    if m.vars["x"].dtype != np.float32:
        return "not float32"
    out = _spatial(node.outputs[0])
    if out is None:
        return "the output's spatial size is not static"
    if math.prod(out) < MIN_FORWARD_POSITIONS:
        return f"fewer than {MIN_FORWARD_POSITIONS} positions per image"
    block = nchwc_block_size()
    if any(c % block for c in shape[:2]):
        return f"channels not a multiple of the block ({block})"
    return None


def forward_replace(b: Builder, m: Match, _: Context) -> list[gs.Tensor]:
    node, x, w = m.root, m.vars["x"], m.vars["w"]
    block = nchwc_block_size()
    out_channels, in_channels, kh, kw = static_shape(w)
    blocked = b.reshape(w, [out_channels // block, block, in_channels // block, block, kh, kw])
    weights = b.reshape(b.transpose(blocked, list(NCHWC_WEIGHT_PERM)), [out_channels, in_channels, kh, kw])
    pads = [0] * 4 if node.attrs.get("auto_pad", "NOTSET") == "VALID" else _flat(node, "pads", 4, 0)
    conv = b.op(
        "Conv",
        b.op("ReorderInput", x, domain=NCHWC_DOMAIN),
        weights,
        *node.inputs[2:],  # the bias [O], as it is
        domain=NCHWC_DOMAIN,
        kernel_shape=[kh, kw],
        pads=pads,
        strides=_flat(node, "strides", 2, 1),
    )
    return [b.op("ReorderOutput", conv, domain=NCHWC_DOMAIN, channels=out_channels)]


CONV_NCHWC = Rule(
    "conv_nchwc",
    Pattern.of(_forward_pattern),
    forward_check,
    forward_replace,
    why=(
        "a forward Conv (kernel over 1×1, at least 8×8 output positions) as onnxruntime's NCHWc Conv with the "
        "weights blocked each step, instead of im2col + GEMM image by image: 1.5 vs 3.4 ms (16×64×16×16 → 64) "
        "and 2.5 vs 3.0 ms (16×128×8×8 → 128) at 2 threads; slower at 4×4 and for 1×1 kernels. prune puts "
        "the Conv back in an export."
    ),
    shapes=True,
)
