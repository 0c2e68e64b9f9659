"""Autodiff over ONNX in standard operators: the pass, its driver and the gradient rules."""

from graphforge.passes.autodiff import rules  # noqa: F401  (fills the registry)
from graphforge.passes.autodiff.autodiff_pass import Autodiff, VectorJacobian
from graphforge.passes.autodiff.driver import MissingGradientRule, build_gradients
from graphforge.passes.autodiff.gradient_op import ExpandGradient
from graphforge.passes.autodiff.registry import RULES, Rule, RuleRegistry

__all__ = [
    "RULES",
    "Autodiff",
    "ExpandGradient",
    "MissingGradientRule",
    "Rule",
    "RuleRegistry",
    "VectorJacobian",
    "build_gradients",
]
