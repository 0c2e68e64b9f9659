"""The fusion rules, in the order the fuse pass applies them."""

from graphforge.passes.fusion.rules.backward import MAXPOOL_UNPOOL, RELU_MASK

#: No node can match both rules (their roots are a Where and a Reshape, and neither rewrites
#: what the other matches), so the order is only the report's.
RULES = (RELU_MASK, MAXPOOL_UNPOOL)

__all__ = ["MAXPOOL_UNPOOL", "RELU_MASK", "RULES"]
