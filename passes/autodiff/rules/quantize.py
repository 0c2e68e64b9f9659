"""Quantization: QuantizeLinear and DequantizeLinear, differentiated with the straight-through
estimator of quantization-aware training (torch.fake_quantize_per_tensor_affine and
fake_quantize_per_channel_affine define the same gradient).

Q→DQ computes fake_quantize(x) = (clamp(round(x / s) + z, qmin, qmax) - z) * s. Its true
derivative is zero almost everywhere; the estimator passes dy through where round(x / s) + z
lies inside [qmin, qmax] and gives 0 where it saturates. Split over the two ops: the integer
result of QuantizeLinear carries a gradient (Rule.straight_through), DequantizeLinear sends
it dy * s, and QuantizeLinear divides by s and applies the range mask. Scales and zero points
get no gradient (as in torch's fake_quantize; learnable-scale LSQ is not this).
"""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES
from onnx import TensorProto

from graphforge.ir import onnx_dtype

gradient = RULES.gradient

#: integer element types QuantizeLinear writes, and their ranges
_RANGES = {
    TensorProto.INT8: (-128, 127),
    TensorProto.UINT8: (0, 255),
    TensorProto.INT16: (-(2**15), 2**15 - 1),
    TensorProto.UINT16: (0, 2**16 - 1),
    **({TensorProto.INT4: (-8, 7), TensorProto.UINT4: (0, 15)} if hasattr(TensorProto, "INT4") else {}),
}


def _per_axis(ctx, t, data):
    """A scale or zero point shaped to broadcast against ``data`` (per-tensor, or 1-D along ``axis``)."""
    if ctx.attr("block_size", 0):
        ctx.fail("blocked quantization (block_size) is not differentiable yet")
    r, n = ctx.rank(data), ctx.rank(t)
    if n == 0 or r <= 1:
        return t
    axis = ctx.attr("axis", 1) % r
    return t.reshape([-1] + [1] * (r - axis - 1))


@gradient("QuantizeLinear", since=10, straight_through=True)
def quantize_linear(ctx, dys):
    x, dq = ctx.x(0), dys[0]
    bounds = _RANGES.get(onnx_dtype(ctx.y().dtype))
    if bounds is None:
        ctx.fail(f"QuantizeLinear to {ctx.y().dtype} has no straight-through gradient (integer outputs only)")
    scale = _per_axis(ctx, ctx.x(1), x).cast_like(x)
    v = x / scale
    if ctx.x(2) is not None:
        v = v + _per_axis(ctx, ctx.x(2), x).cast_like(x)
    # round(v) in [qmin, qmax] <=> qmin - 1/2 <= v < qmax + 1/2, ties included (rounding half to
    # even; every qmin is even and every qmax odd), and needs no Round (opset 11)
    low, high = ctx.scalar(bounds[0] - 0.5, x), ctx.scalar(bounds[1] + 0.5, x)
    inside = ctx.at_least(v, low) & (v < high)
    return [ctx.where(inside, dq.cast_like(x) / scale, ctx.scalar(0.0, x)), None, None]


@gradient("DequantizeLinear", since=10)
def dequantize_linear(ctx, dys):
    # y = (q - zero_point) * scale: the integer q's straight-through gradient is dy * scale
    return [dys[0] * _per_axis(ctx, ctx.x(1), ctx.x(0)), None, None]
