"""Identity and no-op elimination: bypass nodes whose output equals their first input."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from graphforge.constants import constant_value
from graphforge.graph import Model
from graphforge.ir import every_graph, live_nodes, onnx_dtype, remove_nodes_left_dead, replace_uses
from graphforge.pass_infra import Pass, PassResult


@dataclass(frozen=True)
class IdentityElimination(Pass):
    """Remove nodes that pass their first input through unchanged.

    No-ops recognised: ``Identity``; ``Dropout`` in inference mode (no mask read, and
    ``training_mode`` absent, or false in an initializer or a Constant node); ``Cast`` to
    the type the input is known to have; ``Transpose`` with the identity permutation;
    ``Reshape``/``Expand`` whose input and output have the same fully static shape.

    1. Internal tensor: consumers read the node's input instead.
    2. The output is a graph output and the input is produced by a node in the same
       graph that feeds nothing else: that producer writes the graph output directly.
    3. The output is a graph output and the input is a graph input, an initializer, or a
       tensor with other consumers: the node stays, since the output name must stay.
    Only the nodes removed, and producers that only they read, go: code that was dead
    already is left for ``dce``.
    """

    name = "identity_elimination"

    def run(self, model: Model) -> PassResult:
        live = live_nodes(model.graph)
        removed = 0
        for graph in every_graph(model.graph):
            removed += _eliminate(graph)
        if removed:  # the nodes bypassed, and producers only they read; other dead code is dce's
            remove_nodes_left_dead(model.graph, live)
        return PassResult(model, removed > 0)


def _eliminate(graph: gs.Graph) -> int:
    removed = 0
    graph_outputs = {id(t) for t in graph.outputs}
    produced_here = {id(t) for n in graph.nodes for t in n.outputs}
    for node in list(graph.nodes):
        if not is_noop(node, graph_outputs):
            continue
        source, result = node.inputs[0], node.outputs[0]
        if id(result) not in graph_outputs:  # case 1
            replace_uses(result, source)
            node.inputs.clear()  # no longer a reader of source: a later case 2 counts on that
            node.outputs.clear()
            removed += 1
        elif id(source) in produced_here and len(source.outputs) == 1 and id(source) not in graph_outputs:  # case 2
            producer = source.inputs[0]
            node.inputs.clear()
            node.outputs.clear()
            slot = next(i for i, t in enumerate(producer.outputs) if t is source)
            producer.outputs[slot] = result
            removed += 1
    return removed


def is_noop(node: gs.Node, graph_outputs: set[int]) -> bool:
    """Whether ``node`` returns its first input unchanged (and has no other visible output)."""
    if not node.inputs or not node.outputs or node.domain not in (None, "", "ai.onnx"):
        return False
    if any(id(t) in graph_outputs or t.outputs for t in node.outputs[1:]):
        return False
    x, y = node.inputs[0], node.outputs[0]
    if node.op == "Identity":
        return True
    if node.op == "Dropout":
        training = node.inputs[2] if len(node.inputs) > 2 else None
        return training is None or training.is_empty() or _constant_value(training) is False
    if node.op == "Cast":
        return onnx_dtype(x.dtype) is not None and onnx_dtype(x.dtype) == node.attrs.get("to")
    if node.op == "Transpose":
        perm = node.attrs.get("perm")
        return perm is not None and list(perm) == list(range(len(perm)))
    if node.op in ("Reshape", "Expand"):
        return _static(x.shape) and _static(y.shape) and list(x.shape) == list(y.shape)
    return False


def _constant_value(tensor: gs.Tensor) -> bool | None:
    """The value of a constant scalar boolean (an initializer or a Constant node's output)."""
    values = constant_value(tensor)
    return bool(values.item()) if values is not None and values.size == 1 else None


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d >= 0 for d in shape)
