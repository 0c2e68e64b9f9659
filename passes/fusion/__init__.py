"""Fusion: rewrite rules that make a program faster on stock onnxruntime without changing
what it computes (engine.py matches and rewrites; rules/ holds the rules, each with its
measurement)."""

from graphforge.passes.fusion.fuse import RULES, Fuse

__all__ = ["RULES", "Fuse"]
