"""A compiled graph's structure, summarised for the golden expectations: op histogram, I/O
signature, metadata and a name-independent fingerprint.

The fingerprint is a Weisfeiler-Lehman hash of the graph as a bipartite graph of nodes and
tensors. Node labels are op types with their attributes; tensor labels say only whether the
tensor is a graph input (position, dtype, shape with symbolic dims as ``?``), a graph output
or an initializer (dtype, dims, and the value unless it is floating-point); edges carry the
input or output slot. No node or tensor name enters it, so renaming internal tensors keeps
it, while any change to op types, attributes, integer constants (shapes, axes, indices) or
wiring changes it. Floating-point values (weights, scalar constants) are left to the
numeric comparison, which has tolerances: the fingerprint is the structure alone.

The hash is written into files that are compared on other machines and with other library
versions, so its definition is ours and versioned (``wl1:``) rather than networkx's
``weisfeiler_lehman_graph_hash``, whose output may change between networkx releases.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import AttributeProto, numpy_helper

from graphforge.ir import FLOAT_TYPES, op_histogram
from graphforge.roles import metadata_of

FINGERPRINT_VERSION = "wl1"
#: refinement rounds; each round reaches one more hop (a tensor or a node) in both directions
WL_ROUNDS = 12


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def dtype_name(elem_type: int) -> str:
    """A tensor element type as a short name (float32, int64, bfloat16, ...)."""
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name
    except (KeyError, ValueError, TypeError):
        return onnx.TensorProto.DataType.Name(elem_type).lower() if elem_type else "undefined"


def shape_of(type_proto: onnx.TypeProto) -> list[int | str | None] | None:
    """Dims of a tensor type: ints, dim_param strings, None for an unknown dim; None when the rank is unknown."""
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    return [
        d.dim_value if d.HasField("dim_value") else d.dim_param if d.HasField("dim_param") else None
        for d in type_proto.tensor_type.shape.dim
    ]


def signature(value: onnx.ValueInfoProto) -> dict:
    """A graph input or output as the expectations record it: name, dtype and shape."""
    tensor_type = value.type.tensor_type if value.type.HasField("tensor_type") else None
    dtype = dtype_name(tensor_type.elem_type) if tensor_type is not None else value.type.WhichOneof("value") or "?"
    return {"name": value.name, "dtype": dtype, "shape": shape_of(value.type)}


def graph_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller feeds (initializers that are also inputs are defaults, left out)."""
    initializers = {t.name for t in graph.initializer}
    return [v for v in graph.input if v.name not in initializers]


# --------------------------------------------------------------------------- labels


def _tensor_label(tensor: onnx.TensorProto) -> str:
    dims = list(tensor.dims)
    label = f"{dtype_name(tensor.data_type)}{dims}"
    if tensor.data_type not in FLOAT_TYPES:
        try:
            payload = numpy_helper.to_array(tensor).tobytes()
        except Exception:  # an exotic type numpy cannot hold: its serialized fields instead
            payload = tensor.SerializeToString(deterministic=True)
        label += "=" + hashlib.blake2b(payload, digest_size=8).hexdigest()
    return label


def _attribute_label(attr: AttributeProto) -> str:
    kind = attr.type
    if attr.ref_attr_name:
        return f"{attr.name}=@{attr.ref_attr_name}"
    if kind == AttributeProto.FLOAT:
        value = repr(float(np.float32(attr.f)))
    elif kind == AttributeProto.INT:
        value = str(attr.i)
    elif kind == AttributeProto.STRING:
        value = repr(attr.s)
    elif kind == AttributeProto.TENSOR:
        value = _tensor_label(attr.t)
    elif kind == AttributeProto.GRAPH:
        value = graph_fingerprint(attr.g)
    elif kind == AttributeProto.FLOATS:
        value = repr([float(np.float32(f)) for f in attr.floats])
    elif kind == AttributeProto.INTS:
        value = repr(list(attr.ints))
    elif kind == AttributeProto.STRINGS:
        value = repr(list(attr.strings))
    elif kind == AttributeProto.TENSORS:
        value = repr([_tensor_label(t) for t in attr.tensors])
    elif kind == AttributeProto.GRAPHS:
        value = repr([graph_fingerprint(g) for g in attr.graphs])
    else:  # sparse tensors, type protos: their serialized form
        value = hashlib.blake2b(attr.SerializeToString(deterministic=True), digest_size=8).hexdigest()
    return f"{attr.name}={value}"


def node_label(node: onnx.NodeProto) -> str:
    """An op with its attributes, sorted: ``Transpose(perm=[1, 0])``; names left out."""
    op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
    attrs = ", ".join(sorted(_attribute_label(a) for a in node.attribute))
    return f"{op}({attrs})"


def _io_label(prefix: str, position: int, value: onnx.ValueInfoProto) -> str:
    sig = signature(value)
    shape = sig["shape"]
    dims = "?" if shape is None else "[" + ",".join(str(d) if isinstance(d, int) else "?" for d in shape) + "]"
    return f"{prefix}{position}:{sig['dtype']}{dims}"


# --------------------------------------------------------------------------- the hash


def _bipartite(graph: onnx.GraphProto) -> tuple[list[str], list[list[tuple[str, int]]]]:
    """Labels and labelled adjacency (both directions) of the node/tensor bipartite graph."""
    labels: list[str] = []
    adjacency: list[list[tuple[str, int]]] = []
    tensors: dict[str, int] = {}

    def tensor(name: str) -> int:
        if name not in tensors:
            tensors[name] = len(labels)
            labels.append("tensor")
            adjacency.append([])
        return tensors[name]

    def tag(index: int, extra: str) -> None:
        labels[index] += "|" + extra

    for position, value in enumerate(graph_inputs(graph)):
        tag(tensor(value.name), _io_label("in", position, value))
    for init in graph.initializer:
        tag(tensor(init.name), "init:" + _tensor_label(init))
    for position, value in enumerate(graph.output):
        tag(tensor(value.name), _io_label("out", position, value))
    for node in graph.node:
        index = len(labels)
        labels.append("node:" + node_label(node))
        adjacency.append([])
        slots: dict[int, list[str]] = {}
        for slot, name in enumerate(node.input):
            if name:  # an omitted optional input is an empty name: its absence shows in the slot numbers
                slots.setdefault(tensor(name), []).append(str(slot))
        for t, used in slots.items():
            edge = "in" + ",".join(used)
            adjacency[index].append((edge, t))
            adjacency[t].append((edge, index))
        for slot, name in enumerate(node.output):
            if name:
                t = tensor(name)
                adjacency[index].append((f"out{slot}", t))
                adjacency[t].append((f"out{slot}", index))
    return labels, adjacency


def graph_fingerprint(graph: onnx.GraphProto, rounds: int = WL_ROUNDS) -> str:
    """The name-independent hash of one graph (tensors an outer scope provides are plain tensors)."""
    labels, adjacency = _bipartite(graph)
    colors = [_digest(label) for label in labels]
    seen: Counter[str] = Counter(colors)
    for _ in range(rounds):
        colors = [
            _digest(colors[v] + "(" + ",".join(sorted(f"{edge}:{colors[u]}" for edge, u in adjacency[v])) + ")")
            for v in range(len(colors))
        ]
        seen.update(colors)
    return _digest(",".join(f"{color}*{n}" for color, n in sorted(seen.items())))


def fingerprint(model: onnx.ModelProto) -> str:
    """``wl1:<hex>``: the main graph's hash combined with its local functions', in name order."""
    parts = [graph_fingerprint(model.graph)]
    parts += [f"{f.domain}:{f.name}:{_function_hash(f)}" for f in sorted(model.functions, key=_function_key)]
    return f"{FINGERPRINT_VERSION}:{_digest(';'.join(parts))}"


def _function_key(function: onnx.FunctionProto) -> tuple[str, str, str]:
    return function.domain, function.name, function.overload


def _function_hash(function: onnx.FunctionProto) -> str:
    graph = onnx.helper.make_graph(
        list(function.node),
        function.name,
        [onnx.helper.make_empty_tensor_value_info(n) for n in function.input],
        [onnx.helper.make_empty_tensor_value_info(n) for n in function.output],
    )
    return graph_fingerprint(graph)


def node_labels(model: onnx.ModelProto) -> Counter[str]:
    """Every main-graph node's label, counted: what a structural diff compares without names."""
    return Counter(node_label(n) for n in model.graph.node)


def summarize(model: onnx.ModelProto) -> dict:
    """The structure an expectation records for a compiled graph."""
    return {
        "nodes": sum(op_histogram(model).values()),
        "op_histogram": op_histogram(model),
        "fingerprint": fingerprint(model),
        "inputs": [signature(v) for v in graph_inputs(model.graph)],
        "outputs": [signature(v) for v in model.graph.output],
        "metadata": dict(sorted(metadata_of(model).items())),
    }


def iter_float_initializers(model: onnx.ModelProto) -> Iterable[onnx.TensorProto]:
    return (t for t in model.graph.initializer if t.data_type in FLOAT_TYPES)
