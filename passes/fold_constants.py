"""Constant folding: evaluate nodes whose inputs are all known, with onnxruntime."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from graphforge.analysis.size import nbytes
from graphforge.constants import constant_value
from graphforge.errors import one_line
from graphforge.graph import Model
from graphforge.ir import FLOAT_TYPES, NONDETERMINISTIC_OPS, every_graph, fingerprint, is_parameter, onnx_dtype
from graphforge.ort_compat import is_runtime_compatible, make_runtime_compatible
from graphforge.pass_infra import Pass, PassResult, check_number
from graphforge.stand_ins import stored_export_dtype, stored_values


@dataclass(frozen=True)
class FoldConstants(Pass):
    """Replace nodes computable ahead of time by their values (onnx-graphsurgeon's folder,
    evaluated on onnxruntime), in the main graph, in subgraphs and in local functions.

    1. A node whose inputs are all constants (Constant nodes, non-parameter initializers,
       results of folded nodes) becomes a constant, and its dead producers go away.
       Constant nodes themselves are left as they are; a folded floating-point result
       becomes a Constant node, not an initializer, so folding never creates parameters
       (with ``fold_parameters=true`` it becomes an initializer).
    2. ``Shape`` of a tensor whose shape is fully static folds (its ``start``/``end``
       respected), and so does a ``Gather`` or ``Slice`` of a ``Shape`` that picks only
       static dims, and ``Size`` of a tensor whose shape is fully static; symbolic dims never
       do, so dynamic batch and sequence dims stay dynamic.
    3. Floating-point initializers are parameters and are *not* folded into derived
       constants (folding ``Transpose(W)`` would make ``W`` vanish from training); set
       ``fold_parameters=true`` for an inference-only model.
    4. Results larger than ``size_limit_mb`` are left as computations, so folding never
       bloats the file; where the size of an ``Expand``, ``Tile`` or ``ConstantOfShape``
       result is known beforehand, a too large one is not even evaluated.
    5. Random ops are never folded.
    6. Like ``dce``, it then removes every node no graph output needs (the producers
       folding left dead, and any that were dead already).
    7. Each graph is evaluated as a model onnxruntime reads (converted as ``save`` does:
       an opset newer than onnxruntime's is lowered); a graph whose constants cannot be
       evaluated is left as it is, and the result's note says which and why. gs is handed
       only the part of a graph it may fold (``_constant_part``), not the whole graph, which
       it would copy.

    onnx-graphsurgeon's own shape folding is not used: it ignores ``Shape``'s
    ``start``/``end`` and rewrites ``Cast(int→float) → op → Cast(→int)`` chains in integer
    arithmetic, which changes results (``x * 0.5`` becomes ``x * 0``). Its flattening of
    ``If`` nodes with a constant condition is not used either.
    """

    name = "fold_constants"
    fold_parameters: bool = False
    size_limit_mb: float = 16.0

    def __post_init__(self):
        check_number(self, "size_limit_mb", at_least=0)

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        before = fingerprint(graph)
        limit = int(self.size_limit_mb * 2**20)
        hidden = [] if self.fold_parameters else _hide_parameters(graph)
        float_attrs = [saved for g in every_graph(graph) for saved in _float32_constant_values(g)]
        constant_nodes = [
            (node, node.outputs[0], node.outputs[0].dtype, node.outputs[0].shape)
            for g in every_graph(graph)
            for node in g.nodes
            if node.op == "Constant" and len(node.outputs) == 1
        ]
        level = gs.logger.G_LOGGER.severity
        gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR
        failures = []
        folded = 0
        try:
            for g, owner in _graphs_outer_first(graph):
                folded += 1
                written_by = [(node, list(node.outputs)) for node in g.nodes]
                failure = _fold_graph(g, owner, limit)
                if failure:
                    failures.append(failure)
                _replace_folded_nodes(g, written_by, constant_nodes, float_results_as_nodes=not self.fold_parameters)
                # gs lowers every Constant node a graph reads, an outer one a subgraph reads
                # included; each is given its output back, and the producers folding left
                # dead (some short of an output) go, before the next graph is folded, since
                # gs evaluates each graph with the model's functions beside it.
                _reattach(constant_nodes)
                g.cleanup(recurse_subgraphs=False, recurse_functions=False)
        finally:
            gs.logger.G_LOGGER.severity = level
            for node, attrs in float_attrs:
                node.attrs = attrs
            for tensor, values, location, export_dtype in hidden:
                tensor.to_constant(values, export_dtype=export_dtype)
                tensor.data_location = location
        if folded > 1:  # one graph alone was cleaned up in the loop (a large graph's cleanup takes 0.1-0.7 s)
            graph.cleanup()
        return PassResult(model, fingerprint(graph) != before, "; ".join(failures))


def may_fold(model: Model, size_limit_mb: float = FoldConstants.size_limit_mb) -> bool:
    """Whether ``FoldConstants`` could fold anything in ``model`` (a graph it already folded:
    its dead nodes are gone): a ``Shape`` or ``Size`` node, or a node computable ahead of
    time (``_computable``, a parameter counting as no constant). False means a run would
    change nothing; the check reads no weight, and a fold that finds nothing cost the
    specialization of GPT-2 small's forward/backward 0.5-0.9 s."""
    limit = int(size_limit_mb * 2**20)

    def known(tensor: gs.Tensor) -> bool:
        return (isinstance(tensor, gs.Constant) and not is_parameter(tensor)) or _of_constant_node(tensor)

    return any(
        node.op in ("Shape", "Size") or (node.op != "Constant" and _computable(node, known, limit))
        for graph in every_graph(model.graph)
        for node in graph.nodes
    )


def _computable(node: gs.Node, known: Callable[[gs.Tensor], bool], limit: int) -> bool:
    """Whether gs may fold ``node``: every input given is ``known``, it is not a random op, and
    its result is not known to be too big (that takes inferred shapes)."""
    return (
        node.op not in NONDETERMINISTIC_OPS
        and all(t.is_empty() or known(t) for t in node.inputs)
        and not _too_big(node, limit)
    )


def _graphs_outer_first(graph: gs.Graph) -> Iterator[tuple[gs.Graph, gs.Function | None]]:
    """The main graph, its subgraphs, then each function and its subgraphs, each with the
    function it belongs to; a graph's subgraphs are listed only after the caller has folded
    it (outer constants then reach the subgraphs, and a node folded away takes its
    subgraphs with it)."""
    stack = [*((f, f) for f in reversed(graph.functions)), (graph, None)]
    while stack:
        g, owner = stack.pop()
        yield g, owner
        stack.extend((sub, owner) for node in reversed(g.nodes) for sub in reversed(list(node.subgraphs())))


#: the log level of the sessions that evaluate constant subgraphs: errors (3) and worse
EVALUATION_LOG_SEVERITY = 3


@contextlib.contextmanager
def _evaluation_sessions() -> Iterator[None]:
    """Make the onnxruntime sessions that gs creates to evaluate constants load, and quiet.

    gs creates them from the serialized model, without session options (sessions created
    with options, such as graphforge's own probes of what onnxruntime reads, are left alone):
    1. gs exports the graph it evaluates with the graph's IR version and opsets (a subgraph
       has no IR version of its own, and gets onnx's newest), which onnxruntime may not read:
       each model is made runtime compatible first, exactly as ``save`` makes a file
       (``make_runtime_compatible``); a model that cannot be converted fails to evaluate.
    2. Without options they log at the default logger's level, and onnxruntime's graph
       optimizer prints warnings ("UnsqueezeElimination cannot remove node ...") about the
       small graphs it is handed: noise on the user's stderr. They get options at
       EVALUATION_LOG_SEVERITY instead (errors still print); the process-wide default level is
       never touched (onnxruntime has no way to read it back, so it could not be restored).
    Only for the duration of the folding: sessions created afterwards are left alone."""
    import onnxruntime

    original = onnxruntime.InferenceSession

    class EvaluationSession(original):
        def __init__(self, path_or_bytes, sess_options=None, *args, **kwargs):
            if sess_options is None:
                if isinstance(path_or_bytes, bytes):
                    path_or_bytes = _runtime_compatible(path_or_bytes)
                sess_options = onnxruntime.SessionOptions()
                sess_options.log_severity_level = EVALUATION_LOG_SEVERITY
            super().__init__(path_or_bytes, sess_options, *args, **kwargs)

    onnxruntime.InferenceSession = EvaluationSession
    try:
        yield
    finally:
        onnxruntime.InferenceSession = original


def _runtime_compatible(serialized: bytes) -> bytes:
    """A serialized model, converted to what onnxruntime reads if it needs to be."""
    proto = onnx.ModelProto.FromString(serialized)
    if is_runtime_compatible(proto):
        return serialized
    return make_runtime_compatible(proto).SerializeToString()


def _fold_graph(graph: gs.Graph, owner: gs.Function | None, limit: int) -> str | None:
    """Fold one graph level (gs is told not to recurse: the caller walks the subgraphs).
    Returns why its constants could not be evaluated, or None."""
    _fold_shapes(graph)
    # gs evaluates a graph with the model's functions beside it; the function being folded
    # is mid-rewrite (its Constant nodes lowered), and onnxruntime would refuse it. gs
    # shares one function list between all graphs and merges them back on copy, so the
    # function leaves that list itself for the duration.
    part = _constant_part(graph, limit) if owner is None and not graph.functions else None
    if part is not None and all(node.op == "Constant" for node in part.nodes):
        return None  # nothing to evaluate: the Constant nodes stay as they are
    folded = graph if part is None else part
    functions = graph._functions
    slot = next((i for i, f in enumerate(functions) if f is owner), None)
    if slot is not None:
        del functions[slot]
    try:
        with _evaluation_sessions():
            folded.fold_constants(
                fold_shapes=False,
                recurse_subgraphs=False,
                recurse_functions=False,
                flatten_subgraphs=False,
                size_threshold=limit,
                should_exclude_node=lambda node: node.op in NONDETERMINISTIC_OPS or _too_big(node, limit),
                # with error_ok, gs would only log a failed evaluation: it is reported instead
                error_ok=False,
            )
    except Exception as exc:  # onnxruntime's own errors have no common base class
        what = f"function {owner.name!r}" if graph is owner else f"graph {graph.name!r}"
        return f"the constants of {what} were left unevaluated ({one_line(exc)})"
    finally:
        if slot is not None:
            functions.insert(slot, owner)
    return None


def _constant_part(graph: gs.Graph, limit: int) -> gs.Graph | None:
    """The nodes of ``graph`` that gs may fold (every input a constant or made by such a node,
    not a random op, not known to be too big; the Constant nodes), as a graph of their own
    sharing the nodes and tensors, whose outputs are what the rest of ``graph`` reads of them.
    gs copies the graph it folds whole: a program's backward at fixed dims has a few hundred
    such nodes among thousands (Qwen2-0.5B's: the copy took 1.0 s of a 2.1 s fold). None for a
    graph with subgraphs (what their bodies read from outside decides too), which is folded
    whole. The caller's folding works as on ``graph``: gs writes the values it finds into the
    shared tensors."""
    if any(True for node in graph.nodes for _ in node.subgraphs()):
        return None
    known: set[int] = set()
    nodes = []
    for node in graph.nodes:  # topologically sorted, as gs's folding requires
        if node.op == "Constant" or _computable(
            node, lambda t: isinstance(t, gs.Constant) or id(t) in known or _of_constant_node(t), limit
        ):
            nodes.append(node)
            known.update(id(t) for t in node.outputs)
    inside = {id(node) for node in nodes}
    program_outputs = {id(t) for t in graph.outputs}
    read_outside = [
        t
        for node in nodes
        for t in node.outputs
        if id(t) in program_outputs or any(id(consumer) not in inside for consumer in t.outputs)
    ]
    return gs.Graph(
        nodes=nodes,
        outputs=read_outside,
        name=graph.name,
        opset=graph.opset,
        import_domains=graph.import_domains,
        ir_version=graph.ir_version,
    )


def _of_constant_node(tensor: gs.Tensor) -> bool:
    """Made by a Constant node, this graph's or (in a subgraph) an outer one: gs lowers it."""
    return len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant"


def _float32_constant_values(graph: gs.Graph) -> list[tuple[gs.Node, dict]]:
    """gs reads a Constant's ``value_float(s)`` as float64: give it a float32 ``value`` for
    the duration of folding, and return the attributes to put back."""
    saved = []
    for node in graph.nodes:
        name = next((n for n in ("value_float", "value_floats") if n in node.attrs), None)
        if node.op == "Constant" and name and not isinstance(node.attrs[name], gs.Node.AttributeRef):
            saved.append((node, node.attrs))
            node.attrs = {"value": gs.Constant("", np.array(node.attrs[name], dtype=np.float32))}
    return saved


def _replace_folded_nodes(graph: gs.Graph, written_by, constant_nodes: list, *, float_results_as_nodes: bool) -> None:
    """Case 1: gs turns each folded result into an initializer, and detaches it from the
    node that computed it. A float result gets a Constant node in that node's place
    instead (initializers are what training takes for parameters)."""
    nodes = []
    for node, outputs in written_by:
        for tensor in outputs:
            folded = isinstance(tensor, gs.Constant) and all(t is not tensor for t in node.outputs)
            if folded and node.op != "Constant" and float_results_as_nodes and _is_float(tensor):
                values = tensor.values
                tensor.to_variable(dtype=values.dtype, shape=list(values.shape))
                value = gs.Constant(tensor.name, values)
                nodes.append(
                    gs.Node("Constant", name=f"{tensor.name}_folded", attrs={"value": value}, outputs=[tensor])
                )
                constant_nodes.append((nodes[-1], tensor, tensor.dtype, tensor.shape))
        nodes.append(node)
    graph.nodes = nodes


def _is_float(tensor: gs.Constant) -> bool:
    return onnx_dtype(tensor.export_dtype) in FLOAT_TYPES


def _reattach(constant_nodes: list) -> None:
    """Give each Constant node gs lowered to an initializer its output back, typed as before."""
    for node, tensor, dtype, shape in constant_nodes:
        if isinstance(tensor, gs.Constant) and not tensor.inputs and not node.outputs:
            tensor.to_variable()
            tensor.dtype, tensor.shape = dtype, shape
            node.outputs.append(tensor)


# --------------------------------------------------------------------------- case 2: shapes


def _fold_shapes(graph: gs.Graph) -> None:
    here = {id(node) for node in graph.nodes}
    for node in list(graph.nodes):
        if node.op not in ("Shape", "Size") or len(node.outputs) != 1 or isinstance(node.outputs[0], gs.Constant):
            continue
        try:
            dims = _shape_dims(node)
        except (TypeError, ValueError):  # start/end given by a function attribute
            continue
        if dims is None:
            continue
        result = node.outputs[0]
        if all(d is not None for d in dims):  # Size: the element count, static when every dim is
            _make_constant(result, np.array(math.prod(dims) if node.op == "Size" else dims, dtype=np.int64))
            continue
        if node.op == "Size":
            continue
        for consumer in list(result.outputs):
            if id(consumer) in here and consumer.inputs and consumer.inputs[0] is result:
                picked = _pick_dims(consumer, np.array(dims, dtype=object))
                if picked is not None and all(d is not None for d in picked.flat):
                    _make_constant(consumer.outputs[0], picked.astype(np.int64))


def _shape_dims(node: gs.Node) -> list[int | None] | None:
    """What a Shape node returns: ints, None for a symbolic dim; None if the rank is unknown.
    (For a Size node, which has no start or end: every dim of its input.)"""
    shape = node.inputs[0].shape
    if shape is None:
        return None
    dims = [d if isinstance(d, int) and not isinstance(d, bool) and d >= 0 else None for d in shape]
    rank = len(dims)

    def clamp(i: int) -> int:
        return min(max(i + rank if i < 0 else i, 0), rank)

    start = clamp(int(node.attrs.get("start", 0)))
    end = clamp(int(node.attrs["end"])) if node.attrs.get("end") is not None else rank
    return dims[start:end]


def _pick_dims(node: gs.Node, dims: np.ndarray) -> np.ndarray | None:
    """The part of a shape vector a Gather or Slice with constant arguments selects."""
    try:
        if node.op == "Gather" and int(node.attrs.get("axis", 0)) in (0, -1):
            indices = _constant_value(node.inputs[1])
            return None if indices is None else np.asarray(np.take(dims, indices.astype(np.int64)), dtype=object)
        if node.op == "Slice" and 3 <= len(node.inputs) <= 5:
            args = [_constant_value(t) if not t.is_empty() else None for t in node.inputs[1:]]
            starts, ends, axes, steps = [*args, None, None][:4]
            if starts is None or ends is None or starts.size != 1 or ends.size != 1:
                return None
            if (len(node.inputs) > 3 and axes is None) or (len(node.inputs) > 4 and steps is None):
                return None  # not constant
            if axes is not None and axes.reshape(-1).tolist() not in ([0], [-1]):
                return None
            step = 1 if steps is None else int(steps.reshape(-1)[0])
            return dims[int(starts.reshape(-1)[0]) : int(ends.reshape(-1)[0]) : step]
    except (IndexError, TypeError, ValueError):
        return None
    return None


def _constant_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of a constant that is no parameter (initializer or Constant node output), else None."""
    return None if isinstance(tensor, gs.Constant) and is_parameter(tensor) else constant_value(tensor)


def _make_constant(tensor: gs.Tensor, values: np.ndarray) -> None:
    tensor.to_constant(values)
    tensor.inputs.clear()


# --------------------------------------------------------------------------- case 4: sizes


def _too_big(node: gs.Node, limit: int) -> bool:
    """Whether a result of ``node`` is known, before evaluating it, to exceed ``limit`` bytes."""
    sizes = [nbytes(t.shape, t.dtype) for t in node.outputs]
    if node.op in ("Expand", "Tile", "ConstantOfShape") and node.inputs:
        sizes.append(_resultnbytes(node))
    return any(size is not None and size > limit for size in sizes)


def _resultnbytes(node: gs.Node) -> int | None:
    """Size of an Expand/Tile/ConstantOfShape result from its constant shape argument."""
    try:
        if node.op == "ConstantOfShape":
            shape = _argument(node.inputs[0])
            value = node.attrs.get("value")
            dtype = value.dtype if isinstance(value, gs.Constant) else np.float32
            return None if shape is None else nbytes(shape.tolist(), dtype)
        data, argument = node.inputs[0], _argument(node.inputs[1])
        if argument is None or data.shape is None:
            return None
        if node.op == "Expand":
            return nbytes(list(np.broadcast_shapes(tuple(data.shape), tuple(argument.tolist()))), data.dtype)
        return nbytes([d * r for d, r in zip(data.shape, argument.tolist(), strict=True)], data.dtype)
    except (TypeError, ValueError, IndexError):
        return None


def _argument(tensor: gs.Tensor) -> np.ndarray | None:
    """A shape argument's value: an initializer's, or a Constant node's (before gs lowers it)."""
    value = constant_value(tensor)
    return None if value is None else np.asarray(value).reshape(-1)


# --------------------------------------------------------------------------- case 3: parameters


def _hide_parameters(graph: gs.Graph) -> list[tuple[gs.Tensor, object, int | None, object]]:
    """Turn parameter initializers into variables for the duration of folding.

    Keeps gs's stored values (lazy ones stay unloaded: loading converts bfloat16 and float8
    to float32), the data location and the export type, so they come back exactly.
    """
    hidden = []
    seen: set[int] = set()
    for g in every_graph(graph):
        for tensor in g.tensors().values():
            if id(tensor) in seen or not is_parameter(tensor):
                continue
            seen.add(id(tensor))
            hidden.append((tensor, stored_values(tensor), tensor.data_location, stored_export_dtype(tensor)))
            tensor.to_variable(dtype=tensor.dtype, shape=list(tensor.shape))
    return hidden
