"""``graphforge inspect --memory``: the predicted peak memory of a model's run, as tables."""

from __future__ import annotations

import onnx
from rich.markup import escape
from rich.table import Table

from graphforge.analysis.memory import CATEGORIES, predict
from graphforge.analysis.size import human_bytes
from graphforge.placement.step_memory import step_memory
from graphforge.program import ProgramRoles

#: the tensors listed as live at the peak
LARGEST = 10


def memory_tables(proto: onnx.ModelProto, dims: dict[str, int], *, in_place: bool = True) -> list[Table | str]:
    """The breakdown at the peak, each run's live peak, and the largest tensors live there:
    a training program's step as a Module runs it, any other model's inference run."""
    if ProgramRoles.of_proto(proto).is_training_program:
        step = step_memory(proto, dims=dims, in_place=in_place)
        mode = "parameters and optimizer states in place" if in_place else "two buffers per carried tensor"
        title = f"memory of a training step ({mode}): peak {human_bytes(step.peak)}"
        breakdown, at_peak, unknown = step.breakdown(), step.at_peak, step.unknown
        runs = Table(title="runs", title_justify="left")
        for column, justify in (("run", "left"), ("live peak", "right"), ("at node", "left")):
            runs.add_column(column, justify=justify)  # type: ignore[arg-type]
        for label, report in step.runs.items():
            runs.add_row(label, human_bytes(report.peak), escape(report.peak_node or "—"))
        arena = (
            f"the arena holds {human_bytes(step.arena)} at most (the runs' live peaks and the holes one run "
            "leaves that the next cannot use), on top of the persistent memory"
        )
        extra: list[Table | str] = [runs, arena]
    else:
        report = predict(proto, dims=dims)
        title = f"memory of an inference run: peak {human_bytes(report.peak)}"
        breakdown, at_peak, unknown, extra = report.breakdown(), report.at_peak, report.unknown, []
    parts = Table(title=title, title_justify="left")
    parts.add_column("part")
    parts.add_column("at the peak", justify="right")
    for category in CATEGORIES:
        if breakdown.get(category):
            parts.add_row(category, human_bytes(breakdown[category]))
    largest = Table(title=f"largest tensors live at the peak (of {len(at_peak)})", title_justify="left")
    for column, justify in (("tensor", "left"), ("part", "left"), ("size", "right")):
        largest.add_column(column, justify=justify)  # type: ignore[arg-type]
    for tensor in at_peak[:LARGEST]:
        largest.add_row(escape(tensor.name), tensor.category, human_bytes(tensor.bytes))
    notes: list[Table | str] = []
    if unknown:
        notes.append(f"{len(unknown)} tensors of unknown size count as 0 (e.g. {escape(unknown[0])}): name their dims")
    return [parts, *extra, largest, *notes]
