"""Rules for the backward autodiff writes: the same gradient through kernels that run faster.

Each rule's ``why`` is its measurement: onnxruntime 1.31's CPU provider, one node or pair
alone, median of 30 runs (benchmarks/fusion_kernels.py; the A/B on whole models is in
docs/benchmarks.md, "Fusion").
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from graphforge.builder import Builder, is_zeros, rank
from graphforge.constants import constant_value
from graphforge.ir import onnx_dtype
from graphforge.ort_compat import NATIVE, node_kernel
from graphforge.placement.precision import node_key

from ..engine import Context, Match, Pattern, Rule

FLOAT_TYPES = (np.float16, np.float32, np.float64)


def _is_scalar_zero(t: gs.Tensor) -> bool:
    value = constant_value(t)
    return value is not None and value.size == 1 and float(value.reshape(())) == 0.0


# --------------------------------------------------------------------------- ReLU


def _relu_pattern(p: Pattern):
    mask = p.op("Greater", p.var("y"), p.var("zero"))
    return p.op("Where", mask, p.var("dy"), p.var("otherwise"))


def relu_mask_check(m: Match, _: Context) -> str | None:
    """A ReLU's gradient, Where(y > 0, dy, 0) with y the ReLU's output, of a float type, and
    the result no larger than dy (a scalar zero does not broadcast it)."""
    y = m.vars["y"]
    if len(y.inputs) != 1 or y.inputs[0].op != "Relu":
        return "the mask is not of a ReLU's output"
    if not (_is_scalar_zero(m.vars["zero"]) and _is_scalar_zero(m.vars["otherwise"])):
        return "compares with or selects something other than 0"
    dy = m.vars["dy"]
    if (dy.dtype or y.dtype) not in FLOAT_TYPES:
        return "the gradient's type is not a known float type"
    if rank(m.vars["otherwise"]) not in (0, None) and (rank(dy) is None or rank(m.vars["otherwise"]) > rank(dy)):
        return "the zero's rank could broadcast the result"
    return None


def relu_mask_replace(b: Builder, m: Match, _: Context) -> list[gs.Tensor]:
    dy = m.vars["dy"]
    mask = m.nodes["Greater"].outputs[0]
    return [b.op("Mul", dy, b.op("Cast", mask, to=onnx_dtype(dy.dtype or m.vars["y"].dtype)))]


RELU_MASK = Rule(
    "relu_backward_mask",
    Pattern.of(_relu_pattern),
    relu_mask_check,
    relu_mask_replace,
    why=(
        "ReLU's gradient as dy · float(y > 0) instead of Where(y > 0, dy, 0): onnxruntime's CPU Where "
        "is slow; Greater+Cast+Mul measured 0.97 vs 1.81 ms on 32×32×32×32 and 4.8 vs 8.9 ms on "
        "16×64×56×56 at 2 threads (2.2 vs 3.3 and 8.1 vs 11.3 ms at 1). Where the upstream "
        "gradient is not finite at a position the ReLU zeroed, the product is NaN where Where gave 0 "
        "(a float16 step then counts as an overflow and is skipped)."
    ),
)


# --------------------------------------------------------------------------- MaxPool


def _maxpool_pattern(p: Pattern):
    zeros = p.op("ConstantOfShape", p.var("x_shape"))
    flat_zeros = p.op("Reshape", zeros, p.var("flat_a"), name="zeros_flat")
    flat_indices = p.op("Reshape", p.var("indices"), p.var("flat_b"), name="indices_flat")
    flat_dy = p.op("Reshape", p.var("dy"), p.var("flat_c"), name="dy_flat")
    scattered = p.op("ScatterElements", flat_zeros, flat_indices, flat_dy)
    return p.op("Reshape", scattered, p.var("out_shape"), name="unflatten")


def _shape_of(t: gs.Tensor) -> gs.Tensor | None:
    """The tensor whose whole shape ``t`` is (a Shape node without start/end), or None."""
    if len(t.inputs) != 1 or t.inputs[0].op != "Shape" or t.inputs[0].attrs.get("start", 0) != 0:
        return None
    return t.inputs[0].inputs[0] if "end" not in t.inputs[0].attrs else None


def maxpool_unpool_check(m: Match, context: Context) -> str | None:
    """A MaxPool's gradient scattered into zeros by its Indices, with windows that do not
    overlap (each input position in one window at most, so the indices are unique and
    MaxUnpool's assignment is the scatter's), row-major indices, and a MaxUnpool kernel for
    the type on the provider."""
    indices = m.vars["indices"]
    pool = indices.inputs[0] if len(indices.inputs) == 1 else None
    if pool is None or pool.op != "MaxPool" or len(pool.outputs) < 2 or pool.outputs[1] is not indices:
        return "the indices are not a MaxPool's"
    if pool.attrs.get("storage_order", 0):
        return "column-major indices (storage_order=1)"
    pads, n = pool.attrs.get("pads", []), len(pool.attrs["kernel_shape"])
    if pool.attrs.get("ceil_mode", 0) and any(pads[i] > pads[i + n] for i in range(len(pads) // 2)):
        return "ceil_mode with a leading pad larger than the trailing one"
    if pool.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return "auto_pad (the pads are not in the node)"
    scatter = m.nodes["ScatterElements"]
    if scatter.attrs.get("axis", 0) != 0 or scatter.attrs.get("reduction", "none") != "none":
        return "windows overlap (the gradient is summed)"
    for name in ("flat_a", "flat_b", "flat_c"):
        value = constant_value(m.vars[name])
        if value is None or value.tolist() != [-1]:
            return "not a flattening reshape"
    x = pool.inputs[0]
    if _shape_of(m.vars["x_shape"]) is not x or _shape_of(m.vars["out_shape"]) is not x:
        return "not shaped like the MaxPool's input"
    if not is_zeros(m.nodes["ConstantOfShape"].outputs[0]):
        return "scatters into something other than zeros"
    dy, y = m.vars["dy"], pool.outputs[0]
    if dy.shape is not None and y.shape is not None and list(dy.shape) != list(y.shape):
        return "the gradient is not shaped like the MaxPool's output"
    dtype = dy.dtype or x.dtype
    if dtype not in FLOAT_TYPES:
        return "the gradient's type is not a known float type"
    probe = gs.Node("MaxUnpool", attrs=_unpool_attrs(pool), inputs=[gs.Variable("a")] * 3, outputs=[gs.Variable("b")])
    types = (onnx_dtype(dtype), onnx_dtype(np.int64), onnx_dtype(np.int64))
    if node_kernel(context.provider, node_key(probe), types, (("", max(context.opset, 11)),)) != NATIVE:
        return f"no MaxUnpool kernel for {np.dtype(dtype).name} on {context.provider}"
    return None


def _unpool_attrs(pool: gs.Node) -> dict:
    """MaxUnpool places by the indices into the explicit output shape; its attributes only set
    the smallest shape it accepts, (pooled - 1) · stride + kernel - pads, and a kernel must be
    larger than its pads. The smallest such kernel, max(pads) + 1, keeps that within the input
    (the last window starts inside the input or its leading pad, and pad < MaxPool's kernel),
    so the pool's own kernel is not passed."""
    n = len(pool.attrs["kernel_shape"])
    pads = list(pool.attrs.get("pads", [0] * 2 * n))
    return {
        "kernel_shape": [max(pads[i], pads[i + n]) + 1 for i in range(n)],
        "strides": list(pool.attrs.get("strides", [1] * n)),
        "pads": pads,
    }


def maxpool_unpool_replace(b: Builder, m: Match, _: Context) -> list[gs.Tensor]:
    pool = m.vars["indices"].inputs[0]
    return [b.op("MaxUnpool", m.vars["dy"], m.vars["indices"], m.vars["out_shape"], **_unpool_attrs(pool))]


MAXPOOL_UNPOOL = Rule(
    "maxpool_backward_unpool",
    Pattern.of(_maxpool_pattern),
    maxpool_unpool_check,
    maxpool_unpool_replace,
    why=(
        "a MaxPool's gradient with non-overlapping windows as MaxUnpool(dy, indices) instead of "
        "ScatterElements into a flat ConstantOfShape of zeros: 0.49 vs 1.94 ms on a 32×32×32×32 input "
        "and 2.7 vs 8.1 ms on 16×64×56×56 at 2 threads (0.6 vs 2.5 and 2.9 vs 10.4 ms at 1)."
    ),
)
