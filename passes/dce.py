"""Dead-code elimination: drop nodes and tensors that no graph output depends on."""

from __future__ import annotations

from dataclasses import dataclass

from graphforge.graph import Model
from graphforge.ir import fingerprint
from graphforge.pass_infra import Pass, PassResult


@dataclass(frozen=True)
class DeadCodeElimination(Pass):
    """Remove nodes whose results reach no graph output.

    1. A node none of whose outputs feeds, directly or not, a graph output is removed,
       in the main graph, in subgraphs and in local functions.
    2. Initializers used only by removed nodes go with them.
    3. Graph inputs are kept even when unused: they are the model's interface
       (set ``remove_unused_inputs=true`` to drop them). Only the main graph's inputs are
       ever dropped: a Loop/Scan body's or a function's inputs are its signature.
    """

    name = "dce"
    remove_unused_inputs: bool = False

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        before = fingerprint(graph)
        graph.cleanup(remove_unused_graph_inputs=False)
        if self.remove_unused_inputs:  # case 3: the main graph only
            graph.cleanup(remove_unused_graph_inputs=True, recurse_subgraphs=False, recurse_functions=False)
        return PassResult(model, fingerprint(graph) != before)
