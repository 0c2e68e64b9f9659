"""The fusion rules, in the order the fuse pass applies them."""

from graphforge.passes.fusion.rules.backward import MAXPOOL_UNPOOL, RELU_MASK
from graphforge.passes.fusion.rules.conv import CONV_INPUT_GRAD_NCHWC, CONV_NCHWC
from graphforge.passes.fusion.rules.stacked import CONV_STACKED, CONV_TRANSPOSE_STACKED

#: No node can match two of them (their roots are a Where, a Reshape, Conv nodes of at least 64
#: and at most 16 positions per image and ConvTranspose nodes of at least 256 and at most 16,
#: and none rewrites what another matches), so the order is only the report's.
RULES = (RELU_MASK, MAXPOOL_UNPOOL, CONV_INPUT_GRAD_NCHWC, CONV_NCHWC, CONV_STACKED, CONV_TRANSPOSE_STACKED)

__all__ = [
    "CONV_INPUT_GRAD_NCHWC",
    "CONV_NCHWC",
    "CONV_STACKED",
    "CONV_TRANSPOSE_STACKED",
    "MAXPOOL_UNPOOL",
    "RELU_MASK",
    "RULES",
]
