"""Common-subexpression elimination: compute each distinct (op, attributes, inputs) once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graphforge.graph import Model
from graphforge.ir import NONDETERMINISTIC_OPS, all_graphs, replace_uses
from graphforge.pipeline import Pass, PassResult


@dataclass(frozen=True)
class CommonSubexpressionElimination(Pass):
    """Merge nodes that compute the same thing.

    1. Two nodes with the same op type, domain, attributes and input tensors (in order)
       are merged: the later one's consumers read the earlier one's outputs. Repeating
       this in topological order merges whole duplicated chains in one run.
    2. Constant nodes with equal values are merged (their value is their only input).
    3. Random ops (Dropout, RandomNormal, ...) are never merged: equal inputs do not mean
       equal outputs.
    4. A node whose outputs are graph outputs is never the one removed, so output names
       stay; nodes holding subgraphs are left alone.
    5. Initializers are never merged, even with equal values: they are parameters, and
       tying two of them would change what training does.
    """

    name = "cse"

    def run(self, model: Model) -> PassResult:
        merged = 0
        for graph in [*all_graphs(model.graph), *model.graph.functions]:
            merged += _eliminate(graph)
        if merged:
            model.graph.cleanup()
        return PassResult(model, merged > 0)


def _eliminate(graph: gs.Graph) -> int:
    graph_outputs = {id(t) for t in graph.outputs}
    seen: dict[tuple, gs.Node] = {}
    merged = 0
    for node in graph.nodes:
        if node.op in NONDETERMINISTIC_OPS or any(True for _ in node.subgraphs()):
            continue
        key = (node.domain, node.op, tuple(id(t) for t in node.inputs), len(node.outputs), _attrs_key(node))
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        if any(id(t) in graph_outputs for t in node.outputs):
            continue
        for dup, kept in zip(node.outputs, first.outputs, strict=True):
            replace_uses(dup, kept)
        node.outputs.clear()
        merged += 1
    return merged


def _attrs_key(node: gs.Node) -> tuple:
    return tuple(sorted((name, _value_key(value)) for name, value in node.attrs.items()))


def _value_key(value) -> object:
    if isinstance(value, gs.Constant):
        array = value.values
        return ("tensor", str(array.dtype), array.shape, array.tobytes())
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, list | tuple):
        return tuple(_value_key(v) for v in value)
    if isinstance(value, gs.Tensor | gs.Graph):
        return ("object", id(value))
    return value
