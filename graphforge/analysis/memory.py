"""Peak memory of one onnxruntime run of a model: liveness in the order onnxruntime runs it.

The order. onnxruntime's sequential executor runs a session's nodes in its graph viewer's
default order (``ExecutionOrder::DEFAULT``, core/graph/graph_viewer.cc): a depth-first walk
up from the nodes no other node reads, the walk starting at the leaf of the highest node
index and, at each node, going first to the producer of the highest index; a node runs once
every producer it reads has run (post-order). A node's index is its position in the file.
So the order is lazy: a node runs just before the first node that needs it in that walk,
which is what lets a recomputed activation be made late, next to its backward reader.
(onnxruntime's own graph optimizations fuse a few nodes first; the walk is made on the
model as written, and ``tests/analysis/test_memory.py`` checks it against onnxruntime's
profile.)

What is live. A tensor a node makes is allocated when the node runs and freed after the
last node that reads it, as onnxruntime's allocation planner does; a graph output stays
to the end. Ops whose kernels alias their input (Reshape, Squeeze, Unsqueeze, Flatten,
Identity) allocate nothing: their output extends their input's life. Persistent memory
comes on top: the carried tensors the runtime binds (one or two buffers each, see
``slots``), the model's own constants, and the batch inputs.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import onnx
from onnx import numpy_helper

from graphforge.analysis.dims import bind_inputs, completed
from graphforge.analysis.size import nbytes
from graphforge.constants import CONSTANT_ELEMENTS, evaluate, shape_value
from graphforge.errors import InvalidModelError
from graphforge.ir import ALIASING_OPS, node_reads
from graphforge.payloads import copy_without_initializers
from graphforge.program import CarriedSpec, ProgramRoles
from graphforge.roles import node_origin
from graphforge.stand_ins import copy_leaving_values_out, is_stand_in

#: the parts a peak is split into, in the order reports show them
CATEGORIES = (
    "parameters",
    "optimizer states",
    "gradients",
    "saved activations",
    "temporaries",
    "inputs",
    "constants",
)
#: ops whose kernels read and write each element at the same index, so that the runtime may
#: bind the output to the buffer of an input of the same shape: each element is read before
#: it is overwritten (whether onnxruntime itself reuses the buffer is MAY_IN_PLACE's question)
ELEMENTWISE_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Reciprocal", "Where", "Max", "Min", "Sum", "Clip", "Relu"}
)
#: carried roles and the part of the peak they are
_CARRIED_CATEGORY = {
    "parameter": "parameters",
    "buffer": "parameters",
    "optimizer": "optimizer states",
    "accumulator": "gradients",
}


def execution_order(graph: onnx.GraphProto) -> list[int]:
    """Indices of ``graph.node`` in the order onnxruntime's sequential executor runs them
    (see the module docstring)."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    producers: list[list[int]] = []
    consumed = [False] * len(graph.node)
    for node in graph.node:
        found = sorted({producer[name] for name in node_reads(node) if name in producer})
        for j in found:
            consumed[j] = True
        producers.append(found)
    stack: list[tuple[int, bool]] = [(i, False) for i in range(len(graph.node)) if not consumed[i]]
    visited = [False] * len(graph.node)
    order: list[int] = []
    while stack:
        index, leaving = stack.pop()
        if leaving:
            order.append(index)
            continue
        if visited[index]:
            continue
        visited[index] = True
        stack.append((index, True))
        stack.extend((j, False) for j in producers[index] if not visited[j])
    return order


def in_place_safety(model: onnx.ModelProto, pairs: Mapping[str, str]) -> dict[str, str]:
    """Which of ``pairs`` (graph input -> the graph output that replaces it) may NOT share one
    buffer in a run of ``model``, each with the reason. One buffer is safe when the node
    writing the output (1) is elementwise (ELEMENTWISE_OPS) wherever it reads the input,
    the output having the input's shape, and (2) is a descendant of every other node that
    reads the input or a view of it (ALIASING_OPS): then any topological order, the one
    onnxruntime picks included, runs those readers before the buffer is overwritten."""
    graph = model.graph
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    readers: dict[str, list[int]] = defaultdict(list)
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(graph.node)))
    for i, node in enumerate(graph.node):
        for name in node_reads(node):
            readers[name].append(i)
            if name in producer:
                dag.add_edge(producer[name], i)
    refused = {}
    for source, target in pairs.items():
        writer = producer.get(target)
        if writer is None:
            refused[source] = f"no node of the model writes {target!r}"
            continue
        views, todo = {source}, [source]
        while todo:
            for i in readers[todo.pop()]:
                node = graph.node[i]
                if _aliases(node) and node.input[0] in views:
                    todo += [o for o in node.output if o and o not in views]
                    views.update(o for o in node.output if o)
        node = graph.node[writer]
        if views & set(node_reads(node)) and (
            node.op_type not in ELEMENTWISE_OPS or node.domain not in ("", "ai.onnx")
        ):
            refused[source] = f"{node.name or node.op_type} ({node.op_type}) reads it while writing {target!r}"
            continue
        others = {i for name in views for i in readers[name]} - {writer}
        if others:
            before = nx.ancestors(dag, writer)
            late = sorted(others - before)
            if late:
                reader = graph.node[late[0]]
                refused[source] = (
                    f"{reader.name or reader.op_type} reads it and need not run before "
                    f"{node.name or node.op_type}, which writes {target!r}"
                )
    return refused


#: ops whose onnxruntime CPU kernels write their output over an input they read for the last
#: time, of the same size (declared MayInplace), so the planner allocates nothing for it.
#: Measured, not read from the schema: the activations, Clip, Softmax and ScatterElements do;
#: Add, Sub, Mul, Div, Pow, Sqrt, Exp, Log, Neg, Abs, Reciprocal, Erf, Where and ScatterND do
#: not, so each of those takes a new buffer while its input is still live (a chain of them
#: needs two). ``tests/analysis/test_memory.py`` checks this table against onnxruntime.
MAY_IN_PLACE: dict[str, tuple[int, ...]] = {
    op: (0,)
    for op in (
        "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "Sigmoid", "HardSigmoid", "Tanh", "Softplus",
        "Softsign", "ThresholdedRelu", "Clip", "Softmax", "LogSoftmax", "ScatterElements",
    )
}  # fmt: skip


def _reusable_input(node, owner, last_read, transient, sizes, outputs, step) -> str | None:
    """The buffer ``node``'s output may take over (MAY_IN_PLACE), or None: never for a graph output."""
    slots = MAY_IN_PLACE.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if not slots or not node.output or node.output[0] not in sizes or node.output[0] in outputs:
        return None
    for slot in slots:
        name = node.input[slot] if slot < len(node.input) else ""
        root = owner.get(name)
        last = root in transient and last_read.get(root, -1) <= step
        if last and sizes.get(root) == sizes[node.output[0]] and sum(owner.get(n) == root for n in node.input) == 1:
            return root
    return None


def _same_type_cast(node: onnx.NodeProto, elem: Mapping[str, int]) -> bool:
    """A Cast to the type its input has: onnxruntime's CastElimination removes it."""
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or not node.input:
        return False
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    return to is not None and elem.get(node.input[0]) == to


def _fused_into_matmul(node: onnx.NodeProto, readers: Mapping[str, list[onnx.NodeProto]], outputs: set[str]) -> bool:
    """A Transpose of the last two axes read only by MatMuls: onnxruntime's
    MatmulTransposeFusion (CPU and CUDA) folds it into their FusedMatMul, so its result is
    never made (how ``MatMul(h, Transpose(W))``, an exported Linear layer, runs)."""
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or not node.input or node.output[0] in outputs:
        return False
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    if not perm or perm[-2:] != [len(perm) - 1, len(perm) - 2] or perm[:-2] != list(range(len(perm) - 2)):
        return False
    users = readers.get(node.output[0], [])
    return bool(users) and all(u.op_type == "MatMul" and u.domain in ("", "ai.onnx") for u in users)


def _aliases(node: onnx.NodeProto) -> bool:
    return node.op_type in ALIASING_OPS and node.domain in ("", "ai.onnx") and bool(node.input) and bool(node.input[0])


def tensor_sizes(model: onnx.ModelProto, dims: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes of every tensor of ``model``'s main graph whose shape ONNX inference finds once
    the inputs' symbolic dims are bound (``dims`` by name, those the program fixes from them,
    else DEFAULT_DIM: graphforge.analysis.dims)."""
    return {name: size for name, (size, _) in tensor_types(model, dims).items() if size is not None}


def tensor_types(model: onnx.ModelProto, dims: Mapping[str, int] | None = None) -> dict[str, tuple[int | None, int]]:
    """(bytes or None, ONNX element type) of every tensor of ``model``'s main graph whose
    type ONNX inference finds, the inputs' symbolic dims bound as ``tensor_sizes`` does."""
    dims = dict(dims or {})
    proto = copy_leaving_values_out(model)
    if proto is None:
        proto = copy_without_initializers(model)
        proto.graph.initializer.extend(model.graph.initializer)
    bind_inputs(proto, completed(proto, dims))
    inferred = _infer(proto)
    for _ in range(SHAPE_ROUNDS):
        folded = _fold_shape_values(proto, inferred)
        if not folded:
            break
        inferred = _infer(proto)
    graph = inferred.graph
    types = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        if value.type.HasField("tensor_type"):
            types[value.name] = (_value_bytes(value.type), value.type.tensor_type.elem_type)
    for tensor in [*proto.graph.initializer, *model.graph.initializer]:  # folded values too
        types[tensor.name] = (nbytes(list(tensor.dims), tensor.data_type), tensor.data_type)
    return types


def dims_of(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The size of each symbolic dim of ``model``'s inputs in the arrays ``feeds`` gives them."""
    dims = {}
    for value in model.graph.input:
        array = feeds.get(value.name)
        if array is None:
            continue
        for d, size in zip(value.type.tensor_type.shape.dim, np.shape(array), strict=False):
            if d.dim_param:
                dims[d.dim_param] = int(size)
    return dims


#: how many times shape values are folded and shapes inferred again (a Range of a folded
#: Shape, then a Reshape of its result, ...)
SHAPE_ROUNDS = 4
#: the ops whose small integer results are folded when their inputs are known
_SHAPE_OPS = frozenset(
    {
        "Shape", "Size", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Range", "Add",
        "Sub", "Mul", "Div", "Equal", "Less", "Greater", "Where", "Not", "ConstantOfShape", "Expand",
        "Reshape", "Min", "Max", "Neg", "Abs", "ReduceProd", "Identity", "Constant",
    }
)  # fmt: skip


def _infer(proto: onnx.ModelProto) -> onnx.ModelProto:
    del proto.graph.value_info[:]
    try:
        return onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        raise InvalidModelError(f"shape inference failed: {str(exc).strip().splitlines()[0]}") from None


def _fold_shape_values(proto: onnx.ModelProto, inferred: onnx.ModelProto) -> int:
    """Replace, in ``proto``, the nodes that compute small integer values from shapes that
    are now concrete (``Shape`` of a tensor of known shape, and what is computed from such
    values: a Range of positions, a Reshape's target) by initializers of their values, which
    ONNX's inference then reads (its data propagation stops at Range, for one); returns how
    many nodes went. A value larger than CONSTANT_ELEMENTS is left to shape inference. Values
    are computed one node at a time by graphforge.constants (its reference evaluator)."""
    known_shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
        if v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)
    }
    values = {
        t.name: numpy_helper.to_array(t)
        for t in proto.graph.initializer
        if not is_stand_in(t) and t.data_type != onnx.TensorProto.FLOAT and math.prod(t.dims) <= CONSTANT_ELEMENTS
    }
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 17)
    kept, folded = [], {}
    for node in proto.graph.node:
        value = _shape_op_value(node, known_shapes, values, opset)
        if value is not None and value.size <= CONSTANT_ELEMENTS and value.dtype != np.float32:
            values[node.output[0]] = folded[node.output[0]] = value
        else:
            kept.append(node)
    if folded:
        del proto.graph.node[:]
        proto.graph.node.extend(kept)
        proto.graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in folded.items())
    return len(folded)


def _shape_op_value(
    node: onnx.NodeProto, known_shapes: Mapping[str, list[int]], values: Mapping[str, np.ndarray], opset: int
) -> np.ndarray | None:
    """The value of a node of _SHAPE_OPS with one output: a Shape of a tensor whose shape is
    in ``known_shapes``, any other when ``values`` holds every input it reads; else None."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in _SHAPE_OPS or len(node.output) != 1:
        return None
    if node.op_type == "Shape":
        if node.input[0] not in known_shapes:
            return None
        attributes = {a.name: a.i for a in node.attribute if a.name in ("start", "end")}
        return shape_value("Shape", known_shapes[node.input[0]], attributes.get("start", 0), attributes.get("end"))
    if not all(not name or name in values for name in node.input):
        return None
    return evaluate([node], {name: values[name] for name in node.input if name}, node.output[0], opset)


@dataclass(frozen=True)
class LiveTensor:
    name: str
    bytes: int
    category: str


@dataclass
class MemoryReport:
    """The predicted memory of one run: what persists (carried buffers, constants,
    inputs), the transient bytes live after each node in execution order, split by
    category, and the peak with the tensors live there (largest first)."""

    order: list[str]
    persistent: dict[str, int]
    timeline: list[dict[str, int]]
    peak: int
    peak_node: str | None
    at_peak: list[LiveTensor]
    #: tensors whose size is unknown (counted as 0)
    unknown: list[str] = field(default_factory=list)
    #: each transient allocation: (the step it is made at, the step after which it is freed, bytes)
    allocations: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def persistent_bytes(self) -> int:
        return sum(self.persistent.values())

    @property
    def transient_peak(self) -> int:
        return self.peak - self.persistent_bytes

    def breakdown(self) -> dict[str, int]:
        """Bytes per category at the peak, persistent memory included."""
        out = dict.fromkeys(CATEGORIES, 0)
        for category, size in self.persistent.items():
            out[category] += size
        for tensor in self.at_peak:
            out[tensor.category] += tensor.bytes
        return out


def predict(
    model: onnx.ModelProto,
    *,
    dims: Mapping[str, int] | None = None,
    carried: Sequence[CarriedSpec] = (),
    slots: Mapping[str, int] | None = None,
    external: Sequence[str] = (),
    types: Mapping[str, tuple[int | None, int]] | None = None,
    specialized: bool = False,
) -> MemoryReport:
    """The memory one run of ``model`` needs on onnxruntime (see the module docstring).

    ``carried``: the tensors the runtime binds to buffers of its own, persistent across runs;
    ``slots``: how many buffers each has (default 2, the ping-pong; 1 when updated in place).
    ``external``: inputs and outputs in buffers the caller holds for good (counted by the caller).
    ``types``: ``tensor_types`` when the caller has them (else inferred with ``dims``).
    ``specialized``: the session is made for these dims (Runner.session), so onnxruntime folds
    a Shape or Size of a tensor of known shape into a constant, which then reads nothing."""
    graph = model.graph
    types = dict(types) if types is not None else tensor_types(model, dims)
    sizes = {name: size for name, (size, _) in types.items() if size is not None}
    elem = {name: code for name, (_, code) in types.items()}
    persistent = persistent_bytes(graph, carried, dict(slots or {}), external, sizes)
    # what the run writes into buffers it does not allocate: the carried tensors' and the caller's
    held = {spec.output for spec in carried} | set(external)
    order = execution_order(graph)
    folded = _folded_shape_reads(graph, sizes) if specialized else set()
    reads = last_reads(graph, order, folded)
    buffers = buffer_owners(graph, order, folded, reads, sizes, elem, held)
    allocations, unknown = transient_allocations(graph, order, buffers, sizes, held, _gradient_names(model))
    timeline, peak_step, peak_transient = live_bytes(allocations, len(order))
    at_peak = sorted(
        (
            LiveTensor(name, size, category)
            for name, (start, stop, category, size) in allocations.items()
            if start <= peak_step <= stop and size
        ),
        key=lambda t: -t.bytes,
    )
    names = [graph.node[i].name or f"{graph.node[i].op_type}#{i}" for i in order]
    return MemoryReport(
        order=names,
        persistent={k: v for k, v in persistent.items() if v},
        timeline=timeline,
        peak=sum(persistent.values()) + peak_transient,
        peak_node=names[peak_step] if names else None,
        at_peak=at_peak,
        unknown=unknown,
        allocations=[(start, min(stop, len(order)), size) for start, stop, _, size in allocations.values() if size],
    )


def persistent_bytes(
    graph: onnx.GraphProto,
    carried: Sequence[CarriedSpec],
    slots: Mapping[str, int],
    external: Sequence[str],
    sizes: Mapping[str, int],
) -> dict[str, int]:
    """Bytes per category (every one of CATEGORIES) of what outlives the run: the carried
    tensors' buffers (``slots`` each, default 2), the model's other constants, and the batch
    inputs that are not ``external``."""
    by_input = {spec.input for spec in carried}
    initializers = {t.name for t in graph.initializer}
    persistent = dict.fromkeys(CATEGORIES, 0)
    for spec in carried:
        size = nbytes(spec.shape, np.dtype(spec.dtype)) or 0
        persistent[_CARRIED_CATEGORY.get(spec.role, "parameters")] += size * slots.get(spec.input, 2)
    for name in initializers - by_input:
        persistent["constants"] += sizes.get(name, 0)
    for value in graph.input:
        if value.name not in by_input and value.name not in initializers and value.name not in external:
            persistent["inputs"] += sizes.get(value.name, 0)
    return persistent


def _folded_shape_reads(graph: onnx.GraphProto, sizes: Mapping[str, int]) -> set[int]:
    """The Shape and Size nodes a session specialized to the run's dims makes constants: they
    read nothing (their input's shape is known)."""
    return {
        i
        for i, node in enumerate(graph.node)
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx") and node.input[0] in sizes
    }


@dataclass
class Reads:
    """Who reads each tensor in a run, in execution order (``last_reads``)."""

    #: the last step that reads each tensor (a graph output: the step after the last)
    last: dict[str, int]
    #: the nodes that read each tensor, in execution order
    readers: dict[str, list[onnx.NodeProto]]


def last_reads(graph: onnx.GraphProto, order: Sequence[int], folded: set[int]) -> Reads:
    """Who reads each tensor of ``graph`` run in ``order`` (``folded``: nodes that read nothing)."""
    last: dict[str, int] = dict.fromkeys((o.name for o in graph.output), len(order))  # outputs live to the end
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for step, index in enumerate(order):
        for name in node_reads(graph.node[index]) if index not in folded else ():
            last[name] = max(last.get(name, -1), step)
            readers[name].append(graph.node[index])
    return Reads(last, readers)


@dataclass
class Buffers:
    """Whose buffer each tensor of a run is, and how long each buffer lives (``buffer_owners``)."""

    #: tensor -> the tensor whose buffer holds it (itself, its input's for a view or an in-place result)
    owner: dict[str, str]
    #: buffer -> the last step that reads it
    last_read: dict[str, int]
    #: buffers the backward or the optimizer read
    read_in_backward: set[str]


def buffer_owners(
    graph: onnx.GraphProto,
    order: Sequence[int],
    folded: set[int],
    reads: Reads,
    sizes: Mapping[str, int],
    elem: Mapping[str, int],
    held: set[str],
) -> Buffers:
    """Whose buffer each tensor is: a view's is its input's (ALIASING_OPS, a Cast to its own
    type, a Transpose fused into its MatMuls), an in-place result's its input's when that
    input is a buffer of this run read for the last time (MAY_IN_PLACE); every other tensor
    has its own, allocated by the run unless it is ``held`` elsewhere. And the last step that
    reads each buffer, through any tensor it holds."""
    outputs = {o.name for o in graph.output}
    owner: dict[str, str] = {}
    last_read: dict[str, int] = {}
    read_in_backward: set[str] = set()
    transient: set[str] = set()  # buffers this run allocates
    for step, index in enumerate(order):
        node = graph.node[index]
        read = node_reads(node) if index not in folded else set()
        if _phase(node) in ("grad", "optim"):
            read_in_backward.update(owner.get(name, name) for name in read)
        reuse = _reusable_input(node, owner, last_read, transient, sizes, outputs, step)
        if _aliases(node) or _same_type_cast(node, elem) or _fused_into_matmul(node, reads.readers, outputs):
            reuse = owner.get(node.input[0], node.input[0])
        for out in node.output:
            if not out:
                continue
            if reuse is not None and out == node.output[0]:
                owner[out] = reuse
            else:
                owner[out] = out
                if out not in held:
                    transient.add(out)
            root = owner[out]
            last_read[root] = max(last_read.get(root, step), reads.last.get(out, step))
        for name in read:
            root = owner.get(name, name)
            last_read[root] = max(last_read.get(root, -1), step)
    return Buffers(owner, last_read, read_in_backward)


def transient_allocations(
    graph: onnx.GraphProto,
    order: Sequence[int],
    buffers: Buffers,
    sizes: Mapping[str, int],
    held: set[str],
    gradients: set[str],
) -> tuple[dict[str, tuple[int, int, str, int]], list[str]]:
    """Each buffer the run allocates, by its tensor: (the step it is made at, the last step it
    lives, its category, bytes); a graph output, or a buffer one is a view of, lives to the end.
    And the tensors whose size is unknown (counted as 0)."""
    outputs = {o.name for o in graph.output}
    owner, end = buffers.owner, len(order)
    allocations: dict[str, tuple[int, int, str, int]] = {}
    unknown = []
    for step, index in enumerate(order):
        node = graph.node[index]
        for out in node.output:
            if not out or owner.get(out) != out or out in held:  # (held: written into another's buffer)
                continue
            size = sizes.get(out)
            if size is None:
                unknown.append(out)
                size = 0
            aliases_out = any(owner.get(o) == out for o in outputs)
            stop = end if out in outputs or aliases_out else buffers.last_read.get(out, step)
            category = _category(out, _phase(node), gradients, buffers.read_in_backward)
            allocations[out] = (step, stop, category, size)
    return allocations, unknown


def live_bytes(
    allocations: Mapping[str, tuple[int, int, str, int]], steps: int
) -> tuple[list[dict[str, int]], int, int]:
    """A sweep over ``allocations``' starts and stops (``transient_allocations``): the bytes
    live after each of ``steps`` steps, per category; the first step where their sum peaks,
    and that sum."""
    delta = [dict.fromkeys(CATEGORIES, 0) for _ in range(steps + 2)]
    for start, stop, category, size in allocations.values():
        delta[start][category] += size
        delta[min(stop, steps) + 1][category] -= size
    live = dict.fromkeys(CATEGORIES, 0)
    timeline, peak_step, peak_transient = [], -1, 0
    for step in range(max(steps, 1)):
        for category in CATEGORIES:
            live[category] += delta[step][category]
        timeline.append(dict(live))
        total = sum(live.values())
        if total > peak_transient or peak_step < 0:
            peak_step, peak_transient = step, total
    return timeline, peak_step, peak_transient


#: onnxruntime's BFC arena (core/framework/bfc_arena.cc), as configured by default: every
#: allocation rounded up to a multiple of 256 bytes; regions of 1 MiB, then each twice the
#: last (kNextPowerOfTwo) or the request if larger; a free chunk handed out whole unless it is
#: at least twice the request or would leave 128 MiB or more (max_dead_bytes_per_chunk)
ARENA_ALIGNMENT = 256
ARENA_FIRST_REGION = 2**20
ARENA_MAX_DEAD = 128 * 2**20


def arena_high_water(runs: Sequence[Sequence[tuple[int, int, int]]], *, rounds: int = 2) -> int:
    """The memory onnxruntime's arena touches serving ``runs`` one after another, ``rounds``
    times (the arena outlives a step): each run's allocations (``MemoryReport.allocations``)
    made and freed in step order, placed in the smallest free chunk that fits (coalesced with
    freed neighbours, split by the arena's rule, see ARENA_*), a new region when none fits.
    Freed memory stays touched (resident), so the sum of each region's high-water mark is
    what the arena holds: the live peak where later tensors fit the holes earlier ones left,
    more where they do not."""
    chunks: list[list[int]] = []  # free chunks: [region, offset, size], by region and offset
    touched: list[int] = []  # per region: the highest byte ever handed out
    sizes: list[int] = []  # per region: its size
    next_region = ARENA_FIRST_REGION
    for _ in range(rounds):
        for allocations in runs:
            steps = max((stop for _, stop, _ in allocations), default=-1) + 1
            made: list[list[int]] = [[] for _ in range(steps)]
            freed: list[list[int]] = [[] for _ in range(steps)]
            for index, (start, stop, _) in enumerate(allocations):
                made[start].append(index)
                freed[stop].append(index)
            where: dict[int, tuple[int, int, int]] = {}
            for step in range(steps):
                for index in made[step]:
                    size = -(-allocations[index][2] // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
                    fits = [chunk for chunk in chunks if chunk[2] >= size]
                    if not fits:  # a new region
                        region_size = max(next_region, size)
                        next_region *= 2
                        sizes.append(region_size)
                        touched.append(0)
                        chunk = [len(sizes) - 1, 0, region_size]
                        chunks.append(chunk)
                    else:
                        chunk = min(fits, key=lambda c: (c[2], c[0], c[1]))
                    region, offset, available = chunk
                    chunks.remove(chunk)
                    if available >= 2 * size or available - size >= ARENA_MAX_DEAD:
                        _release(chunks, region, offset + size, available - size)
                        available = size
                    touched[region] = max(touched[region], offset + size)
                    where[index] = (region, offset, available)
                for index in freed[step]:
                    _release(chunks, *where.pop(index))
            for held in where.values():  # what a run hands out is freed by its end
                _release(chunks, *held)
    return sum(touched)


def _release(chunks: list[list[int]], region: int, offset: int, size: int) -> None:
    """Give back a chunk, merged with the free chunks beside it in its region."""
    position = bisect.bisect_left(chunks, [region, offset, 0])
    chunks.insert(position, [region, offset, size])
    after = position + 1
    if after < len(chunks) and chunks[after][0] == region and offset + size == chunks[after][1]:
        chunks[position][2] += chunks.pop(after)[2]
    before = position - 1
    if position and chunks[before][0] == region and chunks[before][1] + chunks[before][2] == offset:
        chunks[before][2] += chunks.pop(position)[2]


def _phase(node: onnx.NodeProto) -> str:
    origin = node_origin(node.name)
    return origin[0] if origin else "forward"


def _category(name: str, phase: str, gradients: set[str], read_in_backward: set[str]) -> str:
    if name in gradients:
        return "gradients"
    if phase in ("forward", "recompute") and name in read_in_backward:
        return "saved activations"
    return "temporaries"


def _gradient_names(model: onnx.ModelProto) -> set[str]:
    """The parameter gradients the program names: its ``<P>_grad`` outputs and what they
    copy, and the tensors at the optimizer's gradient boundary."""
    roles = ProgramRoles.of_proto(model)
    names = set(roles.gradients.values()) | set(roles.gradient_boundary.values())
    for node in model.graph.node:  # a gradient output is often an Identity of the tensor backward made
        if node.op_type == "Identity" and node.output and node.output[0] in names and node.input:
            names.add(node.input[0])
    return names


def _value_bytes(type_proto: onnx.TypeProto) -> int | None:
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    dims = type_proto.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return nbytes([d.dim_value for d in dims], type_proto.tensor_type.elem_type)
