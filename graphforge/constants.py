"""The value of a constant tensor, in one place: an initializer, a Constant node's output, or a
small expression over constants (exporters compute axes and shapes that way), evaluated.

Passes ask here instead of reading ``gs.Constant.values`` or Constant attributes themselves;
the memory model folds the shape values of a model's protos with the same evaluator
(``evaluate``) and the same reading of a static shape (``shape_value``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from graphforge.dag import topological_order
from graphforge.ir import NONDETERMINISTIC_OPS
from graphforge.stand_ins import is_left_out

#: a Constant node's attributes that hold its value, other than ``value`` (a tensor)
_CONSTANT_LISTS = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32, "value_floats": np.float32}


def constant_value(tensor: gs.Tensor, opset: int | None = None) -> np.ndarray | None:
    """The value of an initializer or of an ai.onnx Constant node's output (``value`` or a
    ``value_int(s)``/``value_float(s)`` attribute); None for anything else, including a
    Constant in a function body whose value is a reference to the function's attribute.
    With ``opset``, also the value of a small constant expression (``evaluated_constant``)."""
    value = _stored_value(tensor)
    if value is None and opset is not None:
        value = evaluated_constant(tensor, opset)
    return value


def is_constant(tensor: gs.Tensor) -> bool:
    """Whether ``constant_value(tensor)`` (without ``opset``) is a value, told without reading
    it: a weight's bytes stay where they are (a stand-in's are nowhere)."""
    if isinstance(tensor, gs.Constant):
        return True
    producer = _constant_node(tensor)
    return producer is not None and (
        isinstance(producer.attrs.get("value"), gs.Constant)
        or any(n in producer.attrs and not isinstance(producer.attrs[n], gs.Node.AttributeRef) for n in _CONSTANT_LISTS)
    )


def _constant_node(tensor: gs.Tensor) -> gs.Node | None:
    producer = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    if producer is None or producer.op != "Constant" or producer.domain not in (None, "", "ai.onnx"):
        return None
    return producer


def _stored_value(tensor: gs.Tensor) -> np.ndarray | None:
    if isinstance(tensor, gs.Constant):  # (a weight compiled for its shape alone has none)
        return None if is_left_out(tensor) else np.asarray(tensor.values)
    producer = _constant_node(tensor)
    if producer is None:
        return None
    value = producer.attrs.get("value")
    if isinstance(value, gs.Constant):
        return np.asarray(value.values)
    for name, dtype in _CONSTANT_LISTS.items():
        if name in producer.attrs and not isinstance(producer.attrs[name], gs.Node.AttributeRef):
            return np.asarray(producer.attrs[name], dtype=dtype)
    return None


#: bounds on what ``constant_value`` evaluates: nodes walked, and elements of any tensor read
CONSTANT_NODES, CONSTANT_ELEMENTS = 64, 4096


def evaluated_constant(t: gs.Tensor, opset: int) -> np.ndarray | None:
    """``t``'s value when it depends on constants only (initializers, Constant nodes) through at
    most CONSTANT_NODES deterministic ai.onnx nodes over small tensors (exporters compute axes
    and shapes that way: Reshape(Constant, Constant)); evaluated with onnx's reference
    evaluator at ai.onnx ``opset``. None when it is not such a constant."""
    nodes, leaves = _constant_subgraph(t)
    if nodes is None:
        return None
    return _evaluate(nodes, leaves, t, opset)


def _constant_subgraph(t: gs.Tensor) -> tuple[list[gs.Node] | None, dict[str, np.ndarray]]:
    """The nodes ``t`` is computed by from constants, and those constants by name (Shape and
    Size of tensors whose shape is known count as constants); None when it is not such a tensor."""
    nodes: dict[int, gs.Node] = {}
    leaves: dict[str, np.ndarray] = {}
    stack = [t]
    while stack:
        x = stack.pop()
        if isinstance(x, gs.Constant) and (x.shape is None or _too_big(x.shape) or is_left_out(x)):
            return None, {}  # a weight, say (or one compiled for its shape alone): not read
        known = _known_value(x)
        if known is not None:
            leaves[x.name] = known
            continue
        node = x.inputs[0] if x.inputs else None
        if node is None or (x.shape is not None and _too_big(x.shape)):
            return None, {}  # a graph input, or a large tensor: not the small constants meant
        if id(node) in nodes:
            continue
        subgraphs = any(isinstance(v, gs.Graph) for v in node.attrs.values())
        if node.domain or node.op in NONDETERMINISTIC_OPS or subgraphs or len(nodes) >= CONSTANT_NODES:
            return None, {}
        nodes[id(node)] = node
        stack.extend(i for i in node.inputs if not i.is_empty())
    return list(nodes.values()), leaves


def _known_value(x: gs.Tensor) -> np.ndarray | None:
    """x's value when it needs no evaluation: an initializer, or the Shape or Size of a tensor
    whose shape (the dims asked for) is static."""
    if isinstance(x, gs.Constant):
        return np.asarray(x.values)
    node = x.inputs[0] if x.inputs else None
    if node is None or node.domain or node.op not in ("Shape", "Size"):
        return None
    shape = node.inputs[0].shape
    if shape is None:
        return None
    if node.op == "Shape":
        shape = shape[node.attrs.get("start", 0) : node.attrs.get("end", len(shape))]
    if not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
        return None
    return shape_value(node.op, shape)


def shape_value(op: str, shape: Sequence[int], start: int = 0, end: int | None = None) -> np.ndarray:
    """What ``Shape`` (its ``start`` and ``end`` attributes: Python's slice, which clamps as
    ONNX does) or ``Size`` gives for a tensor of the static ``shape``."""
    if op == "Size":
        return np.array(np.prod(shape), np.int64)
    return np.array([int(d) for d in shape[start:end]], np.int64)


def _too_big(shape) -> bool:
    return (
        all(isinstance(d, int | np.integer) for d in shape) and int(np.prod(shape, dtype=np.int64)) > CONSTANT_ELEMENTS
    )


def _evaluate(nodes: list[gs.Node], leaves: dict[str, np.ndarray], t: gs.Tensor, opset: int) -> np.ndarray | None:
    if t.name in leaves:
        return leaves[t.name]
    order = [nodes[i] for i in topological_order(gs.Graph(nodes=nodes))]
    return evaluate([OnnxExporter.export_node(n) for n in order], leaves, t.name, opset)


def evaluate(
    nodes: Sequence[onnx.NodeProto], values: Mapping[str, np.ndarray], output: str, opset: int
) -> np.ndarray | None:
    """The value of ``output`` that ``nodes`` (ai.onnx, in an order they can run in) compute
    from ``values`` (each tensor they read, by name), with onnx's reference evaluator at
    ai.onnx ``opset``; None when the evaluator cannot run them (an op it lacks, say)."""
    graph = helper.make_graph(
        list(nodes),
        "constant",
        [],
        [helper.make_value_info(output, onnx.TypeProto())],
        [numpy_helper.from_array(value, name) for name, value in values.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        return np.asarray(ReferenceEvaluator(model).run(None, {})[0])
    except Exception:  # an op the evaluator lacks: not a constant we can use
        return None
