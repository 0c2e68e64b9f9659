"""The copy of a model a session runs for one kind of run: only what the run hands on, no
output copies, no second copy of the tensors the caller binds (``lean_model``). Pure model
code: the runner makes its sessions from these, and the memory prediction reads the same
models without making any session."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import onnx
from onnx import helper

from graphforge.errors import GraphforgeError
from graphforge.ir import node_reads
from graphforge.payloads import copy_without_initializers


def lean_model(
    model: onnx.ModelProto, outputs: Sequence[str] | None = None, *, bound: Collection[str] = ()
) -> onnx.ModelProto:
    """A copy of ``model`` that computes the same values with less work, for one kind of run.

    1. Only the graph outputs named in ``outputs`` stay (None: all), and only the nodes
       they need: onnxruntime runs every node of a session on every run, and a graph
       output never shares a buffer, so an output nobody fetches (the forward logits, the
       gradients) costs time and memory.
    2. An Identity that only names a graph output (``P_next = Identity(Sub_out)``) goes:
       its producer writes that output directly. onnxruntime keeps such an Identity, and
       it copies the tensor into the bound output buffer on every run.
    3. The initializers of the inputs in ``bound`` go (the caller always binds them):
       onnxruntime would otherwise hold a second copy of every parameter and state.
    4. A training-mode BatchNormalization reads a copy of a running statistic in ``bound``:
       its onnxruntime kernel aliases each running-statistic output to that input and writes
       it there, which would overwrite the caller's buffer (the value before the step, which
       other nodes may still read and an undone step brings back).
    5. The node that makes the first of ``outputs`` (a training run's loss) comes last in the
       file, when nothing reads it: onnxruntime's default order starts at the last node
       nothing reads and runs what it needs first, so the loss is made right after the
       forward. Elsewhere it would be made after the whole backward, which holds what it
       reads (the log-probabilities, vocabulary-wide for a language model) alive till then.

    The inputs, and the values of the outputs kept, are unchanged.
    """
    source = model.graph
    inputs = {i.name for i in source.input}
    dropped = {t.name for t in source.initializer if t.name in bound and t.name in inputs}
    lean = copy_without_initializers(model)  # the initializers kept are added once the nodes are known
    graph = lean.graph
    if outputs is not None:
        wanted = set(outputs)
        missing = wanted - {o.name for o in graph.output}
        if missing:
            raise GraphforgeError(f"the model has no output {sorted(missing)[0]!r}")
        kept_outputs = [o for o in graph.output if o.name in wanted]
        del graph.output[:]
        graph.output.extend(kept_outputs)
    _drop_dead_nodes(graph)
    _fold_output_identities(graph)
    _copy_inputs_written_in_place(graph, set(bound))
    if outputs:
        _make_first(graph, outputs[0])
    used = {name for node in graph.node for name in node_reads(node)} | {o.name for o in graph.output}
    graph.initializer.extend(
        t for t in source.initializer if t.name not in dropped and (t.name in used or t.name in inputs)
    )
    return lean


def _make_first(graph: onnx.GraphProto, output: str) -> None:
    """Case 5 of lean_model: the node making ``output``, if nothing reads it, moves to the end."""
    index = next((i for i, node in enumerate(graph.node) if output in node.output), None)
    if index is None or index == len(graph.node) - 1:
        return
    made = set(graph.node[index].output)
    if any(made & node_reads(node) for node in graph.node):
        return
    node = onnx.NodeProto()
    node.CopyFrom(graph.node[index])
    del graph.node[index]
    graph.node.append(node)


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove the nodes no graph output needs (ONNX nodes are stored in topological order)."""
    needed = {o.name for o in graph.output}
    alive = []
    for node in reversed(graph.node):
        if any(name in needed for name in node.output):
            alive.append(node)
            needed |= node_reads(node)
    if len(alive) < len(graph.node):
        alive.reverse()
        del graph.node[:]
        graph.node.extend(alive)


def _copy_inputs_written_in_place(graph: onnx.GraphProto, bound: set[str]) -> None:
    """Case 4 of lean_model: BatchNormalization's inputs 3 and 4 (declared Alias(3, 1) and
    Alias(4, 2) by onnxruntime) read through Max(x, x), an exact copy no onnxruntime
    optimization removes (an Identity would be removed), when they are bound inputs."""
    nodes = []
    for node in graph.node:
        training = any(a.name == "training_mode" and a.i for a in node.attribute)
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and training:
            for index in (3, 4):
                written = len(node.output) > index - 2 and node.output[index - 2]
                if index < len(node.input) and node.input[index] in bound and written:
                    source = node.input[index]
                    copy = f"{source}/lean_copy_{len(nodes)}"
                    nodes.append(helper.make_node("Max", [source, source], [copy], name=copy))
                    node.input[index] = copy
        nodes.append(node)
    if len(nodes) > len(graph.node):
        del graph.node[:]
        graph.node.extend(nodes)


def _fold_output_identities(graph: onnx.GraphProto) -> None:
    """Case 2 of lean_model: ``out = Identity(t)`` where ``t`` is made by a node of this
    graph, is no graph output, and no subgraph reads it: the producer writes ``out``."""
    outputs = {o.name for o in graph.output}
    producer = {name: node for node in graph.node for name in node.output if name}
    in_subgraphs = {
        name
        for node in graph.node
        if any(a.HasField("g") or a.graphs for a in node.attribute)
        for name in node_reads(node)
    }
    renames: dict[str, str] = {}
    dropped: set[int] = set()  # indices of the Identity nodes that go
    for index, node in enumerate(graph.node):
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx") or node.output[0] not in outputs:
            continue
        source = node.input[0]
        if source not in producer or source in outputs or source in renames or source in in_subgraphs:
            continue
        renames[source] = node.output[0]
        dropped.add(index)
    if not renames:
        return
    kept = [node for index, node in enumerate(graph.node) if index not in dropped]
    for node in kept:
        for i, name in enumerate(node.output):
            if name in renames:
                node.output[i] = renames[name]
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    del graph.node[:]
    graph.node.extend(kept)
    value_info = [v for v in graph.value_info if v.name not in renames]
    del graph.value_info[:]
    graph.value_info.extend(value_info)
