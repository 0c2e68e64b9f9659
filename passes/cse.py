"""Common-subexpression elimination: compute each distinct (op, attributes, inputs) once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper

from graphforge import roles
from graphforge.graph import Model
from graphforge.ir import (
    NONDETERMINISTIC_OPS,
    every_graph,
    live_nodes,
    onnx_dtype,
    remove_nodes_left_dead,
    replace_uses,
)
from graphforge.pass_infra import Pass, PassResult
from graphforge.stand_ins import stored_values


@dataclass(frozen=True)
class CommonSubexpressionElimination(Pass):
    """Merge nodes that compute the same thing.

    1. Two nodes with the same op type, domain, attributes and input tensors (in order;
       an omitted optional input equals another omitted one) and the same outputs
       present are merged: the later one's consumers read the earlier one's outputs.
       Repeating this in topological order merges whole duplicated chains in one run.
    2. Constant nodes with equal values are merged (their value is their only input).
    3. Random ops (Dropout, RandomNormal, ...) are never merged: equal inputs do not mean
       equal outputs.
    4. A node whose outputs are graph outputs is never the one removed, so output names
       stay; nodes holding subgraphs are left alone.
    5. Initializers are never merged, even with equal values: they are parameters, and
       tying two of them would change what training does.
    Only the merged duplicates go: code that was dead already is left for ``dce``.
    """

    name = "cse"

    def run(self, model: Model) -> PassResult:
        live = live_nodes(model.graph)
        merged = 0
        for graph in every_graph(model.graph):
            merged += _eliminate(graph)
        if merged:  # the duplicates merged away; code that was dead already is dce's
            remove_nodes_left_dead(model.graph, live)
        return PassResult(model, merged > 0)


def _eliminate(graph: gs.Graph) -> int:
    graph_outputs = {id(t) for t in graph.outputs}
    seen: dict[tuple, gs.Node] = {}
    merged = 0
    for node in graph.nodes:
        if node.op in NONDETERMINISTIC_OPS or any(True for _ in node.subgraphs()):
            continue
        if (node.name or "").startswith(roles.RECOMPUTE_PREFIX):  # a copy made to be computed again, late
            continue
        inputs = tuple(None if t.is_empty() else id(t) for t in node.inputs)
        outputs = tuple(t.is_empty() for t in node.outputs)
        key = (node.domain, node.op, inputs, outputs, _attrs_key(node))
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
        return _constant_key(value)
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, list | tuple):
        return tuple(_value_key(v) for v in value)
    if isinstance(value, gs.Tensor | gs.Graph):
        return ("object", id(value))
    if isinstance(value, gs.Node.AttributeRef):  # a function attribute: equal if it names the same one
        return ("ref", value.name)
    if isinstance(value, onnx.TensorProto):  # a tensor attribute onnx-graphsurgeon left as a proto
        return ("proto", value.SerializeToString())
    return value


def _constant_key(value: gs.Constant) -> object:
    # ``value.values`` would load lazy values in place, and gs converts types NumPy lacks
    # (bfloat16, float8) to float32 as it loads: read a copy from the proto instead.
    stored = stored_values(value)
    if isinstance(stored, gs.ir.tensor.LazyValues):
        try:
            array = numpy_helper.to_array(stored.tensor)
        except Exception:  # external data or an exotic type: only the same object is equal
            return ("object", id(value))
        return ("tensor", stored.tensor.data_type, array.shape, array.tobytes())
    if isinstance(stored, np.ndarray):
        return ("tensor", onnx_dtype(value.export_dtype), stored.shape, stored.tobytes())
    return ("object", id(value))
