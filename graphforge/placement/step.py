"""A training step's cut: the program split at the optimizer's gradient boundary into
segment 0 (forward, backward, accumulation and, where asked, the gradient norm) and segment 1
(the update), and the models each kind of step runs (``step_models``). Pure model code: the
Module runs these segments, the memory prediction and the planner read the same models
without running anything, and the on-device artifacts are written from them."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from graphforge.errors import GraphforgeError
from graphforge.placement.cut import cut
from graphforge.placement.lean import lean_model
from graphforge.program import ProgramRoles
from graphforge.stand_ins import without_values

#: what Module(in_place=True) updates in one buffer: the large carried tensors whose update is
#: the last thing a step does (accumulators and BatchNorm buffers are written by segment 0,
#: which a skipped update must be able to take back)
IN_PLACE_ROLES = ("parameter", "optimizer")


@dataclass(frozen=True)
class StepSplit:
    """The program cut for the split path: the two segment models, what segment 0 can
    output, and what it sends to segment 1. Shared by every Module on the program in the
    process (``split_program``'s cache): read, never changed."""

    grad: onnx.ModelProto
    optim: onnx.ModelProto
    grad_outputs: tuple[str, ...]
    sends: tuple[str, ...]
    #: what segment 0 fetches to decide whether the update may be applied (loss, grad_norm)
    checks: tuple[str, ...]


#: splits kept per process (``split_program``), by the program's bytes without its carried
#: values and ``norm_first``: a second Module on the same program (a resume, an evaluation
#: copy, a replica in the same process) finds its cut made (GPT-2 small's took 2.7 s under cProfile)
CACHED_SPLITS = 4
_splits: OrderedDict[tuple[str, bool], StepSplit] = OrderedDict()
_splits_lock = threading.Lock()


def split_program(program: onnx.ModelProto, roles: ProgramRoles, *, norm_first: bool) -> StepSplit:
    """Segment 0 (forward + backward + accumulate) and segment 1 (the optimizer update) of a
    training program, cut at the gradient boundary and at every output the update does not
    write. ``norm_first``: segment 0 computes the gradient norm too, so that an update that
    is not finite is known before it overwrites anything in place (not for data-parallel
    programs, whose norm is of the reduced gradients, after the boundary)."""
    # the segments are made without the carried tensors' values (their sessions bind them):
    # each segment would otherwise hold a copy of every weight it reads
    program = without_values(program, {spec.input for spec in roles.carried})
    key = (hashlib.sha256(program.SerializeToString(deterministic=True)).hexdigest(), norm_first)
    with _splits_lock:
        made = _splits.get(key)
        if made is not None:
            _splits.move_to_end(key)
            return made
    made = _cut_in_two(program, roles, norm_first=norm_first)
    with _splits_lock:
        _splits[key] = made
        while len(_splits) > CACHED_SPLITS:
            _splits.popitem(last=False)
    return made


def _cut_in_two(program: onnx.ModelProto, roles: ProgramRoles, *, norm_first: bool) -> StepSplit:
    loss = roles.loss or "loss"
    update = roles.update_outputs
    boundary = list(roles.gradient_boundary.values())
    checks = [loss]
    if norm_first and roles.grad_norm is not None and roles.allreduce is None:
        checks.append(roles.grad_norm)
    if norm_first and roles.loss_scaling is not None and roles.allreduce is None:
        checks.append(roles.loss_scaling.update_skipped)
    boundary += checks[1:]
    boundary += [o.name for o in program.graph.output if o.name not in update]
    grad, optim = cut(program, [list(dict.fromkeys(boundary))])
    for name in optim.inputs:
        spec = roles.carried_spec(name)
        if spec is not None and spec.output in grad.outputs:
            raise GraphforgeError(
                f"cannot split this program: its optimizer segment reads {name!r}, which the "
                f"forward/backward segment already updates; use module.train_step(...)"
            )
    produced = [o.name for o in grad.model.graph.output]
    carried = {spec.input for spec in roles.carried}
    return StepSplit(
        grad=grad.model,
        optim=optim.model,
        grad_outputs=tuple(produced),
        sends=tuple(n for n in optim.inputs if n in produced and n not in carried),
        checks=tuple(n for n in checks if n in produced),
    )


def segment_outputs(split: StepSplit, index: int, roles: ProgramRoles, extra: Sequence[str] = ()) -> list[str]:
    """What a run of segment ``index`` computes: the loss, the checks, ``extra`` outputs and
    the gradients it sends (segment 0), grad_norm and ``extra`` (segment 1), and the carried
    tensors' updates it makes."""
    model = split.grad if index == 0 else split.optim
    produced = {o.name for o in model.graph.output}
    loss = roles.loss or "loss"
    keep = [loss, *extra, *split.sends, *split.checks] if index == 0 else [*roles.step_reports, *extra]
    keep = [o for o in dict.fromkeys(keep) if o in produced]
    return keep + [c.output for c in roles.carried if c.output in produced]


def step_models(
    program: onnx.ModelProto, roles: ProgramRoles, *, in_place: bool, split: StepSplit | None = None
) -> dict[str, onnx.ModelProto]:
    """The models one ``Module.train_step`` runs, by label, each as the runner makes it (lean:
    computing only what the run hands on): in place, the forward/backward segment and the
    update (of ``split``, the program's ``split_program(norm_first=True)``, where the caller
    has it); with two buffers, the whole step."""
    bound = {spec.input for spec in roles.carried}
    if not in_place:
        return {"whole step": lean_model(program, fused_outputs(roles), bound=bound)}
    split = split_program(program, roles, norm_first=True) if split is None else split
    return {
        "forward/backward": lean_model(split.grad, segment_outputs(split, 0, roles), bound=bound),
        "update": lean_model(split.optim, segment_outputs(split, 1, roles), bound=bound),
    }


def fused_outputs(roles: ProgramRoles, extra: Sequence[str] = ()) -> list[str]:
    """What one run of the whole program computes for train_step: the loss, grad_norm,
    ``extra`` outputs and the carried tensors' updates."""
    produced = set(roles.outputs)
    keep = [roles.loss or "loss", *(n for n in roles.step_reports if n in produced), *extra]
    return keep + [c.output for c in roles.carried if c.output in produced]
