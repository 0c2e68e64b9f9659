"""What the text source reads of the training program: the rows of the embedding the token ids
index (ids past it are refused), the ignore index of the loss (the label of a position not
learned) and the shape of what it scores, and a static sequence length (the default of
data.seq_len)."""

from __future__ import annotations

import onnx

from graphforge.program import BatchInput

#: ops between the ids input and the embedding's Gather that keep each id's value
_CARRIES_IDS = ("Identity", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze")
#: torch's default ignore_index, and the loss pass's
IGNORE_INDEX = -100


def embedding_rows(program: onnx.ModelProto, ids_input: str) -> tuple[int, str] | None:
    """(rows, name) of the table a Gather looks ``ids_input`` up in, following it through ops
    that only reshape or cast it; None where there is no such Gather or its rows are unknown."""
    graph = program.graph
    shapes = {t.name: [d.dim_value if d.HasField("dim_value") else None for d in t.type.tensor_type.shape.dim]
              for t in [*graph.input, *graph.value_info]}  # fmt: skip
    shapes.update({t.name: list(t.dims) for t in graph.initializer})
    carrying = _carrying(graph, ids_input)
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in carrying:
            shape = shapes.get(node.input[0])
            if shape and len(shape) == 2 and shape[0]:
                return int(shape[0]), node.input[0]
    return None


def _carrying(graph: onnx.GraphProto, name: str | None) -> set[str]:
    """``name`` and what only reshapes or casts it (the ids as the embedding reads them, the
    labels as the loss reads them: flattened where the classes lie last, loss(axis=-1))."""
    carrying, changed = {name}, True
    while changed:
        changed = False
        for node in graph.node:
            if node.op_type in _CARRIES_IDS and node.input and node.input[0] in carrying:
                new = set(node.output) - carrying
                carrying |= new
                changed = changed or bool(new)
    return carrying


def _loss_node(graph: onnx.GraphProto, labels: str | None) -> onnx.NodeProto | None:
    """The loss pass's NegativeLogLikelihoodLoss on ``labels``."""
    carrying = _carrying(graph, labels)
    return next(
        (
            n
            for n in graph.node
            if n.op_type == "NegativeLogLikelihoodLoss" and len(n.input) > 1 and n.input[1] in carrying
        ),
        None,
    )


def ignore_index(program: onnx.ModelProto, labels: str | None) -> int | None:
    """The ignore_index of the loss on ``labels`` (the loss pass's NegativeLogLikelihoodLoss);
    None where that loss ignores no label; torch's -100 where the program's loss is another."""
    node = _loss_node(program.graph, labels)
    if node is not None:
        return next((a.i for a in node.attribute if a.name == "ignore_index"), None)
    return IGNORE_INDEX


def scored_shape(program: onnx.ModelProto, labels: str | None) -> tuple[str, list] | None:
    """(name, dims) of the logits the loss on ``labels`` scores (the input of the LogSoftmax
    before its NegativeLogLikelihoodLoss), where the graph says; a dim is a number or a name."""
    graph = program.graph
    made = {out: node for node in graph.node for out in node.output}
    loss = _loss_node(graph, labels)
    softmax = made.get(loss.input[0]) if loss is not None else None
    if softmax is None or softmax.op_type != "LogSoftmax":
        return None
    name = softmax.input[0]
    for t in [*graph.output, *graph.value_info, *graph.input]:
        if t.name == name and t.type.tensor_type.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.type.tensor_type.shape.dim]
            return name, dims
    return None


def sequence_length(spec: BatchInput | None) -> int | None:
    """The ids input's static second dim, where it has one."""
    if spec is None or spec.dims is None or len(spec.dims) < 2:
        return None
    dim = spec.dims[1]
    return dim if isinstance(dim, int) and dim > 0 else None
