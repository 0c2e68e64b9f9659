"""Convolutions, each differentiated by the other.

Conv's input gradient is a ConvTranspose of dY with the same weights and ConvTranspose's
is a Conv; both weight gradients are one Conv that correlates the (padded) input with the
output gradient, batch and channel axes swapped, so the forward strides become dilations
and the forward dilations become strides. Pads are resolved the way the spec (and
onnxruntime) resolve auto_pad; when they depend on spatial dims known only at run time,
they are computed from Shape ops so symbolic dims stay symbolic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from graphforge.passes.autodiff.registry import RULES

linear = RULES.linear


@dataclass(frozen=True)
class _Geometry:
    n: int  # spatial rank
    strides: list[int]
    dilations: list[int]
    group: int
    kernel: list[int] | None  # None: known only at run time (from W's shape)

    def attrs(self) -> dict:
        return {"strides": self.strides, "dilations": self.dilations, "group": self.group}

    def effective(self) -> list[int]:
        """Extent of the dilated kernel along each axis."""
        return [(k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations, strict=True)]


def _spatial(t) -> list[int] | None:
    """``t``'s dims after batch and channel, or None unless all are static."""
    shape = t.shape
    if shape is None or len(shape) < 3:
        return None
    dims = shape[2:]
    if not all(isinstance(d, int | np.integer) and d >= 0 for d in dims):
        return None
    return [int(d) for d in dims]


def _geometry(ctx) -> _Geometry:
    n = ctx.rank(ctx.x(0)) - 2
    kernel = ctx.attr("kernel_shape") or _spatial(ctx.x(1))
    return _Geometry(
        n,
        list(ctx.attr("strides") or [1] * n),
        list(ctx.attr("dilations") or [1] * n),
        ctx.attr("group", 1),
        list(kernel) if kernel else None,
    )


def _spatial_axes(g: _Geometry) -> list[int]:
    return list(range(2, g.n + 2))


def _conv_pads(ctx, g: _Geometry) -> list[int] | None:
    """Conv's pads [begins..., ends...]; None for auto_pad SAME over dims unknown until run time."""
    mode = ctx.attr("auto_pad", "NOTSET")
    if mode == "VALID":
        return [0] * 2 * g.n
    if mode == "NOTSET":
        return list(ctx.attr("pads") or [0] * 2 * g.n)
    xs = _spatial(ctx.x(0))
    if xs is None or g.kernel is None:
        return None
    # the output is ceil(X / s); the padding that takes, odd cell at the end for SAME_UPPER
    total = [max(0, (-(-x // s) - 1) * s + e - x) for x, s, e in zip(xs, g.strides, g.effective(), strict=True)]
    begin = [t // 2 if mode == "SAME_UPPER" else t - t // 2 for t in total]
    return begin + [t - p for t, p in zip(total, begin, strict=True)]


def _same_pads(ctx, g: _Geometry):
    """auto_pad SAME's (begins, ends) as int64 tensors computed from the run-time shapes."""
    if ctx.opset < 12:
        ctx.fail("auto_pad SAME over symbolic spatial dims needs opset 12+ (Max on int64)")
    x, s = ctx.shape(ctx.x(0), 2), ctx.ints(g.strides)
    if g.kernel is not None:
        eff = ctx.ints(g.effective())
    else:
        eff = (ctx.shape(ctx.x(1), 2) - ctx.ints([1])) * ctx.ints(g.dilations) + ctx.ints([1])
    out = (x + (s - ctx.ints([1]))) / s  # ceil(x / s)
    total = ((out - ctx.ints([1])) * s + eff - x).op("Max", ctx.ints([0]))
    half = total / ctx.ints([2])
    begin = half if ctx.attr("auto_pad") == "SAME_UPPER" else total - half
    return begin, total - begin


def _pad(ctx, t, begin, end):
    """``t`` padded (or, for negative amounts, cropped) on its spatial axes by run-time amounts."""
    if ctx.opset < 11:
        ctx.fail("padding by amounts known only at run time needs opset 11+ (Pad with a pads input)")
    zeros = ctx.ints([0, 0])
    return t.op("Pad", ctx.concat([zeros, begin, zeros, end], axis=0))


def _slice_spatial(ctx, g: _Geometry, t, like):
    """``t``'s spatial axes cut to the spatial dims of ``like`` (static where they are known)."""
    axes, ends = _spatial_axes(g), _spatial(like)
    if ctx.opset < 10:  # Slice took attributes then
        if ends is None:
            ctx.fail("this gradient needs opset 10+ (Slice to run-time sizes) or static spatial dims")
        return t.op("Slice", starts=[0] * g.n, ends=ends, axes=axes)
    return t.op("Slice", ctx.ints([0] * g.n), ctx.shape(like, 2), ctx.ints(axes))


def _weight_grad(ctx, g: _Geometry, inp, gout, pads: list[int], gout_like):
    """result[m, c, k] = sum over n, o of gout[n, m, o] * inp_padded[n, c, o*stride + k*dilation].

    As GEMMs over strided slices of inp where that applies (``_weight_grad_by_offsets``), else
    per group one Conv of inp (batch and channel swapped) with gout as its weights.
    ``gout_like`` is a forward tensor of gout's shape (a gradient's shape is not inferred)."""
    by_offsets = _weight_grad_by_offsets(ctx, g, inp, gout, pads, gout_like)
    if by_offsets is not None:
        return by_offsets
    spatial = _spatial_axes(g)
    if g.group == 1:
        data = inp.transpose([1, 0, *spatial])
    else:  # [N, G*C, ...] -> [C, G*N, ...] so that Conv's groups pair inp's groups with gout's
        split = ctx.concat([ctx.shape(inp, 0, 1), ctx.ints([g.group, -1]), ctx.shape(inp, 2)], axis=0)
        grouped = inp.reshape(split).transpose([2, 1, 0, *range(3, g.n + 3)])
        data = grouped.reshape(ctx.concat([ctx.ints([0, -1]), ctx.shape(inp, 2)], axis=0))
    weights = gout.transpose([1, 0, *spatial])
    out = data.op("Conv", weights, strides=g.dilations, dilations=g.strides, group=g.group, pads=pads)
    # the correlation can reach past the kernel (cells no output used): keep the kernel's extent
    return _slice_spatial(ctx, g, out, ctx.x(1)).transpose([1, 0, *spatial])


#: below this many input channels one GEMM over all offsets at once beats a GEMM per offset
#: (a C-wide GEMM output is too narrow to run at speed). A guess between the shapes measured
#: (onnxruntime 1.31 CPU, 1-2 threads): 3 channels favour the one GEMM, 16 and more the GEMM
#: per offset; 8 was about even
_NARROW_CHANNELS = 8
#: with few channels the swapped Conv stayed faster for a 7x7 kernel (3 channels, stride 2);
#: 3x3 is the largest kernel measured where it did not
_NARROW_MAX_OFFSETS = 9


def _weight_grad_by_offsets(ctx, g: _Geometry, inp, gout, pads: list[int], gout_like):
    """The weight gradient as GEMMs: for each kernel offset k, the strided slice of the padded
    inp that offset reads is [C, N*P] (batch moved next to the output positions), and
    dW[:, :, k] = gout as [M, N*P] times its transpose. The swapped-axes Conv computes the same
    sum with the batch as its channels and gout as a kernel the size of the image, which
    onnxruntime runs as narrow GEMMs: 1.5-4x the time of these GEMMs on five ResNet-like
    layers (3x3 and 1x1, stride 1 and 2) at 1 and 2 threads. Needs one
    group, a static kernel and C, and opset 11+ (Slice steps, Pad amounts as inputs); None
    where those fail or where the swapped Conv is known to be faster."""
    spatial, w = _spatial_axes(g), ctx.x(1)
    channels = w.shape[1] if w.shape is not None and len(w.shape) == g.n + 2 else None
    if g.group != 1 or g.kernel is None or ctx.opset < 11 or not isinstance(channels, int | np.integer):
        return None
    offsets = list(itertools.product(*(range(k) for k in g.kernel)))
    narrow = channels < _NARROW_CHANNELS
    if narrow and len(offsets) > _NARROW_MAX_OFFSETS:
        return None
    grad = gout.transpose([1, 0, *spatial]).reshape([0, -1])  # [M, N*P]
    out = _spatial(gout_like)
    if out is not None and int(np.prod(out)) <= _FEW_POSITIONS:
        return _weight_grad_channels_last(ctx, g, inp, grad, pads, out, int(channels), offsets)
    data = inp.transpose([1, 0, *spatial])  # [C, N, *S]: each slice flattens to [C, N*P]
    if any(pads):
        data = data.op("Pad", ctx.ints([0, 0, *pads[: g.n], 0, 0, *pads[g.n :]]))
    if out is None:  # each slice spans (O - 1) * stride + 1 cells from its offset
        span = (ctx.shape(gout_like, 2) - ctx.ints([1])) * ctx.ints(g.strides) + ctx.ints([1])
    columns = []
    for offset in offsets:
        start = [k * d for k, d in zip(offset, g.dilations, strict=True)]
        if out is not None:
            end = ctx.ints([a + (o - 1) * s + 1 for a, o, s in zip(start, out, g.strides, strict=True)])
        else:
            end = ctx.ints(start) + span
        piece = data.op("Slice", ctx.ints(start), end, ctx.ints(spatial), ctx.ints(g.strides))
        columns.append(piece.reshape([0, -1]))
    if narrow:  # one GEMM against all offsets' columns stacked: [C * K, N*P]
        stacked = ctx.concat([c.unsqueeze([1]) for c in columns], axis=1).reshape([channels * len(offsets), -1])
        flat = grad.op("Gemm", stacked, transB=1)
    else:
        flat = ctx.concat([grad.op("Gemm", c, transB=1).unsqueeze([2]) for c in columns], axis=2)
    return flat.reshape([0, int(channels), *g.kernel])


#: output positions per image up to which one GEMM over channels-last columns beat the GEMM
#: per offset (benchmarks/fusion_kernels.py small_conv, ResNet-18's 3x3 layers at 1 and 2
#: threads: 1.3-2.5x at 2x2 and 4x4 outputs; at 8x8 0.9-1.4x; at 16x16 0.6-0.9x)
_FEW_POSITIONS = 16


def _weight_grad_channels_last(ctx, g: _Geometry, inp, grad, pads: list[int], out: list[int], channels, offsets):
    """dW as one GEMM, grad [M, N*P] times the columns [N*P, K*C]: each offset's strided slice of
    the padded input, channels last so that every slice and the Concat copy whole rows of C
    (over few positions, the rows of a channels-first slice are a few values long), then
    [M, K, C] turned to [M, C, *kernel]."""
    axes = list(range(1, g.n + 1))
    data = inp.transpose([0, *range(2, g.n + 2), 1])  # [N, *S, C]
    if any(pads):
        data = data.op("Pad", ctx.ints([0, *pads[: g.n], 0, 0, *pads[g.n :], 0]))
    pieces = []
    for offset in offsets:
        start = [k * d for k, d in zip(offset, g.dilations, strict=True)]
        end = [a + (o - 1) * s + 1 for a, o, s in zip(start, out, g.strides, strict=True)]
        pieces.append(data.op("Slice", ctx.ints(start), ctx.ints(end), ctx.ints(axes), ctx.ints(g.strides)))
    columns = ctx.concat(pieces, axis=g.n + 1).reshape([-1, len(offsets) * channels])
    flat = (grad @ columns).reshape([0, len(offsets), channels])
    return flat.transpose([0, 2, 1]).reshape([0, channels, *g.kernel])


def _bias_grad(ctx, g: _Geometry, dy):
    return dy.sum([0, *_spatial_axes(g)]) if ctx.x(2) is not None else None


def _conv_input_grad(ctx, g: _Geometry, dy, pads: list[int]):
    """ConvTranspose of dY, cropped by the begin pads and fitted to X's extent at the end
    (cells past the last window, which no output read, get zeros)."""
    x, w = ctx.x(0), ctx.x(1)
    xs, ys = _spatial(x), _spatial(ctx.y())
    if xs is not None and ys is not None and g.kernel is not None:
        # how far the windows' extent reaches past X's end: cropped by an end pad when
        # positive, filled with zeros by output_padding (always < stride) when negative
        over = [
            s * (y - 1) + e - p - xd
            for s, y, e, p, xd in zip(g.strides, ys, g.effective(), pads[: g.n], xs, strict=True)
        ]
        crop = pads[: g.n] + [max(v, 0) for v in over]
        return dy.op("ConvTranspose", w, pads=crop, output_padding=[max(-v, 0) for v in over], **g.attrs())
    return _fit_to_input(ctx, dy.op("ConvTranspose", w, **g.attrs()), ctx.ints(pads[: g.n]))


def _fit_to_input(ctx, full, begin):
    """``full`` (a ConvTranspose over the padded extent) cropped to X: ``begin`` cells off the
    front, and the end cut or zero-filled to X's size, amounts computed at run time."""
    end = ctx.shape(ctx.x(0), 2) + begin - ctx.shape(full, 2)
    return _pad(ctx, full, -begin, end)


@linear("Conv")
def conv(ctx, dy):
    g, x = _geometry(ctx), ctx.x(0)
    pads = _conv_pads(ctx, g)
    if pads is not None:
        dx = _conv_input_grad(ctx, g, dy, pads)
        dw = _weight_grad(ctx, g, x, dy, pads, ctx.y())
    else:  # auto_pad SAME over run-time dims: pads computed, X padded explicitly for dW
        begin, end = _same_pads(ctx, g)
        dx = _fit_to_input(ctx, dy.op("ConvTranspose", ctx.x(1), **g.attrs()), begin)
        dw = _weight_grad(ctx, g, _pad(ctx, x, begin, end), dy, [0] * 2 * g.n, ctx.y())
    return [dx, dw, _bias_grad(ctx, g, dy)]


def _transpose_pads(ctx, g: _Geometry) -> list[int]:
    """ConvTranspose's pads [begins..., ends...] as the ONNX reference implementation and
    onnxruntime resolve output_shape and auto_pad SAME (the odd cell at the end for
    SAME_UPPER, at the front otherwise)."""
    mode, out = ctx.attr("auto_pad", "NOTSET"), ctx.attr("output_shape")
    if not out and mode in ("NOTSET", "VALID"):
        return list(ctx.attr("pads") or [0] * 2 * g.n) if mode == "NOTSET" else [0] * 2 * g.n
    if g.kernel is None:
        ctx.fail("ConvTranspose with output_shape or auto_pad SAME needs a static kernel shape")
    adj = ctx.attr("output_padding") or [0] * g.n
    if out:
        xs = _spatial(ctx.x(0))
        if xs is None:
            ctx.fail("ConvTranspose with output_shape needs static spatial input dims to differentiate")
        natural = [(xd - 1) * s + a + e for xd, s, a, e in zip(xs, g.strides, adj, g.effective(), strict=True)]
        total = [max(0, v - o) for v, o in zip(natural, out[-g.n :], strict=True)]
    else:  # SAME: the output is X * stride
        total = [max(0, a + e - s) for a, e, s in zip(adj, g.effective(), g.strides, strict=True)]
    begin = [t // 2 if mode == "SAME_UPPER" else t - t // 2 for t in total]
    return begin + [t - p for t, p in zip(total, begin, strict=True)]


def _transpose_overhang(ctx, g: _Geometry, pads: list[int]) -> list[int]:
    """Per axis: Y + begin pad - (where X's last window ends); the Conv that undoes a
    ConvTranspose must see at least that much of dY (positive: cells past it)."""
    adj = ctx.attr("output_padding") or [0] * g.n
    out = ctx.attr("output_shape")
    if not out:  # Y = (X-1)*s + adj + eff - begin - end
        return [a - e for a, e in zip(adj, pads[g.n :], strict=True)]
    xs = _spatial(ctx.x(0))
    ends = [(xd - 1) * s + e for xd, s, e in zip(xs, g.strides, g.effective(), strict=True)]
    return [o + p - v for o, p, v in zip(out[-g.n :], pads[: g.n], ends, strict=True)]


@linear("ConvTranspose")
def conv_transpose(ctx, dy):
    # Y = the full transposed convolution of X, cropped by pads: dX correlates dY (re-padded)
    # with W, which is exactly a Conv; dW is the weight gradient with X and dY's roles swapped
    g, x = _geometry(ctx), ctx.x(0)
    pads = _transpose_pads(ctx, g)
    over = _transpose_overhang(ctx, g, pads)
    conv_pads = pads[: g.n] + [max(0, -v) for v in over]
    dx = dy.op("Conv", ctx.x(1), pads=conv_pads, **g.attrs())
    if any((v + max(0, -v)) >= s for v, s in zip(over, g.strides, strict=True)):
        dx = _slice_spatial(ctx, g, dx, x)  # dY reaches past X's last window
    return [dx, _weight_grad(ctx, g, dy, x, conv_pads, x), _bias_grad(ctx, g, dy)]
