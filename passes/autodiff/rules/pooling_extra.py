"""Pooling and resampling ops the main pooling module leaves out: LpPool, GlobalLpPool,
MaxUnpool and the deprecated Upsample (opsets 7-9, still in older exported detectors).

LpPool is y = (sum over the window of |x|^p)^(1/p): the chain rule through z = |x|^p
leaves the transpose of a window *sum*, which is a ConvTranspose with a ones kernel.
Upsample is linear and separable: along each scaled axis it is a fixed matrix, which
Upsample itself computes from an identity.
"""

from __future__ import annotations

import numpy as np
from graphforge.passes.autodiff.registry import RULES
from onnx import numpy_helper

gradient, linear = RULES.gradient, RULES.linear


def _scaled_dy(ctx, dy, p: int):
    """dy * y^(1-p), 0 where y = 0."""
    y = ctx.y()
    zero = ctx.scalar(0.0, y)
    is_zero = ctx.equal(y, zero)
    safe = ctx.where(is_zero, ctx.scalar(1.0, y), y)
    scaled = dy / safe if p == 2 else dy * safe.op("Pow", ctx.scalar(float(1 - p), y))
    return ctx.where(is_zero, zero, scaled)


def _slope(ctx, p: int):
    """d|x|^p / dx divided by p: |x|^(p-1) sign(x)."""
    x = ctx.x(0)
    if p == 2:
        return x
    return x.abs().op("Pow", ctx.scalar(float(p - 1), x)) * x.sign()


@gradient("GlobalLpPool", since=2)
def global_lp_pool(ctx, dys):
    # y is [N, C, 1, ...]: it broadcasts over the spatial axes as it is
    p = ctx.attr("p", 2)
    return [_scaled_dy(ctx, dys[0], p) * _slope(ctx, p)]


@gradient("LpPool", since=11)
def lp_pool(ctx, dys):
    p = ctx.attr("p", 2)
    if ctx.attr("auto_pad", "NOTSET") != "NOTSET":
        ctx.fail("LpPool with auto_pad is not differentiable yet (give explicit pads)")
    return [_window_sum_transpose(ctx, _scaled_dy(ctx, dys[0], p)) * _slope(ctx, p)]


def _window_sum_transpose(ctx, g):
    """The adjoint of summing x over the pooling windows, applied to g (shaped like y).

    Channels are folded into the batch ([N*C, 1, ...]) so one single-channel ConvTranspose
    with a ones kernel serves any channel count. Its result starts at x's first element
    (the begin pads are cropped by ConvTranspose itself); it is then cut or zero-padded at
    the end to x's size (ceil_mode windows reach past the end, floor mode leaves a tail no
    window reads)."""
    x = ctx.x(0)
    kernel = list(ctx.attr("kernel_shape"))
    n, r = len(kernel), ctx.rank(x)
    pads = list(ctx.attr("pads", [0] * 2 * n))
    attrs = {"strides": list(ctx.attr("strides", [1] * n)), "pads": pads[:n] + [0] * n}
    if ctx.attr("dilations") is not None:
        attrs["dilations"] = list(ctx.attr("dilations"))
    ones = ctx.const(np.ones([1, 1, *kernel], dtype=x.dtype if x.dtype is not None else np.float32))
    folded = g.reshape(ctx.concat([ctx.ints([-1, 1]), ctx.shape(ctx.y(), 2)], axis=0))
    spread = folded.op("ConvTranspose", ones, **attrs)
    target = ctx.shape(x, 2)
    cut = spread.op("Slice", ctx.ints([0] * n), target, ctx.ints(list(range(2, r))))
    missing = target - ctx.shape(cut, 2)
    return cut.op("Pad", ctx.concat([ctx.ints([0] * (r + 2)), missing], axis=0)).reshape_like(x)


@linear("Upsample", since=7, until=9, settings={1: "scales: how densely to sample, a number in torch"})
def upsample(ctx, dy):
    # along each scaled axis y = M x with M [out, in] = Upsample(identity) along that axis,
    # for nearest and linear alike; dx = M^T dy, axis by axis
    x = ctx.x(0)
    scales = ctx.attr("scales") if ctx.opset < 9 else ctx.const_value(1)
    if scales is None:
        ctx.fail("Upsample gradients need constant scales")
    r, g = ctx.rank(x), dy
    for axis, scale in enumerate(np.asarray(scales, dtype=np.float32).tolist()):
        if scale == 1.0:
            continue
        matrix = _upsample_matrix(ctx, axis, scale)  # [out, in]
        to_last = [a for a in range(r) if a != axis] + [axis]
        g = (g.transpose(to_last) @ matrix).transpose(np.argsort(to_last))
    return g


def _upsample_matrix(ctx, axis: int, scale: float):
    x = ctx.x(0)
    dtype = x.dtype if x.dtype is not None else np.float32
    dim = x.shape[axis]
    if isinstance(dim, int | np.integer):
        eye = ctx.const(np.eye(int(dim), dtype=dtype))
    elif ctx.opset >= 9:
        # Shape + Gather, not Shape(start, end): Slice took its bounds as attributes before opset 10
        length = x.op("Shape").op("Gather", ctx.ints([axis]), axis=0)
        eye = ctx.concat([length, length], axis=0).op("ConstantOfShape", value=_zero(dtype)).op("EyeLike")
    else:
        ctx.fail("Upsample gradients before opset 9 need static dims")
    mode = ctx.attr("mode", "nearest")
    if ctx.opset < 9:
        return eye.op("Upsample", mode=mode, scales=[scale, 1.0])
    return eye.op("Upsample", ctx.const(np.array([scale, 1.0], np.float32)), mode=mode)


def _zero(dtype):
    return numpy_helper.from_array(np.zeros(1, dtype=dtype))


# y: zeros with x written at the flat positions I (over the whole output, as MaxPool's
# indices are): each x reads its gradient back from there
linear("MaxUnpool", since=9)(lambda ctx, dy: dy.reshape([-1]).op("Gather", ctx.x(1), axis=0))
