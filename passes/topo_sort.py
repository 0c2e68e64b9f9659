"""Topological sort: order nodes so every node comes after the producers of its inputs."""

from __future__ import annotations

from dataclasses import dataclass

from graphforge.dag import topological_order
from graphforge.graph import Model
from graphforge.ir import every_graph
from graphforge.pass_infra import Pass, PassResult


@dataclass(frozen=True)
class TopologicalSort(Pass):
    """Reorder nodes topologically, in the main graph, subgraphs and local functions.

    1. The sort is stable: nodes already in a valid order keep it, so the pass reports
       no change on a sorted graph.
    2. A subgraph's reads of outer tensors order its owner after their producers.
    3. A graph with a cycle is refused, naming the nodes on the cycle.
    """

    name = "topo_sort"

    def run(self, model: Model) -> PassResult:
        changed = False
        for graph in every_graph(model.graph):
            order = topological_order(graph)
            if order != list(range(len(graph.nodes))):
                graph.nodes = [graph.nodes[i] for i in order]
                changed = True
        return PassResult(model, changed)
