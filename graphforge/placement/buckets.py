"""Gradient buckets and the marker calls of the passes that write collectives into a program
(passes/allreduce.py, passes/zero.py): both fill buckets in the order backward makes the
gradients, and both mark a collective by a call of a model-local function whose body is an
Identity, so that the program runs as it is on one process and a runtime with more cuts there."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.analysis.size import nbytes
from graphforge.dag import topological_order
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.program import ProgramRoles


def gradient_buckets(
    model: Model, bucket_mb: float
) -> tuple[dict[str, gs.Tensor], dict[str, gs.Tensor], tuple[tuple[str, ...], ...]]:
    """A program's gradients at the optimizer's boundary (parameter -> tensor), its parameters
    (parameter -> tensor: a gradient has its parameter's shape and type, which the accumulated
    one may have lost), and their buckets of at most ``bucket_mb`` MiB in the order backward
    makes them."""
    program_roles = ProgramRoles.of_model(model)
    tensors = model.graph.tensors()
    boundary = {p: tensors[name] for p, name in program_roles.gradient_boundary.items()}
    gradients = {p: tensors[program_roles.gradients[p]] for p in boundary if p in program_roles.gradients}
    parameters = {p: tensors[p] for p in boundary}
    return boundary, parameters, fill_buckets(ready_order(model.graph, gradients), parameters, bucket_mb)


def ready_order(graph: gs.Graph, gradients: dict[str, gs.Tensor]) -> list[str]:
    """The parameters in the order backward makes their gradients: by the topological
    position of each gradient's producer (a gradient no node makes, a constant, first)."""
    position = {id(graph.nodes[i]): rank for rank, i in enumerate(topological_order(graph))}

    def made_at(p: str) -> int:
        producers = gradients[p].inputs
        return position.get(id(producers[0]), -1) if producers else -1

    return sorted(gradients, key=made_at)


def fill_buckets(order: list[str], parameters: dict[str, gs.Tensor], bucket_mb: float) -> tuple[tuple[str, ...], ...]:
    """Consecutive parameters of ``order`` in buckets of at most ``bucket_mb`` MiB of
    gradients of one element type (a gradient larger than that alone in its own)."""
    limit = bucket_mb * 2**20
    buckets: list[list[str]] = []
    size, dtype = 0.0, None
    for p in order:
        tensor = parameters[p]
        count = nbytes(tensor.shape, tensor.dtype)
        if count is None:
            raise PassError(f"parameter {p!r} has no static shape and type; gradient buckets need its size")
        if not buckets or tensor.dtype != dtype or (size + count > limit and size > 0):
            buckets.append([])
            size, dtype = 0.0, tensor.dtype
        buckets[-1].append(p)
        size += count
    return tuple(tuple(b) for b in buckets)


def marker_call(op: str, source: gs.Tensor, target: gs.Variable, bucket: int, attribute: str = "bucket") -> gs.Node:
    """A call of the marker function ``graphforge.<op>`` from ``source`` to ``target``, its
    bucket (or what ``attribute`` names: the group of a call) as an attribute."""
    return gs.Node(
        op,
        name=f"{target.name}/{op}",
        domain=roles.MARKER_DOMAIN,
        attrs={attribute: bucket},
        inputs=[source],
        outputs=[target],
    )


def marker_function(graph: gs.Graph, op: str, attribute: str = "bucket") -> gs.Function:
    """``graphforge.<op>(x) = Identity(x)``, with the bucket (or what ``attribute`` names: the
    group of a call) as an attribute the body ignores."""
    if any(f.domain == roles.MARKER_DOMAIN and f.name == op for f in graph.functions):
        raise PassError(f"the model already defines {roles.MARKER_DOMAIN}.{op}")
    x, y = gs.Variable("x", dtype=None), gs.Variable("y", dtype=None)
    return gs.Function(
        op,
        domain=roles.MARKER_DOMAIN,
        nodes=[gs.Node("Identity", inputs=[x], outputs=[y])],
        inputs=[x],
        outputs=[y],
        attrs={attribute: None},
        import_domains=[onnx.helper.make_opsetid("", graph.opset or 13)],
    )


def shard_layout(
    buckets: tuple[tuple[str, ...], ...], sizes: dict[str, int], processes: int
) -> list[list[tuple[int, str, int, int]]]:
    """Which elements each of ``processes`` data-parallel processes owns under the zero pass:
    process r holds the r-th contiguous 1/N of every bucket (its parameters' elements laid end
    to end, padded to a multiple of N). Per process, (bucket, parameter, first element, end
    element) of each piece, the elements counted in the parameter flattened."""
    owned: list[list[tuple[int, str, int, int]]] = [[] for _ in range(processes)]
    for index, bucket in enumerate(buckets):
        offsets, total = {}, 0
        for p in bucket:
            offsets[p] = (total, total + sizes[p])
            total += sizes[p]
        chunk = -(-total // processes)
        for rank in range(processes):
            low, high = rank * chunk, (rank + 1) * chunk
            for p, (start, stop) in offsets.items():
                if start < high and stop > low:
                    owned[rank].append((index, p, max(start, low) - start, min(stop, high) - start))
    return owned
