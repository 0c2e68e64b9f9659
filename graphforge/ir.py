"""Small graph helpers shared by passes: walking subgraphs, parameters, dtypes, change detection."""

from __future__ import annotations

import ast
import contextlib
import gc
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from graphforge import roles

#: ops whose onnxruntime kernels give the output the input's buffer (declared Alias(0, 0)):
#: the memory model allocates nothing for them, the cost model moves no bytes
ALIASING_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
#: ops whose two calls with equal inputs may give different results: never merged or folded
NONDETERMINISTIC_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"}
)

#: ONNX element types that hold floating-point numbers: every one this onnx version knows,
#: read from its enum (a hand-written list fell behind: float8 E8M0, float6)
FLOAT_TYPES = frozenset(
    code for name, code in TensorProto.DataType.items() if name.startswith(("FLOAT", "BFLOAT", "DOUBLE"))
)


def all_graphs(graph: gs.Graph) -> Iterator[gs.Graph]:
    """The graph, then every nested subgraph (If/Loop/Scan bodies), outermost first: those of
    ``graph.subgraphs(recursive=True)``, in its order, which asks every node with a generator of
    its own (graph.py's walks took about 0.35 s of one GPT-2 small compile that way, under cProfile)."""
    yield graph
    for node in graph.nodes:
        if any(isinstance(value, gs.Graph) for value in node.attrs.values()):
            yield from node.subgraphs(recursive=True)


def every_graph(graph: gs.Graph) -> Iterator[gs.Graph]:
    """The main graph and its subgraphs, then each local function and its subgraphs."""
    yield from all_graphs(graph)
    for function in graph.functions:
        yield from all_graphs(function)


def subgraphs_of(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.GraphProto]:
    """Every graph nested in ``nodes``' attributes (If/Loop/Scan bodies), at any depth."""
    stack = list(nodes)
    while stack:  # iterative, depth first: bodies nest deeply
        node = stack.pop()
        for attr in node.attribute:
            for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield graph
                stack.extend(graph.node)


def nodes_of(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    """``nodes`` and the nodes of their subgraphs, at any depth."""
    nodes = list(nodes)
    yield from nodes
    for graph in subgraphs_of(nodes):
        yield from graph.node


def node_reads(node: onnx.NodeProto) -> set[str]:
    """The tensors ``node`` reads, its subgraphs' outer-scope reads included (all their
    inputs, conservatively)."""
    reads = {name for name in node.input if name}
    for graph in subgraphs_of([node]):
        for inner in graph.node:
            reads.update(name for name in inner.input if name)
    return reads


def model_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of a model: its graph's, its local functions', and their subgraphs'."""
    yield from nodes_of(model.graph.node)
    for function in model.functions:
        yield from nodes_of(function.node)


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type (``domain::op`` outside ai.onnx), subgraphs and local functions
    (and the subgraphs inside them) included."""
    counts = Counter(
        n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in model_nodes(model)
    )
    return dict(sorted(counts.items()))


def onnx_dtype(dtype) -> int | None:
    """A tensor's element type as an ONNX enum, whichever way onnx-graphsurgeon stores it
    (a NumPy dtype, or the ONNX enum itself for types NumPy lacks, e.g. bfloat16); None if unknown."""
    if dtype is None:
        return None
    if isinstance(dtype, int | np.integer):
        return int(dtype)
    try:
        return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (TypeError, KeyError, ValueError):
        return None


def is_parameter(tensor: gs.Tensor) -> bool:
    """A floating-point initializer (bfloat16 and float8 included): what training may treat
    as a parameter (the autodiff pass narrows it down). Reads only the element type, never
    the values."""
    return isinstance(tensor, gs.Constant) and onnx_dtype(tensor.dtype) in FLOAT_TYPES


#: metadata key: torch.export's kind of each initializer of a model torch.onnx's dynamo
#: exporter wrote (JSON object name -> "PARAMETER", "BUFFER", "CONSTANT_TENSOR", ...).
#: Recorded when a model is imported (graph.py), because onnx-graphsurgeon drops value
#: metadata; the autodiff pass reads it to tell parameters from buffers and lifted constants.
TORCH_KINDS = "graphforge.torch_input_kinds"
#: where the dynamo exporter writes that kind: a metadata_props entry of the value
TORCH_KIND_PROP = "pkg.torch.export.graph_signature.InputSpec.kind"


def torch_input_kinds(proto: onnx.ModelProto) -> dict[str, str]:
    """torch.export's kind of each initializer, from the dynamo exporter's value metadata
    (graph inputs, value_info, the initializers themselves); empty for other models."""
    graph = proto.graph
    initializers = {t.name for t in graph.initializer}
    kinds: dict[str, str] = {}
    for value in (*graph.initializer, *graph.input, *graph.value_info):
        if value.name not in initializers or value.name in kinds:
            continue
        for prop in getattr(value, "metadata_props", ()):
            if prop.key == TORCH_KIND_PROP:
                kinds[value.name] = prop.value
    return kinds


#: metadata key: the module's parameters (torch.export's placeholder names, ``p_<path>``)
#: that the dynamo exporter's nodes read but the model holds under no name: its optimizer
#: folded them into new constants (a Linear weight into its transpose, ``val_<n>``) or
#: merged equal ones. JSON list, recorded at import when not empty; autodiff warns.
TORCH_FOLDED = "graphforge.torch_folded_parameters"
#: node metadata: the torch.fx node the exporter translated (its arguments name placeholders)
_TORCH_FX_NODE_PROP = "pkg.torch.onnx.fx_node"
#: value metadata: the torch.fx placeholder a value came from
_TORCH_ORIGINAL_PROP = "pkg.torch.onnx.original_node_name"


def torch_folded_parameters(proto: onnx.ModelProto) -> list[str]:
    """The parameter placeholders (``p_<path>``) the exporter's nodes read, as their fx node
    metadata says, that no value of the model comes from: neither by its metadata nor by its
    name (``a.b.weight`` is placeholder ``p_a_b_weight``). Empty for other exporters' models."""
    graph = proto.graph
    read: set[str] = set()
    for node in graph.node:
        for prop in node.metadata_props:
            if prop.key == _TORCH_FX_NODE_PROP:
                read.update(_PLACEHOLDER.findall(prop.value))
    if not read:
        return []
    present = {"p_" + re.sub(r"\W", "_", t.name) for t in graph.initializer}
    for value in (*graph.initializer, *graph.input, *graph.value_info):
        present.update(p.value for p in value.metadata_props if p.key == _TORCH_ORIGINAL_PROP)
    return sorted(read - present)


_PLACEHOLDER = re.compile(r"%(p_\w+)")

#: metadata key: the BatchNormalization nodes (by first output) that torch ran in training mode
#: and the dynamo exporter wrote in inference mode, reading the running statistics (torch 2.13
#: does so; its fx node metadata still says training=True). JSON list, recorded at import;
#: autodiff trains them in training mode, as torch does.
TORCH_TRAINING_BATCHNORMS = "graphforge.torch_training_batchnorms"
#: a batch norm's fx node and its arguments; the sixth is ``training``
_BATCH_NORM_FX = re.compile(
    r"aten\.(?:_native_batch_norm_legit_functional|_native_batch_norm_legit|native_batch_norm|batch_norm)"
    r"\.default\]\(args = \(([^)]*)\)"
)


def torch_training_batchnorms(proto: onnx.ModelProto) -> list[str]:
    """The first outputs of the main graph's inference-mode BatchNormalization nodes whose fx
    node metadata says torch ran them with ``training=True``."""
    found = []
    for node in proto.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            continue
        if any(a.name == "training_mode" and a.i for a in node.attribute):
            continue
        for prop in node.metadata_props:
            match = _BATCH_NORM_FX.search(prop.value) if prop.key == _TORCH_FX_NODE_PROP else None
            args = match.group(1).split(", ") if match else []
            if len(args) > 5 and args[5] == "True":
                found.append(node.output[0])
    return found


#: metadata key: the embedding lookups torch skips a padding row of (``nn.Embedding(padding_idx=p)``):
#: JSON object, the lookup's output -> p. torch gives row p no gradient from such a lookup, and
#: the Gather it exports does not say so: the dynamo exporter's fx node metadata does (recorded
#: at import), and ``graphforge.torch.export_for_training`` records it from the module. Autodiff
#: honours it.
TORCH_PADDING_ROWS = "graphforge.torch_padding_rows"
#: an embedding's fx node and its arguments (weight, indices, padding_idx = -1: none)
_EMBEDDING_FX = re.compile(r"aten\.embedding\.default\]\(args = \(([^)]*)\)")


def torch_padding_rows(proto: onnx.ModelProto) -> dict[str, int]:
    """The main graph's Gather nodes whose fx node metadata is an embedding with a padding
    row: first output -> the row."""
    found = {}
    for node in proto.graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        for prop in node.metadata_props:
            match = _EMBEDDING_FX.search(prop.value) if prop.key == _TORCH_FX_NODE_PROP else None
            args = match.group(1).split(", ") if match else []
            if len(args) > 2 and re.fullmatch(r"\d+", args[2]):
                found[node.output[0]] = int(args[2])
    return found


#: metadata key: the torch module each linear layer (MatMul, Gemm) of a dynamo export was called
#: in, JSON object: the node's first output -> the module's path (``model.layers.0.self_attn.q_proj``),
#: from the node's ``name_scopes`` metadata, which onnx-graphsurgeon drops. The lora pass names a
#: layer so where the exporter's optimizer folded its weight into a ``val_<n>`` constant.
TORCH_MODULES = "graphforge.torch_modules"
_TORCH_SCOPES_PROP = "pkg.torch.onnx.name_scopes"


def torch_linear_modules(proto: onnx.ModelProto) -> dict[str, str]:
    """The main graph's MatMul and Gemm nodes' modules, as their name_scopes metadata says
    (its last entry is the op's own name, the one before it the module's path)."""
    found = {}
    for node in proto.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
            continue
        for prop in node.metadata_props:
            if prop.key != _TORCH_SCOPES_PROP:
                continue
            with contextlib.suppress(ValueError, SyntaxError):
                scopes = ast.literal_eval(prop.value)
                if isinstance(scopes, list) and len(scopes) >= 2 and isinstance(scopes[-2], str) and scopes[-2]:
                    found[node.output[0]] = scopes[-2]
    return found


#: metadata key: the parameters torch does not train (``requires_grad=False``: a sinusoidal
#: position table, a frozen backbone), JSON list; ``export_for_training`` records them from the
#: module (an export itself does not say). Autodiff leaves them out unless named in ``trainable``.
TORCH_FROZEN = "graphforge.torch_frozen_parameters"


def recorded_json(metadata: dict[str, str], key: str, kind: type, default):
    """The JSON value of ``metadata[key]`` when it is a ``kind``, else ``default`` (absent or unreadable)."""
    try:
        value = json.loads(metadata[key]) if metadata.get(key) else default
    except json.JSONDecodeError:
        return default
    return value if isinstance(value, kind) else default


def recorded_torch_kinds(metadata: dict[str, str]) -> dict[str, str]:
    """The kinds ``Model.from_proto`` recorded as model metadata (TORCH_KINDS, JSON of
    ``torch_input_kinds``); empty when none were recorded or the entry is not such a mapping."""
    return recorded_json(metadata, TORCH_KINDS, dict, {})


def fingerprint(graph: gs.Graph) -> tuple:
    """A cheap summary of node order, op types and wiring (tensor names), for passes that
    delegate to a library call and must tell afterwards whether it changed anything.
    Covers subgraphs and local functions. Attributes are left out: the passes using this
    never edit attributes."""
    parts = []
    for g in every_graph(graph):
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


def live_nodes(graph: gs.Graph) -> set[int]:
    """The ids of the nodes, in the graph, its subgraphs and its local functions, whose
    results reach their own graph's outputs: the nodes ``dce`` (``graph.cleanup``) keeps,
    found the same way."""
    live: set[int] = set()
    for g in every_graph(graph):
        with g.node_ids():
            used, _ = g._get_used_node_ids()
            live.update(id(node) for node in g.nodes if node.id in used)
    return live


def remove_nodes_left_dead(graph: gs.Graph, live_before: set[int]) -> int:
    """Remove, in every graph, the nodes a pass detached (no outputs left) and the nodes it
    left dead (in ``live_before``, ``live_nodes`` taken before the pass, and dead now).

    A full ``graph.cleanup()`` would also remove the code that was dead already, and the
    per-pass report would blame the wrong pass: that is left for ``dce``. Returns how many
    nodes went."""
    live_now = live_nodes(graph)
    removed = 0
    for g in every_graph(graph):
        kept = []
        for node in g.nodes:
            if node.outputs and (id(node) in live_now or id(node) not in live_before):
                kept.append(node)
            else:
                node.inputs.clear()
                node.outputs.clear()
        if len(kept) != len(g.nodes):
            removed += len(g.nodes) - len(kept)
            g.nodes = kept
    return removed


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector around work that builds or walks a whole graph.

    A graph is millions of long-lived objects (nodes, tensors, their synchronized lists), and
    collections that rescan them while a pass, an import or an export adds more made that work
    superlinear (the autodiff driver on a 100k-node ladder: 600 µs per forward node with the
    collector on, 165 µs with it paused). The collector runs again on exit, so the cycles that
    were dropped meanwhile are still freed."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def inline_marker_calls(graph: gs.Graph) -> int:
    """Replace each call of graphforge's marker functions (``graphforge.AllReduce``, whose body
    is an Identity) by an Identity, and drop the functions; returns how many calls there were."""
    calls = [n for n in graph.nodes if n.domain == roles.MARKER_DOMAIN]
    for node in calls:
        node.op, node.domain, node.attrs = "Identity", None, {}
    kept = [f for f in graph.functions if f.domain != roles.MARKER_DOMAIN]
    if len(kept) != len(graph.functions):
        graph.functions = kept
    return len(calls)
