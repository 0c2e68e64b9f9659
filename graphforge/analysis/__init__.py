"""Read-only analyses of graphs (networkx views, orderings)."""

from graphforge.analysis.dag import outer_inputs, placed_early, to_digraph, topological_order

__all__ = ["outer_inputs", "placed_early", "to_digraph", "topological_order"]
