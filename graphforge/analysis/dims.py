"""The sizes of a program's symbolic input dims, from the few a caller knows.

A caller of the cost and memory models knows the dims of the batch it feeds (``batch``,
``seq``), not those of inputs the passes added: the loss pass's ``labels`` take the symbolic
dims the logits had in the export (``rows`` for logits flattened to [batch × seq, vocab]).
Sized by default, such a dim makes the labels disagree with the logits they meet, shape
inference gives up on everything downstream, and the backward of the output projection is
counted as if it were empty. The program says the size itself: once the known dims are bound,
inference gives the logits a concrete shape where the program's annotation says ``rows``.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

#: the size a symbolic input dim takes when neither the caller nor the program says it
DEFAULT_DIM = 8


def input_dim_params(proto: onnx.ModelProto) -> set[str]:
    """The named symbolic dims of ``proto``'s graph inputs (initializers left out)."""
    initializers = {t.name for t in proto.graph.initializer}
    return {
        d.dim_param
        for value in proto.graph.input
        if value.name not in initializers
        for d in value.type.tensor_type.shape.dim
        if d.dim_param
    }


def bind_inputs(proto: onnx.ModelProto, dims: Mapping[str, int]) -> None:
    """Give every symbolic dim of ``proto``'s inputs its size in place: ``dims[name]``, else
    DEFAULT_DIM; an unnamed one 1."""
    for value in proto.graph.input:
        for d in value.type.tensor_type.shape.dim:
            if d.HasField("dim_param") or not d.HasField("dim_value"):
                size = int(dims.get(d.dim_param, DEFAULT_DIM)) if d.dim_param else 1
                d.Clear()
                d.dim_value = size


def completed(proto: onnx.ModelProto, dims: Mapping[str, int]) -> dict[str, int]:
    """``dims`` with the size of each other symbolic input dim of ``proto`` that the program
    itself fixes once ``dims`` are bound: a dim named in a tensor's annotation (its
    ``value_info``, a graph output) where ONNX inference, from the inputs bound by ``dims``,
    finds a single concrete size. A dim found with two sizes, or none, stays out (its
    callers size it DEFAULT_DIM)."""
    dims = dict(dims)
    missing = input_dim_params(proto) - set(dims)
    if not missing:
        return dims
    named = {}
    for value in [*proto.graph.value_info, *proto.graph.output]:
        for i, d in enumerate(value.type.tensor_type.shape.dim):
            if d.dim_param in missing:
                named.setdefault(value.name, []).append((i, d.dim_param))
    if not named:
        return dims
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)  # (callers pass protos without values: cheap)
    del probe.graph.value_info[:]
    bound = set(dims)
    for value in probe.graph.input:  # only the known dims: the others stay symbolic
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in bound:
                size = int(dims[d.dim_param])
                d.Clear()
                d.dim_value = size
    for value in probe.graph.output:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in missing:
                d.Clear()  # unknown, so that inference is free to say
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, data_prop=True)
    except onnx.shape_inference.InferenceError:
        return dims
    found: dict[str, set[int]] = {}
    for value in [*inferred.graph.value_info, *inferred.graph.output]:
        shape = value.type.tensor_type.shape.dim
        for i, param in named.get(value.name, ()):
            if i < len(shape) and shape[i].HasField("dim_value") and shape[i].dim_value > 0:
                found.setdefault(param, set()).add(int(shape[i].dim_value))
    dims.update({param: sizes.pop() for param, sizes in found.items() if len(sizes) == 1})
    return dims
