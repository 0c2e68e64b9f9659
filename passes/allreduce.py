"""The allreduce pass: reduce the gradients across data-parallel replicas, marked in the program."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.dag import placed_early
from graphforge.graph import Model
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.placement.buckets import gradient_buckets, marker_call, marker_function
from graphforge.program import AllReduceRole


@dataclass(frozen=True)
class AllReduce(Pass):
    """Reduce every gradient across the data-parallel replicas, between the optimizer's
    gradient boundary and everything that reads it (global-norm clipping, ``grad_norm``, the
    update), as DDP does.

    1. Each boundary gradient (the accumulated one when the program accumulates) goes through
       a call of the model-local function ``graphforge.AllReduce``, whose body is an Identity:
       on one process the program computes what it did, and stock onnxruntime runs it as it
       is; a runtime with more replicas cuts the program at the calls and reduces across them
       in between (``average``: the mean over replicas, as DDP; else the sum).
    2. The calls form buckets of at most ``bucket_mb`` MiB of one element type, filled in the
       order the gradients become ready in backward (their producers' topological order), so
       a runtime can reduce bucket k while backward computes bucket k + 1. A gradient larger
       than a bucket has one of its own.
    3. The buckets and the reduced tensors are recorded (``graphforge.allreduce``);
       ``inspect`` and ``diff`` show the calls, and ``prune`` inlines them away.
    """

    name = "allreduce"
    requires = (Fact.GRADIENT_BOUNDARY,)
    refuses = (Fact.ALLREDUCE,)
    ensures = (Fact.ALLREDUCE,)

    average: bool = True
    bucket_mb: float = 25.0

    def __post_init__(self):
        check_number(self, "bucket_mb", above=0)

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        boundary, parameters, buckets = gradient_buckets(model, self.bucket_mb)
        function = marker_function(graph, roles.ALLREDUCE_OP)
        reduced, calls = {}, {}
        for index, bucket in enumerate(buckets):
            for p in bucket:
                reduced[p], calls[boundary[p].name] = _reduce(boundary[p], parameters[p], index)
        graph.nodes = placed_early([*graph.nodes, *calls.values()], {id(n) for n in graph.nodes})
        graph.functions.append(function)
        roles.set_json(model, roles.ALLREDUCE, AllReduceRole(self.average, self.bucket_mb, buckets, reduced).to_json())
        return PassResult(model, True, note=f"{len(reduced)} gradients in {len(buckets)} bucket(s)")


def _reduce(gradient: gs.Tensor, parameter: gs.Tensor, bucket: int) -> tuple[str, gs.Node]:
    """``gradient`` through a marker call; every reader of it reads the call's output
    instead. Returns that output's name and the call (not yet in the graph: placed right
    after the gradient's producer, so a runtime can reduce it while backward goes on)."""
    readers = list(gradient.outputs)
    reduced = gs.Variable(f"{roles.ALLREDUCE_PREFIX}{parameter.name}", dtype=parameter.dtype, shape=parameter.shape)
    call = marker_call(roles.ALLREDUCE_OP, gradient, reduced, bucket)
    for node in readers:
        node.inputs = [reduced if t is gradient else t for t in node.inputs]
    return reduced.name, call
