"""A read-only view of one graph level (a graph, a subgraph or a function body) as the matcher reads it.

Nodes keep their file order (``index``); ``order`` is a topological order that equals the
file order when the file is sorted, computed without recursion and tolerant of cycles (a
broken model is still diffed: nodes on a cycle come last, in file order).

Attributes a node leaves out take their default from the op's schema at the opset the model
imports (``transA`` absent is ``transA = 0``), so writing a default out is no change; ops
without a known schema (custom domains) are compared as written.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from graphforge.diff.source import Side, tensor_bytes

#: how many values of a tensor attribute (a Constant's value) a report shows
PREVIEW_VALUES = 8


@dataclass(frozen=True)
class Value:
    """A graph input or output: its name, position and type."""

    name: str
    position: int
    dtype: str  # "float", "int64", ... ("" when not declared, as in function signatures)
    shape: tuple[int | str | None, ...] | None  # None: no shape declared; a None dim: unknown

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "position": self.position, "dtype": self.dtype, "shape": _shape_json(self.shape)}


@dataclass(eq=False)
class Init:
    """An initializer of this graph level."""

    name: str
    position: int  # in the graph's initializer list (sparse ones follow the dense ones)
    dtype: str
    shape: tuple[int, ...]
    tensor: onnx.TensorProto
    side: Side | None = None  # where a main-graph tensor's bytes may be kept
    sparse: bool = False

    def data(self) -> bytes | np.ndarray:
        return tensor_bytes(self.side, None if self.sparse else self.position, self.tensor)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(eq=False)
class NodeRec:
    index: int
    name: str
    op: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    #: tensors the node's subgraphs read from enclosing scopes, in order of first use
    implicit: tuple[str, ...]
    attrs: dict[str, Any]  # attribute name -> a JSON-ready description
    attr_key: tuple  # attributes as one hashable value (tensor values by digest)
    graphs: dict[str, list[onnx.GraphProto]]  # graph-valued attributes

    @property
    def op_label(self) -> str:
        return f"{self.domain}::{self.op}" if self.domain and self.domain != "ai.onnx" else self.op

    def ref(self) -> dict[str, Any]:
        return {"name": self.name, "op_type": self.op, "domain": self.domain, "index": self.index}


@dataclass(eq=False)
class GraphView:
    kind: str  # "graph" or "function"
    name: str
    nodes: list[NodeRec]
    inputs: list[Value]
    outputs: list[Value]
    initializers: dict[str, Init]
    producer: dict[str, tuple[int, int]] = field(default_factory=dict)
    consumers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # slot -1: implicit read
    order: list[int] = field(default_factory=list)
    input_position: dict[str, int] = field(default_factory=dict)
    output_names: dict[str, list[int]] = field(default_factory=dict)
    #: domain ("" for ai.onnx) -> the opset version this level's nodes are read at
    opsets: dict[str, int] = field(default_factory=dict)
    #: a subgraph: names it does not define come from the enclosing graph
    nested: bool = False

    def __post_init__(self) -> None:
        for node in self.nodes:
            for slot, t in enumerate(node.outputs):
                if t:
                    self.producer.setdefault(t, (node.index, slot))
        for node in self.nodes:
            for slot, t in enumerate(node.inputs):
                if t:
                    self.consumers.setdefault(t, []).append((node.index, slot))
            for t in node.implicit:
                self.consumers.setdefault(t, []).append((node.index, -1))
        self.input_position = {v.name: v.position for v in reversed(self.inputs)}
        for v in self.outputs:
            self.output_names.setdefault(v.name, []).append(v.position)
        self.order = topological_order(self)

    def source(self, tensor: str) -> tuple:
        """Where a tensor comes from: ("node", index, slot), ("input", position), ("init", name),
        ("outer", name) for a name this level does not define (in a subgraph: the enclosing
        graph's; in a main graph or a function body: defined nowhere), or ("none",) for an
        omitted input."""
        if not tensor:
            return ("none",)
        produced = self.producer.get(tensor)
        if produced is not None:
            return ("node", *produced)
        position = self.input_position.get(tensor)
        if position is not None:
            return ("input", position)
        if tensor in self.initializers:
            return ("init", tensor)
        return ("outer", tensor)


def topological_order(view: GraphView) -> list[int]:
    """Kahn's algorithm, smallest file index first (so a sorted file keeps its order)."""
    n = len(view.nodes)
    indegree = [0] * n
    successors: list[list[int]] = [[] for _ in range(n)]
    for node in view.nodes:
        for t in (*node.inputs, *node.implicit):
            produced = view.producer.get(t) if t else None
            if produced is not None and produced[0] != node.index:
                successors[produced[0]].append(node.index)
                indegree[node.index] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < n:  # a cycle: the rest in file order
        placed = set(order)
        order += [i for i in range(n) if i not in placed]
    return order


# --------------------------------------------------------------------------- building views


def opset_map(imports: Iterable[onnx.OperatorSetIdProto]) -> dict[str, int]:
    """Domain ("" for the default one) -> imported version."""
    return {("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in imports}


def graph_view(
    graph: onnx.GraphProto,
    side: Side | None = None,
    *,
    opsets: Mapping[str, int] | None = None,
    nested: bool = False,
) -> GraphView:
    """The view of a graph; ``side`` (main graph only) is where large weights stay; ``opsets``
    the model's imports (for attribute defaults); ``nested`` for a subgraph."""
    opsets = dict(opsets or {})
    inits: dict[str, Init] = {}
    for position, t in enumerate(graph.initializer):
        inits.setdefault(t.name, Init(t.name, position, _dtype_name(t.data_type), tuple(t.dims), t, side))
    for k, sparse in enumerate(graph.sparse_initializer):
        values = sparse.values
        inits.setdefault(
            values.name,
            Init(
                values.name,
                len(graph.initializer) + k,
                _dtype_name(values.data_type),
                tuple(sparse.dims),
                values,
                None,
                True,
            ),
        )
    inputs = [v for v in graph.input if v.name not in inits]
    return GraphView(
        "graph",
        graph.name,
        [_node(i, n, opsets) for i, n in enumerate(graph.node)],
        [_value(v, k) for k, v in enumerate(inputs)],
        [_value(v, k) for k, v in enumerate(graph.output)],
        inits,
        opsets=opsets,
        nested=nested,
    )


def function_view(function: onnx.FunctionProto) -> GraphView:
    opsets = opset_map(function.opset_import)
    return GraphView(
        "function",
        function.name,
        [_node(i, n, opsets) for i, n in enumerate(function.node)],
        [Value(name, k, "", None) for k, name in enumerate(function.input)],
        [Value(name, k, "", None) for k, name in enumerate(function.output)],
        {},
        opsets=opsets,
    )


def _node(index: int, node: onnx.NodeProto, opsets: Mapping[str, int]) -> NodeRec:
    attrs: dict[str, Any] = {}
    keys: dict[str, tuple] = {}
    graphs: dict[str, list[onnx.GraphProto]] = {}
    for attr in node.attribute:
        key, shown = attribute_value(attr)
        attrs[attr.name] = shown
        keys[attr.name] = key
        if attr.type == onnx.AttributeProto.GRAPH:
            graphs[attr.name] = [attr.g]
        elif attr.type == onnx.AttributeProto.GRAPHS:
            graphs[attr.name] = list(attr.graphs)
    domain = "" if node.domain == "ai.onnx" else node.domain
    version = opsets.get(domain)
    if version is not None:
        for name, key, shown in schema_defaults(node.op_type, domain, version):
            if name not in keys:
                keys[name] = key
                attrs[name] = shown
    implicit = _implicit_inputs([g for gs_ in graphs.values() for g in gs_]) if graphs else ()
    return NodeRec(
        index,
        node.name,
        node.op_type,
        node.domain,
        tuple(node.input),
        tuple(node.output),
        implicit,
        dict(sorted(attrs.items())),
        tuple(sorted(keys.items())),
        graphs,
    )


@functools.lru_cache(maxsize=4096)
def schema_defaults(op: str, domain: str, version: int) -> tuple[tuple[str, tuple, Any], ...]:
    """(name, key, shown) of each attribute with a default in ``op``'s schema at ``version``;
    nothing for an op without a known schema."""
    try:
        schema = onnx.defs.get_schema(op, version, domain)
    except onnx.defs.SchemaError:
        return ()
    found = []
    for name, attr in sorted(schema.attributes.items()):
        default = attr.default_value
        if default is None or default.type == onnx.AttributeProto.UNDEFINED:
            continue
        key, shown = attribute_value(default)
        found.append((name, key, shown))
    return tuple(found)


def _implicit_inputs(graphs: list[onnx.GraphProto]) -> tuple[str, ...]:
    """Names read inside ``graphs`` (at any depth) that none of them defines."""
    found: dict[str, None] = {}
    stack: list[tuple[onnx.GraphProto, frozenset[str]]] = [(g, frozenset()) for g in reversed(graphs)]
    while stack:
        graph, enclosing = stack.pop()
        local = set(enclosing)
        local.update(v.name for v in graph.input)
        local.update(t.name for t in graph.initializer)
        local.update(t.values.name for t in graph.sparse_initializer)
        for node in graph.node:
            local.update(node.output)
        nested = []
        for node in graph.node:
            for t in node.input:
                if t and t not in local:
                    found.setdefault(t, None)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    nested.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    nested.extend(attr.graphs)
        frozen = frozenset(local)
        stack.extend((g, frozen) for g in reversed(nested))
    return tuple(found)


def _value(value: onnx.ValueInfoProto, position: int) -> Value:
    dtype, shape = type_of(value.type)
    return Value(value.name, position, dtype, shape)


def type_of(type_proto: onnx.TypeProto) -> tuple[str, tuple[int | str | None, ...] | None]:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type" or kind == "sparse_tensor_type":
        tt = getattr(type_proto, kind)
        dtype = _dtype_name(tt.elem_type) if tt.elem_type else ""
        if kind == "sparse_tensor_type":
            dtype = f"sparse {dtype}"
        if not tt.HasField("shape"):
            return dtype, None
        dims: list[int | str | None] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                dims.append(None)
        return dtype, tuple(dims)
    if kind is None:
        return "", None
    inner = getattr(type_proto, kind)
    if kind == "sequence_type" or kind == "optional_type":
        elem, _ = type_of(inner.elem_type)
        return f"{kind.removesuffix('_type')}({elem})", None
    if kind == "map_type":
        value, _ = type_of(inner.value_type)
        return f"map({_dtype_name(inner.key_type)}, {value})", None
    return kind, None


def _dtype_name(data_type: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(data_type).lower()
    except ValueError:
        return f"type{data_type}"


def _shape_json(shape: tuple | None) -> list | None:
    return None if shape is None else list(shape)


# --------------------------------------------------------------------------- attributes


def attribute_value(attr: onnx.AttributeProto) -> tuple[tuple, Any]:
    """(a hashable key, a JSON-ready description) of one attribute."""
    if attr.ref_attr_name:
        return ("ref", attr.ref_attr_name), {"ref": attr.ref_attr_name}
    t = attr.type
    A = onnx.AttributeProto
    if t == A.INT:
        return ("i", attr.i), int(attr.i)
    if t == A.FLOAT:
        shown = _float(attr.f)
        return ("f", repr(shown)), shown
    if t == A.STRING:
        text = attr.s.decode("utf-8", "replace")
        return ("s", text), text
    if t == A.INTS:
        values = [int(v) for v in attr.ints]
        return ("is", tuple(values)), values
    if t == A.FLOATS:
        floats = [_float(v) for v in attr.floats]
        return ("fs", tuple(map(repr, floats))), floats
    if t == A.STRINGS:
        texts = [s.decode("utf-8", "replace") for s in attr.strings]
        return ("ss", tuple(texts)), texts
    if t == A.TENSOR:
        return tensor_summary(attr.t)
    if t == A.TENSORS:
        pairs = [tensor_summary(x) for x in attr.tensors]
        return ("ts", tuple(k for k, _ in pairs)), [d for _, d in pairs]
    if t == A.GRAPH:
        return graph_summary(attr.g)
    if t == A.GRAPHS:
        pairs = [graph_summary(g) for g in attr.graphs]
        return ("gs", tuple(k for k, _ in pairs)), [d for _, d in pairs]
    payload = attr.SerializeToString(deterministic=True)
    digest = hashlib.blake2b(payload, digest_size=8).hexdigest()
    return ("x", t, digest), {"type": A.AttributeType.Name(t).lower(), "digest": digest}


def _float(value: float) -> float:
    """An attribute float as written (float32), not as its float64 expansion: 1e-05, not 9.99e-06."""
    return float(str(np.float32(value)))


def tensor_summary(tensor: onnx.TensorProto) -> tuple[tuple, dict[str, Any]]:
    data = tensor_bytes(None, None, tensor)
    digest = hashlib.blake2b(data, digest_size=8).hexdigest()
    dtype = _dtype_name(tensor.data_type)
    shown: dict[str, Any] = {"dtype": dtype, "shape": list(tensor.dims)}
    try:
        flat = numpy_helper.to_array(tensor).reshape(-1)
        preview = flat[:PREVIEW_VALUES]
        if preview.dtype.kind in "fc":
            shown["values"] = [_json_number(float(v)) for v in preview.real]
        elif preview.dtype.kind in "iub":
            shown["values"] = [int(v) for v in preview]
        else:
            shown["values"] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in preview]
        if flat.size > PREVIEW_VALUES:
            shown["values"].append("…")
    except Exception:  # exotic types (float8, int4): the digest tells equality
        pass
    shown["digest"] = digest
    return ("t", dtype, tuple(tensor.dims), digest), shown


def graph_summary(graph: onnx.GraphProto) -> tuple[tuple, dict[str, Any]]:
    """A subgraph as an attribute value: its shape, not its names (the subgraph diff has the rest)."""
    ops = Counter(n.op_type for n in graph.node)
    key = ("g", len(graph.node), tuple(sorted(ops.items())), len(graph.input), len(graph.output))
    return key, {
        "graph": graph.name,
        "nodes": len(graph.node),
        "inputs": len(graph.input),
        "outputs": len(graph.output),
    }


def _json_number(value: float) -> float | str:
    if np.isfinite(value):
        return float(value)
    return "nan" if np.isnan(value) else ("inf" if value > 0 else "-inf")
