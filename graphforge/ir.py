"""Small graph helpers shared by passes: walking subgraphs, parameters, change detection."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx_graphsurgeon as gs

#: ops whose two calls with equal inputs may give different results: never merged or folded
NONDETERMINISTIC_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"}
)


def all_graphs(graph: gs.Graph) -> Iterator[gs.Graph]:
    """The graph, then every nested subgraph (If/Loop/Scan bodies), outermost first."""
    yield graph
    yield from graph.subgraphs(recursive=True)


def is_parameter(tensor: gs.Tensor) -> bool:
    """A floating-point initializer: what training treats as a parameter by default."""
    return isinstance(tensor, gs.Constant) and np.issubdtype(tensor.dtype, np.floating)


def fingerprint(graph: gs.Graph) -> tuple:
    """A cheap summary of node order, op types and wiring (tensor names), for passes that
    delegate to a library call and must tell afterwards whether it changed anything.
    Attributes are left out: the passes using this never edit attributes."""
    parts = []
    for g in all_graphs(graph):
        parts.append(tuple(t.name for t in g.inputs))
        parts.append(tuple(t.name for t in g.outputs))
        for node in g.nodes:
            parts.append(
                (node.op, node.domain, tuple(t.name for t in node.inputs), tuple(t.name for t in node.outputs))
            )
    return tuple(parts)


def replace_uses(old: gs.Tensor, new: gs.Tensor) -> None:
    """Make every node that reads ``old`` read ``new`` instead (subgraph readers included).

    Assigns element by element: onnx-graphsurgeon's synchronized lists keep the reverse
    links (tensor.outputs) right only for single-item assignment.
    """
    for consumer in list(old.outputs):
        for i, tensor in enumerate(consumer.inputs):
            if tensor is old:
                consumer.inputs[i] = new
