"""The fusion rules, in the order the fuse pass applies them."""

from graphforge.passes.fusion.rules.backward import MAXPOOL_UNPOOL, RELU_MASK
from graphforge.passes.fusion.rules.conv import CONV_INPUT_GRAD_NCHWC

#: No node can match two of them (their roots are a Where, a Reshape and a ConvTranspose, and
#: none rewrites what another matches), so the order is only the report's.
RULES = (RELU_MASK, MAXPOOL_UNPOOL, CONV_INPUT_GRAD_NCHWC)

__all__ = ["CONV_INPUT_GRAD_NCHWC", "MAXPOOL_UNPOOL", "RELU_MASK", "RULES"]
