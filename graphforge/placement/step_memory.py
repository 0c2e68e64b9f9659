"""The predicted memory of a training step, run the way a Module runs it.

graphforge.analysis.memory predicts one onnxruntime run of one model. A Module's step is
one or two runs, of the models the runner makes from the program (lean_model: only what
the run hands on): in place, segment 0 (forward, backward, the gradient norm) writing the
gradients into buffers the Module holds, then segment 1 (the update) reading them; with two
buffers per carried tensor, one run of the whole program. This module makes the same models without making
sessions or buffers, so ``graphforge inspect --memory`` can tell before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from graphforge.analysis.memory import (
    LiveTensor,
    MemoryReport,
    arena_high_water,
    predict,
    tensor_types,
)
from graphforge.graph import Model
from graphforge.model_io import ModelSource
from graphforge.placement.step import IN_PLACE_ROLES, split_program, step_models
from graphforge.program import ProgramRoles, program_proto


@dataclass
class StepMemory:
    """A training step's predicted memory: what persists (carried buffers, constants), each
    run's prediction (``runs``: label -> MemoryReport), and the peak, in the run named by
    ``peak_run``, with the tensors live there."""

    in_place: bool
    persistent: dict[str, int]
    runs: dict[str, MemoryReport]
    #: persistent memory and the arena's high-water mark over the runs (their live peaks
    #: and the holes one run's tensors leave that the next cannot use)
    peak: int
    #: the run whose live bytes peak highest
    peak_run: str
    arena: int

    @property
    def live_peak(self) -> int:
        """The highest live bytes of one run, persistent memory included (no arena holes)."""
        return self.runs[self.peak_run].peak

    @property
    def at_peak(self) -> list[LiveTensor]:
        return self.runs[self.peak_run].at_peak

    def breakdown(self) -> dict[str, int]:
        """Bytes per category at the peak, persistent memory included."""
        return self.runs[self.peak_run].breakdown()

    @property
    def unknown(self) -> list[str]:
        return sorted({name for report in self.runs.values() for name in report.unknown})


def step_memory(
    program: ModelSource | Model, *, dims: Mapping[str, int] | None = None, in_place: bool = True
) -> StepMemory:
    """The memory of one ``Module.train_step`` of ``program`` (a Module made with
    ``in_place``), its batch inputs' symbolic dims bound by ``dims``."""
    proto = program_proto(program)
    roles = ProgramRoles.of_proto(proto).require_training_program()
    types = tensor_types(proto, dims)
    sizes = {name: size for name, (size, _) in types.items() if size is not None}
    slots = {spec.input: 1 if in_place and spec.role in IN_PLACE_ROLES else 2 for spec in roles.carried}
    split = split_program(proto, roles, norm_first=True) if in_place else None
    # Module._gradient_buffers: the gradients the update reads, those of a known size
    gradients = [n for n in split.sends if n in sizes] if split is not None else []
    models = step_models(proto, roles, in_place=in_place, split=split)
    runs = {}
    for label, model in models.items():
        # the runner specializes a run to the batch's dims (Runner.session); the update's
        # shapes are all static, so onnxruntime folds its Shapes without being told
        report = predict(
            model, types=types, carried=roles.carried, slots=slots, external=gradients, specialized=bool(dims)
        )
        held = sum(sizes[n] for n in gradients)
        report.persistent["gradients"] = report.persistent.get("gradients", 0) + held
        report.peak += held
        runs[label] = report
    peak_run = max(runs, key=lambda label: runs[label].peak)
    persistent = dict(runs[peak_run].persistent)
    arena = arena_high_water([report.allocations for report in runs.values()])
    return StepMemory(in_place, persistent, runs, sum(persistent.values()) + arena, peak_run, arena)
