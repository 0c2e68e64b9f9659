"""Ops ONNX defines by a function body (RMSNormalization, Attention, Swish, ...): the gradient
is that of the body onnx expands for the node, so it is exact by definition (expand.py)."""

from __future__ import annotations

from graphforge.passes.autodiff.expand import function_body
from graphforge.passes.autodiff.registry import RULES, Rule

#: op type -> the first opset that defines it by a function (onnxruntime 1.31 runs up to opset 26).
#: AffineGrid is left out: its body feeds Range 1-element tensors, which onnx's checker refuses; it has
#: a rule of its own (rules/spatial.py).
FUNCTION_OPS = {
    "Attention": 23,
    "CenterCropPad": 18,
    "RMSNormalization": 23,
    "RotaryEmbedding": 23,
    "Swish": 24,
}

for _op, _since in FUNCTION_OPS.items():
    RULES.add(Rule(_op, function_body, _since, module=__name__))
