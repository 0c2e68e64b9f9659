"""Cutting a program into segments, and running segments in sequence.

A **cut** splits one ONNX model at ordered sets of boundary tensors into segments, each a
plain ONNX model. Segment k computes its boundary tensors and whatever they need that
no earlier segment computes; the last segment computes the rest. Every tensor that one segment produces and a later one reads crosses the cut and
is named explicitly in ``Segment.receives`` / ``Segment.sends`` — boundary tensors, and
anything else the later segment needs (a forward activation a backward segment reads).

Data parallelism cuts at the gradients (reduce between the segments), pipeline
parallelism at stage boundaries, the optimizer step at the accumulated gradients: one
mechanism, tested on its own — running the segments in sequence equals the uncut model.
They run through the runtime's one executor (``graphforge.runtime.runner.Runner.execute``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import onnx
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.dag import outer_inputs, topological_order
from graphforge.errors import GraphforgeError
from graphforge.graph import Model
from graphforge.shapes import infer_shapes


@dataclass
class Segment:
    """One piece of a cut program.

    model: a plain ONNX model. inputs: its graph inputs, in order (program inputs and
    received tensors). receives: the tensors it reads from earlier segments. sends: the
    tensors it hands to later segments. outputs: the program outputs it produces.
    """

    index: int
    model: onnx.ModelProto
    inputs: list[str]
    outputs: list[str]
    receives: list[str] = field(default_factory=list)
    sends: list[str] = field(default_factory=list)


def cut(model: Model | onnx.ModelProto, boundaries: Sequence[Sequence[str]]) -> list[Segment]:
    """Split ``model`` after each boundary set; returns len(boundaries) + 1 segments."""
    # crossing tensors become segment inputs and outputs, which need their types
    # (an import made here is this function's own, so the types are written onto it, not onto a copy)
    owned = isinstance(model, onnx.ModelProto)
    model = infer_shapes(Model.from_proto(model) if owned else model, in_place=owned)
    graph = model.graph
    tensors = graph.tensors()
    for i, names in enumerate(boundaries):
        missing = [n for n in names if n not in tensors]
        if missing:
            raise GraphforgeError(f"cut boundary {i + 1} names tensors the model does not have: {', '.join(missing)}")
    nodes = [graph.nodes[i] for i in topological_order(graph)]
    assignment = _assign(nodes, [[tensors[n] for n in names] for names in boundaries])
    producer_segment = {id(t): assignment[id(n)] for n in nodes for t in n.outputs}
    count = len(boundaries) + 1
    graph_inputs = {id(t) for t in graph.inputs}
    output_ids = {id(t): t for t in graph.outputs}

    reads: list[dict[int, gs.Tensor]] = [{} for _ in range(count)]  # tensors each segment reads from outside itself
    for node in nodes:
        k = assignment[id(node)]
        for t in [*node.inputs, *outer_inputs(node)]:
            if t.is_empty() or isinstance(t, gs.Constant):
                continue
            if id(t) in graph_inputs or producer_segment.get(id(t), k) != k:
                reads[k][id(t)] = t
    for t in graph.outputs:  # an output that is a program input is passed through by the last segment
        if id(t) in graph_inputs:
            reads[count - 1][id(t)] = t

    segments = []
    for k in range(count):
        own_nodes = [n for n in nodes if assignment[id(n)] == k]
        crossing = (t for j in range(k + 1, count) for t in reads[j].values() if producer_segment.get(id(t)) == k)
        boundary = [tensors[n] for n in boundaries[k]] if k < len(boundaries) else []
        sends = _unique([*boundary, *crossing])
        outputs = [
            t for t in graph.outputs if producer_segment.get(id(t), count - 1) == k and id(t) not in graph_inputs
        ]
        if k == count - 1:
            outputs += [t for t in graph.outputs if id(t) in graph_inputs]
        received = [t for t in reads[k].values() if id(t) not in graph_inputs]
        program_inputs = [t for t in graph.inputs if id(t) in reads[k]]
        seg_outputs = _unique([*outputs, *sends])
        seg_model = segment_model(model, own_nodes, [*program_inputs, *received], seg_outputs, f"segment{k}")
        overridable = restore_initializer_inputs(seg_model, model)
        segments.append(
            Segment(
                index=k,
                model=seg_model,
                inputs=[*(t.name for t in program_inputs), *overridable, *(t.name for t in received)],
                outputs=[t.name for t in outputs if id(t) in output_ids],
                receives=[t.name for t in received],
                sends=[t.name for t in sends],
            )
        )
    return segments


def _assign(nodes: list[gs.Node], boundaries: list[list[gs.Tensor]]) -> dict[int, int]:
    """Segment index per node: the first boundary it is needed for, else the last segment."""
    producer = {id(t): n for n in nodes for t in n.outputs}
    assignment: dict[int, int] = {}
    for k, boundary in enumerate(boundaries):
        stack = [producer[id(t)] for t in boundary if id(t) in producer]
        while stack:  # iterative: programs are deep
            node = stack.pop()
            if id(node) in assignment:
                continue
            assignment[id(node)] = k
            for t in [*node.inputs, *outer_inputs(node)]:
                p = producer.get(id(t))
                if p is not None and id(p) not in assignment:
                    stack.append(p)
    last = len(boundaries)
    for node in nodes:
        assignment.setdefault(id(node), last)
    return assignment


def _unique(tensors) -> list[gs.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def segment_model(model: Model, nodes, inputs, outputs, label: str) -> onnx.ModelProto:
    """A plain ONNX model of ``nodes`` (of ``model``'s graph) with ``inputs`` and ``outputs``
    (typed tensors), named after the model and ``label``."""
    graph = model.graph
    sub = gs.Graph(
        nodes=list(nodes),
        inputs=list(inputs),
        outputs=list(outputs),
        name=f"{graph.name}_{label}",
        opset=graph.opset,
        import_domains=graph.import_domains,
        functions=graph.functions,
        ir_version=graph.ir_version,
    )
    for t in [*inputs, *outputs]:
        if t.dtype is None:
            raise GraphforgeError(
                f"tensor {t.name!r} crosses a cut but its type is unknown; run shape inference before cutting"
            )
    proto = gs.export_onnx(sub, do_type_check=False)
    if roles.FUSION in model.metadata:  # facts about the nodes, true of any part: a session checks them
        proto.metadata_props.add(key=roles.FUSION, value=model.metadata[roles.FUSION])
    return proto


def restore_initializer_inputs(segment: onnx.ModelProto, model: Model) -> list[str]:
    """Keep the program's overridable initializers (parameters, buffers: initializers that
    are graph inputs too) overridable in the segment: graphsurgeon sees them as constants,
    so the segment would otherwise bake in their initial values. Returns their names."""
    initializers = {t.name: t for t in segment.graph.initializer}
    names = [n for n in model.initializer_inputs if n in initializers]
    for name in names:
        tensor = initializers[name]
        segment.graph.input.append(onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
    return names
