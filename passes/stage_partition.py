"""The pipeline pass: split a training program into stages that run on different processes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.analysis.cost import model_flops, parse_dims
from graphforge.analysis.partition import balanced_cuts
from graphforge.dag import topological_order
from graphforge.errors import GraphforgeError, PassError
from graphforge.graph import Model
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.placement.buckets import marker_call
from graphforge.placement.stages import (
    StageError,
    carried_stages,
    forward_chain,
    forward_stages,
    phases,
    plan_stages,
    stage_costs,
)
from graphforge.program import ProgramRoles, StagesRole

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class StagePartition(Pass):
    """Split the training program into ``stages`` pipeline stages run on as many processes,
    each step as ``microbatches`` micro-batches in the ``schedule`` "1f1b" or "gpipe"
    (graphforge/distributed/schedules.py).

    Each stage owns the parameters its forward reads, and their accumulation and update;
    graphforge/placement/stages.py derives every node's stage from the cuts recorded here, so one
    ``.onnx`` stays the whole artifact and one process still runs it as it is (the
    micro-batches one after another: ``train.accumulate``'s semantics, the gradients summed).

    - ``cuts=[t1, t2, ...]``: stage k computes what forward tensor ``t(k+1)`` needs (as
      onnxruntime-training's CutEdge); one tensor per boundary, in forward order.
    - No cuts: the forward is read as a chain (topological order) whose cut points are where
      one activation alone crosses, each position weighted by its FLOPs with its backward and
      its parameters' update (graphforge/analysis/cost.py; symbolic dims from ``dims``, e.g.
      ``dims=["batch=8", "seq=64"]``, else 1), and a dynamic program picks the cuts that make the
      slowest stage as fast as possible (graphforge/analysis/partition.py).

    The global gradient norm (and clipping by it) becomes one partial sum per stage, which
    the stages gather before their updates. Recorded as ``graphforge.stages``, with each
    stage's FLOPs, parameter, state and stash bytes, and the balanced ideal beside them.
    The program must accumulate gradients (``adamw(..., accumulate=true)``).
    """

    name = "pipeline"
    requires = (Fact.GRADIENT_BOUNDARY,)
    refuses = (Fact.STAGES, Fact.ALLREDUCE, Fact.MIXED_PRECISION)
    ensures = (Fact.STAGES,)

    stages: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    cuts: tuple[str, ...] = ()
    dims: tuple[str, ...] = ()

    def __post_init__(self):
        check_number(self, "stages", at_least=1)
        check_number(self, "microbatches", at_least=1)
        if self.schedule.lower() not in SCHEDULES:
            raise PassError(f"schedule={self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if self.cuts and len(self.cuts) != self.stages - 1:
            raise PassError(
                f"{self.stages} stages need {self.stages - 1} cuts, got {len(self.cuts)}: {list(self.cuts)}"
            )

    def run(self, model: Model) -> PassResult:
        program = ProgramRoles.of_model(model)
        if not program.accumulates:
            raise PassError(
                "pipeline stages accumulate each stage's gradients over the micro-batches: compile the optimizer "
                "with accumulate=true (e.g. adamw(lr=1e-3, accumulate=true))"
            )
        dims = self._dims()
        try:
            # FLOPs per node once (shape inference with the dims bound): every plan below shares the nodes
            flops = model_flops(model, dims)
            auto = self._automatic(model, dims, flops) if self.stages > 1 else []
            cuts = list(self.cuts) if self.cuts else auto
            partials = _partial_norms(model, cuts, self.stages)
            plan = plan_stages(model, cuts, partials)
        except StageError as exc:
            raise PassError(str(exc)) from None
        costs = stage_costs(plan, dims, flops)
        per_stage = [f + u for f, u in zip(costs.flops, costs.update_flops, strict=True)]
        optimum = max(per_stage)
        if self.cuts and auto and auto != cuts:  # what the automatic cuts would give, beside
            try:
                best = stage_costs(plan_stages(model, auto), dims, flops)
                optimum = max(f + u for f, u in zip(best.flops, best.update_flops, strict=True))
            except StageError:
                pass
        total = sum(per_stage)
        report = {
            **costs.to_json(),
            "dims": dims,
            "slowest": max(per_stage),
            "balanced": total / self.stages,
            "optimum": optimum,
            "automatic_cuts": auto,
        }
        role = StagesRole(
            self.stages,
            self.microbatches,
            self.schedule.lower(),
            tuple(cuts),
            tuple(partials),
            tuple(tuple(plan.parameters(s)) for s in range(self.stages)),
            report,
        )
        roles.set_json(model, roles.STAGES, role.to_json())
        shares = ", ".join(f"{c / total:.0%}" if total else "0%" for c in per_stage)
        note = f"{self.stages} stages after {', '.join(cuts) or '(none)'}; FLOPs {shares}"
        if max(per_stage) > optimum * 1.0001:
            note += f" (the automatic cuts {', '.join(auto)} would give the slowest stage {optimum / total:.0%})"
        return PassResult(model, True, note=note)

    def _dims(self) -> dict[str, int]:
        return parse_dims(self.dims)

    def _automatic(self, model: Model, dims: dict[str, int], flops: dict[int, float]) -> list[str]:
        """The chain cut that makes the slowest stage fastest (by the chain's weights), or
        none when there are too few cut points and the cuts are named."""
        _, weights, points = forward_chain(plan_stages(model, []), dims, flops)
        try:
            best = balanced_cuts(weights, self.stages, list(points))
        except GraphforgeError as exc:  # fewer cut points than stages
            if self.cuts:
                return []
            raise PassError(str(exc)) from None
        return [points[p] for p in best]


def _partial_norms(model: Model, cuts: list[str], stages: int) -> list[tuple[int, str]]:
    """Rewrite the global gradient norm's sum of squares into one partial sum per stage
    (``pipeline::norm/stage<k>``), summed in stage order; returns (stage, partial)."""
    program = ProgramRoles.of_model(model)
    if program.grad_norm is None or stages == 1:
        return []
    tensors = model.graph.tensors()
    node = tensors[program.grad_norm].inputs[0] if tensors[program.grad_norm].inputs else None
    while node is not None and node.op in ("Identity", "Sqrt"):
        node = node.inputs[0].inputs[0] if node.inputs[0].inputs else None
    total, whole, sliced, reduce, plain = node, None, [], None, None
    if node is not None and node.op == "Add":  # a tensor-parallel member's: whole squares + its group's slices'
        producers = [t.inputs[0] if len(t.inputs) == 1 else None for t in node.inputs]
        reduce = next((p for p in producers if p is not None and _is_group_sum(p)), None)
        plain = next((p for p in producers if p is not reduce), None)
        if reduce is not None and plain is not None:
            sliced = _terms(reduce.inputs[0])
            whole = _terms(plain.outputs[0])  # (one square alone where one parameter is whole)
    if whole is None:
        if node is None or node.op != "Sum":
            raise PassError(
                f"cannot find the sum of squares behind {program.grad_norm!r}: the pipeline pass must come right "
                "after the optimizer pass"
            )
        whole = list(node.inputs)
    graph = model.graph
    order = [graph.nodes[i] for i in topological_order(graph)]
    phase = phases(model, order)
    stage_of = forward_stages(model, cuts, order, phase)
    carried = carried_stages(model, order, phase, stage_of, stages)
    boundary = {name: p for p, name in program.gradient_boundary.items()}

    def stage_of_square(tensor: gs.Tensor) -> int:
        stack, seen = [tensor], set()
        while stack:
            t = stack.pop()
            if t.name in boundary:
                return carried[boundary[t.name]]
            if id(t) in seen:
                continue
            seen.add(id(t))
            for producer in t.inputs:
                stack.extend(x for x in producer.inputs if not isinstance(x, gs.Constant))
        raise PassError(f"the gradient norm term {tensor.name!r} reads no parameter's gradient")

    groups: dict[int, list[gs.Tensor]] = {}
    for term in whole:
        groups.setdefault(stage_of_square(term), []).append(term)
    slices: dict[int, list[gs.Tensor]] = {}
    for term in sliced:
        slices.setdefault(stage_of_square(term), []).append(term)
    partials, inputs = [], []
    for s in sorted({*groups, *slices}):
        terms = list(groups.get(s, []))
        if s in slices:  # the stage's slices' squares summed across its tensor group, once per stage
            mine = gs.Variable(f"{roles.STAGES_PREFIX}norm/slices_stage{s}", dtype=np.float32, shape=[])
            graph.nodes.append(gs.Node("Sum", inputs=slices[s], outputs=[mine]))
            summed = gs.Variable(f"{mine.name}/{roles.TENSOR_PARALLEL_REDUCE_OP}_sum", dtype=np.float32, shape=[])
            graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_REDUCE_OP, mine, summed, -1, attribute="group"))
            terms.append(summed)
        out = gs.Variable(f"{roles.STAGES_PREFIX}norm/stage{s}", dtype=np.float32, shape=[])
        graph.nodes.append(gs.Node("Sum", name=f"{roles.STAGES_PREFIX}norm/Sum_stage{s}", inputs=terms, outputs=[out]))
        partials.append((s, out.name))
        inputs.append(out)
    if reduce is not None and sliced:  # the whole norm is the stages' partials now
        total.op, total.inputs, total.attrs = "Sum", list(inputs), {}
        # the group's sum and the sums it and the whole squares were (not a single square itself)
        sums = [reduce.inputs[0].inputs[0] if reduce.inputs[0].inputs else None, plain]
        dropped = {id(reduce), *(id(n) for n in sums if n is not None and n.op == "Sum")}
        graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    else:
        node.inputs = inputs
    graph.toposort()
    return partials


def _is_group_sum(node: gs.Node) -> bool:
    return node.op == roles.TENSOR_PARALLEL_REDUCE_OP and node.domain == roles.MARKER_DOMAIN


def _terms(tensor: gs.Tensor) -> list[gs.Tensor]:
    """The terms a Sum adds up to ``tensor``, or the tensor itself."""
    producer = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    return list(producer.inputs) if producer is not None and producer.op == "Sum" else [tensor]
