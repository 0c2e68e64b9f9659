"""Pipeline stages of a training program: where each node runs, and each stage's segments.

The pipeline pass records only the forward tensors the stages are cut after
(the ``graphforge.stages`` metadata key); everything else follows from the program, the same way in the
pass and in the runtime:

- **Phases.** A node the gradient boundary (or an output the update does not write: the
  loss, accumulators, buffers) needs runs once per micro-batch: in the *backward* when
  autodiff made it or it reads the backward (the optimizer's accumulation), else in the
  *forward* (the model's, the loss's, the BatchNorm buffers' update, so that the next
  micro-batch's forward reads the statistics as one process would). The rest is the
  *update*, once per step.
- **Forward stages.** Stage k runs the forward nodes ``cuts[k]`` needs that no earlier stage
  runs; the last stage runs the rest (the head, the loss).
- **Backward stages.** A node autodiff made for forward node n runs on n's stage. Any other
  backward or update node runs where what it reads lives (a parameter's accumulator, its
  optimizer states and its update on the parameter's stage); a node that reads nothing of
  any stage (the step counter, the clipping factor from the gathered norm) runs on every
  stage that needs it.

Tensors cross between stages only along the chain: forward activations from stage a to b > a
are relayed a → a+1 → … → b with each micro-batch's forward message, and what a backward
on stage b < a reads from stage a (gradients, or activations autodiff kept) goes down with
the backward messages. A program whose data would have to go elsewhere (a parameter two
stages read, an update that reads another stage's tensor) is refused with the names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.analysis.cost import model_flops, tensor_bytes
from graphforge.dag import outer_inputs, topological_order
from graphforge.errors import GraphforgeError
from graphforge.graph import Model
from graphforge.placement.cut import Segment, restore_initializer_inputs, segment_model
from graphforge.program import ProgramRoles
from graphforge.shapes import infer_shapes

FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"


class StageError(GraphforgeError):
    """The program cannot be split into these stages; the message names the tensor or node."""


def _reads(node: gs.Node, overridable: frozenset[str] = frozenset()) -> list[gs.Tensor]:
    """What ``node`` reads that may differ from run to run: variables, and the initializers
    that are inputs too (parameters and other carried tensors, which onnx-graphsurgeon
    shows as constants)."""
    return [
        t
        for t in [*node.inputs, *outer_inputs(node, constants=True)]
        if not t.is_empty() and (not isinstance(t, gs.Constant) or t.name in overridable)
    ]


#: inputs ops read only for their shape or type, not their values: (op, input index)
_SHAPE_ONLY = {("Shape", 0), ("Size", 0), ("CastLike", 1), ("EyeLike", 0)}


def _value_reads(node: gs.Node, overridable: frozenset[str]) -> list[gs.Tensor]:
    """What ``node``'s output values depend on (``Shape(x)`` does not depend on x's values)."""
    shape_only = {id(t) for i, t in enumerate(node.inputs) if (node.op, i) in _SHAPE_ONLY}
    return [t for t in _reads(node, overridable) if id(t) not in shape_only]


def _models_node(node: gs.Node) -> bool:
    """Whether ``node`` is the model's or the loss pass's (not another pass's)."""
    origin = roles.node_origin(node.name or "")
    return origin is None or origin[0] == "loss"


def _floating(tensor: gs.Tensor) -> bool:
    return tensor.dtype is not None and np.issubdtype(np.dtype(tensor.dtype), np.floating)


def _overridable(model: Model) -> frozenset[str]:
    return frozenset(model.initializer_inputs)


@dataclass
class StagePlan:
    """Where each node of a program runs: ``stage`` (None: on every stage that needs it)
    and ``phase`` by node id; the stage of each carried tensor (by input name)."""

    stages: int
    model: Model
    nodes: list[gs.Node]
    stage: dict[int, int | None]
    phase: dict[int, str]
    carried_stage: dict[str, int]
    partials: dict[str, int] = field(default_factory=dict)  # partial norm tensor -> its stage

    def parameters(self, s: int) -> list[str]:
        roles_ = ProgramRoles.of_model(self.model)
        return [c.input for c in roles_.carried_with_role("parameter") if self.carried_stage[c.input] == s]

    def members(self, s: int, phase: str, outputs: Iterable[str] = ()) -> list[gs.Node]:
        """The nodes stage ``s`` runs in ``phase``, with the shared nodes they need and
        those that compute ``outputs`` (shared ones such as grad_norm), in order."""
        ov = _overridable(self.model)
        chosen = {id(n) for n in self.nodes if self.stage[id(n)] == s and self.phase[id(n)] == phase}
        producer = {id(t): n for n in self.nodes for t in n.outputs}
        wanted = set(outputs)
        for n in self.nodes:
            if self.stage[id(n)] is None and self.phase[id(n)] == phase and any(t.name in wanted for t in n.outputs):
                chosen.add(id(n))
        stack = [n for n in self.nodes if id(n) in chosen]
        while stack:
            for t in _reads(stack.pop(), ov):
                p = producer.get(id(t))
                if p is not None and self.stage[id(p)] is None and id(p) not in chosen:
                    chosen.add(id(p))
                    stack.append(p)
        return [n for n in self.nodes if id(n) in chosen]


def _ordered(model: Model) -> list[gs.Node]:
    graph = model.graph
    return [graph.nodes[i] for i in topological_order(graph)]


def phases(model: Model, nodes: list[gs.Node] | None = None) -> dict[int, str]:
    """Each node's phase (by id): forward, backward or update (see the module docstring)."""
    program = ProgramRoles.of_model(model)
    ov = _overridable(model)
    nodes = nodes if nodes is not None else _ordered(model)
    tensors = model.graph.tensors()
    update = program.update_outputs
    needed = [tensors[n] for n in program.gradient_boundary.values() if n in tensors]
    needed += [t for t in model.graph.outputs if t.name not in update]
    producer = {id(t): n for n in nodes for t in n.outputs}
    per_microbatch: set[int] = set()
    stack = [producer[id(t)] for t in needed if id(t) in producer]
    while stack:
        node = stack.pop()
        if id(node) in per_microbatch:
            continue
        per_microbatch.add(id(node))
        stack.extend(producer[id(t)] for t in _reads(node, ov) if id(t) in producer)
    phase: dict[int, str] = {}
    for node in nodes:
        if id(node) not in per_microbatch:
            phase[id(node)] = UPDATE
            continue
        origin = roles.node_origin(node.name or "")
        if origin is not None and origin[0] == "grad":
            phase[id(node)] = BACKWARD
        elif origin is None or origin[0] == "loss":
            phase[id(node)] = FORWARD
        else:
            # the optimizer's (or another pass's) node: backward when it reads the backward (the
            # accumulation), else forward: the BatchNorm statistics a forward hands to its
            # buffers are written by that forward, so the next micro-batch's forward reads them
            reads_backward = any(phase.get(id(producer.get(id(t)))) == BACKWARD for t in _reads(node, ov))
            phase[id(node)] = BACKWARD if reads_backward else FORWARD
    return phase


def forward_stages(model: Model, cuts: Sequence[str], nodes=None, phase=None) -> dict[int, int]:
    """The stage of each forward node (by id): stage k computes what ``cuts[k]`` needs and
    no earlier stage computes; the last stage the rest."""
    nodes = nodes if nodes is not None else _ordered(model)
    phase = phase if phase is not None else phases(model, nodes)
    ov = _overridable(model)
    tensors = model.graph.tensors()
    forward = [n for n in nodes if phase[id(n)] == FORWARD]
    producer = {id(t): n for n in forward for t in n.outputs}
    stage: dict[int, int] = {}
    for k, name in enumerate(cuts):
        tensor = tensors.get(name)
        if tensor is None:
            raise StageError(f"cut {k + 1}: the program has no tensor {name!r}")
        if id(tensor) not in producer:
            raise StageError(
                f"cut {k + 1}: {name!r} is not made by the forward (it is "
                f"{'an input' if not tensor.inputs else 'made by the backward or the update'}); "
                "cut after a forward activation"
            )
        if id(producer[id(tensor)]) in stage:
            raise StageError(
                f"cut {k + 1} ({name!r}) is computed before cut {stage[id(producer[id(tensor)])] + 1}: "
                f"stage {k} would be empty; list the cuts in forward order"
            )
        stack = [producer[id(tensor)]]
        while stack:
            node = stack.pop()
            if id(node) in stage:
                continue
            stage[id(node)] = k
            stack.extend(producer[id(t)] for t in _reads(node, ov) if id(t) in producer)
    last = len(cuts)
    # where the cuts put the readers of each parameter or buffer (a buffer's update goes there)
    read_at: dict[str, int] = {}
    for node in forward:
        if id(node) in stage:
            for t in _reads(node, ov):
                if id(t) not in producer:
                    read_at.setdefault(t.name, stage[id(node)])
    for node in forward:  # in order: what a node reads is placed before it
        if id(node) in stage:
            continue
        placed = [
            stage[id(producer[id(t)])] if id(t) in producer else read_at[t.name]
            for t in _reads(node, ov)
            if id(t) in producer or t.name in read_at
        ]
        if not _models_node(node) and placed:
            stage[id(node)] = max(placed)  # a pass's node (a buffer's update) stays with what it reads
        else:
            stage[id(node)] = last  # the head, the loss, and what no cut needs
    if cuts and not any(s == last for s in stage.values()):
        raise StageError(f"the last stage would be empty: nothing of the forward comes after {cuts[-1]!r}")
    return stage


def carried_stages(model: Model, nodes, phase, stage: dict[int, int], stages: int) -> dict[str, int]:
    """The stage owning each carried tensor: a parameter's or buffer's is the stage whose
    forward reads it; an optimizer state's or accumulator's, its parameter's."""
    program = ProgramRoles.of_model(model)
    ov = _overridable(model)
    readers: dict[str, set[int]] = {}
    for node in nodes:
        if phase[id(node)] == FORWARD:
            for t in _reads(node, ov):
                readers.setdefault(t.name, set()).add(stage[id(node)])
    owned: dict[str, int] = {}
    for spec in program.carried:
        if spec.role in ("parameter", "buffer"):
            found = readers.get(spec.input, set())
            if len(found) > 1:
                raise StageError(
                    f"{spec.role} {spec.input!r} is read by the forward of stages {sorted(found)}: a tied weight "
                    "cannot be split across stages (its gradient would need reducing between them); move the "
                    "cuts so that one stage reads it"
                )
            if found:
                owned[spec.input] = found.pop()
    for spec in program.carried:
        if spec.input not in owned:
            owned[spec.input] = owned.get(spec.like or "", 0) if spec.like else 0
    return owned


def plan_stages(model: Model, cuts: Sequence[str], partials: Iterable[tuple[int, str]] = ()) -> StagePlan:
    """Every node's stage and phase for ``cuts`` (see the module docstring). ``partials``:
    (stage, tensor) of each stage's share of the global gradient norm, which every stage
    gathers before the update. Raises StageError where data would cross stages off the chain."""
    nodes = _ordered(model)
    phase = phases(model, nodes)
    stages = len(cuts) + 1
    forward = forward_stages(model, cuts, nodes, phase)
    carried = carried_stages(model, nodes, phase, forward, stages)
    partial_stage = {name: s for s, name in partials}
    stage = _spread(model, nodes, phase, forward, carried, set(partial_stage), strict=True)
    plan = StagePlan(stages, model, nodes, stage, phase, carried, partial_stage)
    _check_flows(plan)
    return plan


def _spread(model, nodes, phase, forward: dict[int, int], carried: dict[str, int], gathered: set[str], *, strict: bool):
    """Place every node that is not forward from ``forward`` (forward node id → place) and
    ``carried`` (carried input → place): a backward node autodiff made for a forward node
    at that node's place; any other at the earliest place of what it reads (None: nothing
    placed). ``strict``: an update node reading two places is refused."""
    ov = _overridable(model)
    place: dict[int, int | None] = dict(forward)
    producer = {id(t): n for n in nodes for t in n.outputs}
    by_name = {n.name: n for n in nodes if n.name}
    for node in nodes:
        if id(node) in place:
            continue
        origin = roles.node_origin(node.name or "")
        source = by_name.get(origin[1]) if origin is not None and origin[0] == "grad" and origin[1] else None
        if source is not None and phase[id(node)] == BACKWARD and place.get(id(source)) is not None:
            place[id(node)] = place[id(source)]
            continue
        found = set()
        for t in _reads(node, ov):
            if t.name in gathered:
                continue  # on every stage
            p = producer.get(id(t))
            if p is not None:
                if place.get(id(p)) is not None:
                    found.add(place[id(p)])
            elif t.name in carried:
                found.add(carried[t.name])
        if not found:
            place[id(node)] = None
        elif strict and phase[id(node)] == UPDATE and len(found) > 1:
            raise StageError(
                f"update node {node.name!r} ({node.op}) reads tensors of stages {sorted(found)}; "
                "the update of each parameter must use its own stage's tensors only"
            )
        else:  # backward flows from the last stage to the first: it ends on the earliest
            place[id(node)] = min(found)
    return place


def _check_flows(plan: StagePlan) -> None:
    ov = _overridable(plan.model)
    producer = {id(t): n for n in plan.nodes for t in n.outputs}
    for node in plan.nodes:
        b, q = plan.stage[id(node)], plan.phase[id(node)]
        for t in _reads(node, ov):
            p = producer.get(id(t))
            if p is None or b is None or t.name in plan.partials:
                continue
            a, kind = plan.stage[id(p)], plan.phase[id(p)]
            if a is None or a == b:
                continue
            fine = (kind == FORWARD and q == FORWARD and b > a) or (kind == FORWARD and q == BACKWARD)
            fine = fine or (kind == BACKWARD and q == BACKWARD and b < a)
            if not fine:
                raise StageError(
                    f"{q} node {node.name!r} on stage {b} reads {t.name!r}, made by the {kind} of stage {a}: "
                    "data cannot flow that way between pipeline stages; move the cuts"
                )


# --------------------------------------------------------------------------- segments


@dataclass
class StageSegments:
    """What one stage runs: its forward and backward segments (once per micro-batch) and
    its update (once per step: one segment, or two around the gathering of the partial
    gradient norms); the tensors of the forward message it receives and sends, and of the
    backward message; and what the update reads from the step's last micro-batch."""

    stage: int
    forward: Segment
    backward: Segment
    update: list[Segment]
    receive_forward: list[str]
    send_forward: list[str]
    receive_backward: list[str]
    send_backward: list[str]
    carried: list[str]
    #: the stage owning each carried tensor of the program (by input name, in program order)
    owners: dict[str, int] = field(default_factory=dict)
    #: the element type of every tensor of this stage's messages
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    partial_norm: str | None = None


def messages(plan: StagePlan) -> tuple[list[list[str]], list[list[str]]]:
    """``forward[k]``: the tensors stage k receives from stage k-1 with each micro-batch's
    forward; ``backward[k]``: those it receives from stage k+1 with its backward."""
    ov = _overridable(plan.model)
    forward: list[list[str]] = [[] for _ in range(plan.stages)]
    backward: list[list[str]] = [[] for _ in range(plan.stages)]
    consumers: dict[int, set[int]] = {}
    for node in plan.nodes:
        b = plan.stage[id(node)]
        if b is None:
            continue
        for t in _reads(node, ov):
            consumers.setdefault(id(t), set()).add(b)
    for node in plan.nodes:
        a = plan.stage[id(node)]
        if a is None or plan.phase[id(node)] == UPDATE:
            continue
        for t in node.outputs:
            for b in sorted(consumers.get(id(t), set()) - {a}):
                if b > a:
                    for k in range(a + 1, b + 1):
                        forward[k].append(t.name)
                else:
                    for k in range(b, a):
                        backward[k].append(t.name)
    return [list(dict.fromkeys(f)) for f in forward], [list(dict.fromkeys(b)) for b in backward]


def stage_segments(model: Model | onnx.ModelProto, stage: int) -> StageSegments:
    """Stage ``stage``'s segments of a program the pipeline pass split (its recorded cuts)."""
    model = infer_shapes(Model.from_proto(model) if isinstance(model, onnx.ModelProto) else model)
    program = ProgramRoles.of_model(model)
    role = program.stages
    if role is None:
        raise StageError("the program has no pipeline stages: compile it with the pipeline pass")
    if not 0 <= stage < role.stages:
        raise StageError(f"stage {stage} does not exist: the program has {role.stages} stages")
    plan = plan_stages(model, role.cuts, role.partial_norms)
    forward_in, backward_in = messages(plan)
    tensors = model.graph.tensors()
    own_carried = [c.input for c in program.carried if plan.carried_stage[c.input] == stage]
    send_forward = forward_in[stage + 1] if stage + 1 < plan.stages else []
    send_backward = backward_in[stage - 1] if stage > 0 else []
    partial = next((name for s, name in role.partial_norms if s == stage), None)
    # what the stage's pieces write for others than its later pieces: the messages, the
    # carried tensors' new values, the loss, the gradient norm and the stage's partial norm
    leaving = set(send_forward) | set(send_backward)
    kept = {c.output for c in program.carried if c.input in set(own_carried)}
    kept |= {program.loss, program.grad_norm, partial} - {None}
    pieces = _stage_pieces(plan, stage, program.grad_norm, partial, tensors)
    segments = [_piece_segment(model, tensors, pieces, i, stage, leaving, kept) for i in range(len(pieces))]
    return StageSegments(
        stage=stage,
        forward=segments[0],
        backward=segments[1],
        update=segments[2:],
        receive_forward=forward_in[stage],
        send_forward=send_forward,
        receive_backward=backward_in[stage],
        send_backward=send_backward,
        carried=own_carried,
        owners={c.input: plan.carried_stage[c.input] for c in program.carried},
        dtypes={
            n: np.dtype(tensors[n].dtype)
            for n in [*forward_in[stage], *send_forward, *backward_in[stage], *send_backward]
        },
        partial_norm=partial,
    )


def _stage_pieces(
    plan: StagePlan, stage: int, grad_norm: str | None, partial: str | None, tensors: Mapping[str, gs.Tensor]
) -> list[tuple[str, list[gs.Node]]]:
    """Stage ``stage``'s pieces, in the order they run, each labelled: its forward, its
    backward, and its update, in two around its ``partial`` gradient norm when it has one
    (the nodes that norm is computed from, then the rest)."""
    ov = _overridable(plan.model)
    groups = {p: plan.members(stage, p) for p in (FORWARD, BACKWARD)}
    # every stage with parameters reports the global gradient norm (it gathers the partials anyway)
    has_update = any(plan.stage[id(n)] == stage and plan.phase[id(n)] == UPDATE for n in plan.nodes)
    groups[UPDATE] = plan.members(stage, UPDATE, [grad_norm] if has_update and grad_norm else [])
    if partial is not None:  # the update in two: this stage's partial norm, then the rest
        producer = {id(t): n for n in groups[UPDATE] for t in n.outputs}
        before: set[int] = set()
        stack = [producer[id(tensors[partial])]]
        while stack:
            n = stack.pop()
            if id(n) not in before:
                before.add(id(n))
                stack.extend(producer[id(t)] for t in _reads(n, ov) if id(t) in producer)
        parts = [[n for n in groups[UPDATE] if id(n) in before], [n for n in groups[UPDATE] if id(n) not in before]]
    else:
        parts = [groups[UPDATE]]
    ordered = [("forward", groups[FORWARD]), ("backward", groups[BACKWARD])]
    return ordered + [(f"update{i if len(parts) > 1 else ''}", nodes) for i, nodes in enumerate(parts)]


def _piece_segment(
    model: Model,
    tensors: Mapping[str, gs.Tensor],
    pieces: Sequence[tuple[str, list[gs.Node]]],
    i: int,
    stage: int,
    leaving: set[str],
    kept: set[str],
) -> Segment:
    """The segment of piece ``i`` of stage ``stage``'s ``pieces`` (``_stage_pieces``): it reads
    what the piece reads and does not make; it writes what later pieces read, what
    ``leaving`` names (sent to other stages) and what ``kept`` names."""
    ov = _overridable(model)
    label, nodes = pieces[i]
    later_reads = {t.name for _, later in pieces[i + 1 :] for n in later for t in _reads(n, ov)}
    made = {t.name for n in nodes for t in n.outputs}
    inputs = list(dict.fromkeys(t.name for n in nodes for t in _reads(n, ov) if t.name not in made))
    outputs = [t.name for n in nodes for t in n.outputs if t.name in later_reads or t.name in leaving or t.name in kept]
    outputs = list(dict.fromkeys(outputs))
    for tensor in outputs + inputs:
        if tensors[tensor].dtype is None:
            raise StageError(f"tensor {tensor!r} crosses between stage {stage}'s segments but its type is unknown")
    variables = [tensors[n] for n in inputs if not isinstance(tensors[n], gs.Constant)]  # the rest: restored below
    proto = segment_model(model, nodes, variables, [tensors[n] for n in outputs], f"stage{stage}_{label}")
    restore_initializer_inputs(proto, model)
    return Segment(
        index=i,
        model=proto,
        inputs=[v.name for v in proto.graph.input],
        outputs=outputs,
        receives=[n for n in inputs if n in tensors and tensors[n].inputs],
        sends=[n for n in outputs if n in later_reads or n in leaving],
    )


# --------------------------------------------------------------------------- costs


@dataclass
class StageCosts:
    """Per stage: FLOPs per micro-batch (forward + backward) and per step (update), bytes of
    parameters, of optimizer states and accumulators, and of the activations stashed per
    micro-batch (what the stage's backward reads from forwards)."""

    flops: list[float]
    update_flops: list[float]
    parameter_bytes: list[int]
    state_bytes: list[int]
    stash_bytes: list[int]

    def to_json(self) -> dict:
        return {
            "flops": self.flops,
            "update_flops": self.update_flops,
            "parameter_bytes": self.parameter_bytes,
            "state_bytes": self.state_bytes,
            "stash_bytes": self.stash_bytes,
        }


def stage_costs(plan: StagePlan, dims=None, per_node: dict[int, float] | None = None) -> StageCosts:
    """What each stage of ``plan`` computes and holds (graphforge.analysis.cost; symbolic
    dims as ``dims`` binds them, else 1)."""
    s_count = plan.stages
    flops, update = [0.0] * s_count, [0.0] * s_count
    costs = per_node if per_node is not None else model_flops(plan.model, dims)
    for node in plan.nodes:
        s = plan.stage[id(node)]
        cost = costs.get(id(node), 0.0)  # a node added since ``flops`` was taken: a scalar's
        targets = range(s_count) if s is None else [s]
        for k in targets:
            (update if plan.phase[id(node)] == UPDATE else flops)[k] += cost
    program = ProgramRoles.of_model(plan.model)
    tensors = plan.model.graph.tensors()
    params, states = [0] * s_count, [0] * s_count
    for spec in program.carried:
        size = tensor_bytes(tensors[spec.input], dims) if spec.input in tensors else 0
        (params if spec.role == "parameter" else states)[plan.carried_stage[spec.input]] += size
    stash = [0] * s_count
    ov = _overridable(plan.model)
    producer = {id(t): n for n in plan.nodes for t in n.outputs}
    seen: set[tuple[int, int]] = set()
    for node in plan.nodes:
        b = plan.stage[id(node)]
        if b is None or plan.phase[id(node)] != BACKWARD:
            continue
        for t in _reads(node, ov):
            p = producer.get(id(t))
            if p is not None and plan.phase[id(p)] == FORWARD and (b, id(t)) not in seen:
                seen.add((b, id(t)))
                stash[b] += tensor_bytes(t, dims)
    return StageCosts(flops, update, params, states, stash)


def forward_chain(
    plan: StagePlan, dims=None, per_node: dict[int, float] | None = None
) -> tuple[list[gs.Node], list[float], dict[int, str]]:
    """The forward as a chain for the partition: its nodes in order, each one's weight (its
    FLOPs, its backward's and the update of the parameters it reads first), and the
    positions where one tensor that depends on a parameter alone crosses (position → that
    tensor), the cut points."""
    ov = _overridable(plan.model)
    # the model's and the loss's nodes; a pass's forward nodes (buffer updates) go with what they read
    forward = [n for n in plan.nodes if plan.phase[id(n)] == FORWARD and _models_node(n)]
    index = {id(n): i for i, n in enumerate(forward)}
    program = ProgramRoles.of_model(plan.model)
    carried_of = {c.input: c for c in program.carried}
    first_reader: dict[str, int] = {}
    for i, n in enumerate(forward):
        for t in _reads(n, ov):
            first_reader.setdefault(t.name, i)
    position = {c.input: first_reader.get(c.like or c.input, 0) for c in program.carried}
    place = _spread(plan.model, plan.nodes, plan.phase, index, position, set(), strict=False)
    weight = [0.0] * len(forward)
    costs = per_node if per_node is not None else model_flops(plan.model, dims)
    for node in plan.nodes:
        at = place[id(node)]
        if at is not None:
            weight[at] += costs.get(id(node), 0.0)
    # which tensors depend on a parameter (activations); the rest (masks from the batch) are relayed
    parameters = {c.input for c in carried_of.values() if c.role in ("parameter", "buffer")}
    depends: set[int] = set()
    producer_index = {id(t): i for i, n in enumerate(forward) for t in n.outputs}
    for n in forward:
        if any(t.name in parameters or id(t) in depends for t in _value_reads(n, ov)):
            depends.update(id(t) for t in n.outputs)
    last_use: dict[int, int] = {}
    for i, n in enumerate(forward):
        for t in _reads(n, ov):
            if id(t) in producer_index:
                last_use[id(t)] = i
    points: dict[int, str] = {}
    live: dict[int, gs.Tensor] = {}
    ends: dict[int, list[int]] = {}
    for t_id, last in last_use.items():
        ends.setdefault(last, []).append(t_id)
    for i, n in enumerate(forward[:-1]):
        for t in n.outputs:
            # shapes and masks (integer, boolean) are small: relayed, they do not make a cut
            if id(t) in depends and id(t) in last_use and _floating(t):
                live[id(t)] = t
        for t_id in ends.get(i, []):
            live.pop(t_id, None)
        if len(live) == 1:
            points[i + 1] = next(iter(live.values())).name
    # a tensor alone over a run of positions (the embedding while the masks are made) is one
    # cut, made where it first is: two cuts at one tensor would leave a stage empty
    first: dict[str, int] = {}
    for at, name in sorted(points.items()):
        first.setdefault(name, at)
    return forward, weight, {at: name for name, at in first.items()}
