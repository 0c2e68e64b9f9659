"""What a node costs: floating-point operations from its shapes, and bytes of tensors.

A cost model for balancing pipeline stages, not a timing model: MatMul, Gemm and Conv
count 2 × multiply-adds (they dominate training steps); every other op counts one
operation per element of its largest input or output (elementwise work, reductions, data
movement). :func:`model_costs` gives each node's bytes moved beside (its inputs and outputs;
none for a view), for a timing that knows an elementwise update is bound by memory. :func:`model_flops` binds the inputs' symbolic dims (``dims``, e.g.
``{"batch": 8, "seq": 64}``; the others as the program fixes them, graphforge.analysis.dims)
and runs ONNX shape inference again, so dims computed inside the graph (batch × seq after a
Reshape) are known too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx_graphsurgeon as gs

from graphforge.analysis.dims import DEFAULT_DIM, bind_inputs, completed
from graphforge.analysis.size import nbytes
from graphforge.errors import InvalidModelError, PassError
from graphforge.graph import Model
from graphforge.ir import ALIASING_OPS
from graphforge.shapes import infer_shapes


def parse_dims(entries) -> dict[str, int]:
    """``["batch=8", "seq=64"]`` -> ``{"batch": 8, "seq": 64}``: the sizes of symbolic dims
    a pass or a command is given."""
    out = {}
    for entry in entries:
        name, sep, value = str(entry).partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise PassError(f"dims entry {entry!r}: write name=size, e.g. batch=8")
        out[name.strip()] = int(value)
    return out


def concrete(shape, dims: Mapping[str, int] | None = None) -> tuple[int, ...] | None:
    """``shape`` with each symbolic dim replaced by ``dims[name]`` (else DEFAULT_DIM; an
    unnamed one by 1); None if the rank is unknown."""
    if shape is None:
        return None
    dims = dims or {}
    out = []
    for d in shape:
        if isinstance(d, int | np.integer) and d >= 0:
            out.append(int(d))
        else:
            out.append(int(dims.get(d, DEFAULT_DIM)) if isinstance(d, str) else 1)
    return tuple(out)


def elements(tensor: gs.Tensor, dims: Mapping[str, int] | None = None) -> int:
    shape = concrete(tensor.shape, dims)
    return math.prod(shape) if shape is not None else 1


def tensor_bytes(tensor: gs.Tensor, dims: Mapping[str, int] | None = None) -> int:
    """Bytes of ``tensor`` with its symbolic dims bound as ``concrete`` does; 0 if its type is unknown."""
    shape = concrete(tensor.shape, dims)
    size = nbytes(shape, tensor.dtype) if shape is not None else None
    return size or 0


def node_flops(node: gs.Node, dims: Mapping[str, int] | None = None) -> int:
    """Floating-point operations of one node (see the module docstring)."""
    outputs = [t for t in node.outputs if not t.is_empty()]
    out = max((elements(t, dims) for t in outputs), default=0)
    if node.op in ("MatMul", "Gemm", "FusedMatMul") and len(node.inputs) >= 2:
        a = concrete(node.inputs[0].shape, dims)
        if a:
            transposed = node.op == "Gemm" and node.attrs.get("transA", 0)
            k = a[0] if transposed and len(a) == 2 else a[-1]
            return 2 * out * k
    if node.op in ("Conv", "ConvTranspose") and len(node.inputs) >= 2:
        w = concrete(node.inputs[1].shape, dims)
        if w and len(w) >= 3:
            group = int(node.attrs.get("group", 1)) or 1
            per_output = math.prod(w[2:]) * (w[1] if node.op == "Conv" else w[0] // group)
            return 2 * (out if node.op == "Conv" else elements(node.inputs[0], dims)) * per_output
    largest_input = max((elements(t, dims) for t in node.inputs if not t.is_empty()), default=0)
    return max(out, largest_input)


#: ops that move no bytes: views of their input, and the ones that read only its shape
_NO_TRAFFIC = ALIASING_OPS | {"Shape", "Size"}


def node_bytes(node: gs.Node, dims: Mapping[str, int] | None = None) -> int:
    """Bytes a node's kernel reads and writes: its inputs and outputs (0 for a view)."""
    if node.op in _NO_TRAFFIC:
        return 0
    return sum(tensor_bytes(t, dims) for t in [*node.inputs, *node.outputs] if not t.is_empty())


def model_flops(model: Model, dims: Mapping[str, int] | None = None) -> dict[int, float]:
    """FLOPs of every node of ``model``'s graph (by node id), with the inputs' symbolic dims
    bound (``dims``, those the program fixes from them, else DEFAULT_DIM) and shapes inferred
    again from them."""
    return {key: flops for key, (flops, _) in model_costs(model, dims).items()}


def model_costs(model: Model, dims: Mapping[str, int] | None = None) -> dict[int, tuple[float, int]]:
    """(FLOPs, bytes moved) of every node of ``model``'s graph (by node id), its dims bound
    as ``model_flops`` binds them."""
    proto = model.to_proto(values=False)
    dims = completed(proto, dims or {})
    bind_inputs(proto, dims)
    del proto.graph.value_info[:]
    try:
        bound = infer_shapes(Model.from_proto(proto))
    except InvalidModelError:  # shapes as they were, symbolic dims as 1
        return {id(n): (float(node_flops(n, dims)), node_bytes(n, dims)) for n in model.graph.nodes}
    return {
        id(original): (float(node_flops(node, dims)), node_bytes(node, dims))
        for original, node in zip(model.graph.nodes, bound.graph.nodes, strict=True)
    }
