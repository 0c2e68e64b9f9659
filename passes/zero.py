"""The zero pass: data parallelism with the optimizer states (stage 1) and the gradients
(stage 2) sharded across the replicas, as DeepSpeed's ZeRO and PyTorch's FSDP do, marked in
the program."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.dag import placed_early
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.placement.buckets import gradient_buckets, marker_call, marker_function
from graphforge.program import AllReduceRole, ProgramRoles


@dataclass(frozen=True)
class Zero(Pass):
    """Shard the optimizer's work across data-parallel replicas (ZeRO): each of N replicas
    keeps and updates 1/N of every gradient bucket, so that its optimizer states (and at
    stage 2 its reduced gradients) take 1/N of the memory that ``allreduce`` needs.

    1. Each boundary gradient goes through a call of the model-local function
       ``graphforge.ReduceScatter``, in buckets of at most ``bucket_mb`` MiB filled in the
       order backward makes the gradients (as ``allreduce`` fills them): a runtime with N
       replicas reduces each bucket and hands replica r its r-th contiguous 1/N (a tensor may
       straddle two replicas), while backward computes the next bucket.
    2. Each updated parameter goes through a call of ``graphforge.AllGather``: the runtime
       gathers the shards every replica updated before the next forward.
    3. Both functions' bodies are Identity, so on one process the program computes what it
       did, and ``inspect``, ``diff``, ``golden`` and ``prune`` (which inlines them) work as
       for any program. ``stage`` is recorded (``graphforge.allreduce``, with ``zero``): 1
       keeps each bucket's full gradients until the update, 2 frees them once reduced.
       graphforge.distributed.ZeroDataParallel runs it; the global gradient norm, the loss
       and the decision to skip a step are the same on every replica.
    """

    name = "zero"
    requires = (Fact.GRADIENT_BOUNDARY,)
    refuses = (Fact.ALLREDUCE, Fact.STAGES)
    ensures = (Fact.ALLREDUCE,)

    stage: Literal[1, 2] = 1
    bucket_mb: float = 25.0

    def __post_init__(self):
        check_number(self, "bucket_mb", above=0)
        if self.stage not in (1, 2):
            raise PassError(
                f"zero: stage must be 1 (optimizer states sharded) or 2 (gradients too), got {self.stage!r}"
            )

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        tensors = graph.tensors()
        updated = {c.input: c.output for c in ProgramRoles.of_model(model).carried_with_role("parameter")}
        boundary, parameters, buckets = gradient_buckets(model, self.bucket_mb)
        missing = [p for p in boundary if p not in updated]
        if missing:
            raise PassError(f"parameter {missing[0]!r} has a gradient boundary but no updated output to gather")
        functions = [marker_function(graph, op) for op in (roles.REDUCE_SCATTER_OP, roles.ALL_GATHER_OP)]
        reduced, gathered, calls = {}, {}, []
        for index, bucket in enumerate(buckets):
            for p in bucket:
                reduced[p] = _through(roles.REDUCE_SCATTER_OP, boundary[p], parameters[p], f"{p}/reduced", index, calls)
                output = tensors[updated[p]]
                gathered[p] = output.name
                _before(roles.ALL_GATHER_OP, output, parameters[p], f"{p}/updated", index, calls)
        graph.nodes = placed_early([*graph.nodes, *calls], {id(n) for n in graph.nodes})
        graph.functions.extend(functions)
        role = AllReduceRole(True, self.bucket_mb, buckets, reduced, self.stage, gathered)
        roles.set_json(model, roles.ALLREDUCE, role.to_json())
        return PassResult(model, True, note=f"stage {self.stage}: {len(reduced)} gradients in {len(buckets)} bucket(s)")


def _through(op: str, tensor: gs.Tensor, like: gs.Tensor, name: str, bucket: int, calls: list) -> str:
    """Every reader of ``tensor`` reads it through a marker call instead; returns the call's output."""
    readers = list(tensor.outputs)
    out = gs.Variable(f"{roles.ZERO_PREFIX}{name}", dtype=like.dtype, shape=like.shape)
    calls.append(marker_call(op, tensor, out, bucket))
    for node in readers:
        node.inputs = [out if t is tensor else t for t in node.inputs]
    return out.name


def _before(op: str, output: gs.Tensor, like: gs.Tensor, name: str, bucket: int, calls: list) -> None:
    """The graph output ``output`` made through a marker call: its producer writes a new
    tensor, which the call takes to ``output`` (the program's output names stay)."""
    if not output.inputs:
        raise PassError(f"the updated parameter {output.name!r} has no producer to gather after")
    producer = output.inputs[0]
    local = gs.Variable(f"{roles.ZERO_PREFIX}{name}", dtype=like.dtype, shape=like.shape)
    producer.outputs = [local if t is output else t for t in producer.outputs]
    calls.append(marker_call(op, local, output, bucket))
