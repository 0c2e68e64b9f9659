"""Tensor parallelism's marker calls, Megatron-LM's f and g (graphforge.TensorParallelCopy and
graphforge.TensorParallelReduce): an Identity each on one process, and the gradient of either
is a call of the other, so autodiff writes the backward's collectives where the forward's split
needs them. f marks the input of a layer split across a group (every member reads the same
value): the members' gradients of it are partial, summed over the group. g marks a partial
output summed over the group: each member's gradient of its part is the gradient of the sum.
graphforge.TensorParallelMax (the vocabulary-parallel softmax's shift) has no gradient: the
loss does not depend on the shift."""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES, Rule

from graphforge import roles
from graphforge.placement.buckets import marker_function

#: each marker's gradient is a call of the other
_GRADIENT_OF = {
    roles.TENSOR_PARALLEL_COPY_OP: roles.TENSOR_PARALLEL_REDUCE_OP,
    roles.TENSOR_PARALLEL_REDUCE_OP: roles.TENSOR_PARALLEL_COPY_OP,
}


def _marker_gradient(ctx, dys):
    dy = dys[0]
    if dy is None:
        return [None]
    op = _GRADIENT_OF[ctx.node.op]
    graph = ctx.b.graph
    if not any(f.domain == roles.MARKER_DOMAIN and f.name == op for f in graph.functions):
        graph.functions.append(marker_function(graph, op, attribute="group"))
    dx = ctx.op(op, dy, domain=roles.MARKER_DOMAIN, group=int(ctx.attr("group", 0)))
    dx.dtype, dx.shape = dy.dtype, dy.shape
    return [dx]


for _op in _GRADIENT_OF:
    RULES.add(Rule(_op, _marker_gradient, domain=roles.MARKER_DOMAIN, module=__name__))
RULES.add(Rule(roles.TENSOR_PARALLEL_MAX_OP, None, domain=roles.MARKER_DOMAIN, module=__name__))
