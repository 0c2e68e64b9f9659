"""What ``graphforge plan`` reports of a config's plan (graphforge.planning.configs): the
splits it predicted, those it could not weigh, the fastest split that fits the memory, and
the note on top of the config it writes."""

from __future__ import annotations

import shlex
from pathlib import Path

from rich.table import Table

from graphforge.analysis.size import human_bytes
from graphforge.errors import GraphforgeError
from graphforge.planning.configs import ConfigPlan
from graphforge.planning.planner import Candidate, Hardware

#: the splits that could not be weighed, each said with its reason; any more are named in one line
REASONS_SHOWN = 3
COLUMNS = ("split", "step", "compute", "tensor sums", "gradients", "bubble", "memory", "fits")


def predicted(planned: ConfigPlan) -> list[Candidate]:
    """The candidates with a prediction, in the planner's order (the fastest that fit first);
    an error with the first one's reason where no split could be predicted."""
    found = [c for c in planned.candidates if c.prediction is not None]
    if not found:
        raise GraphforgeError(
            f"no split of {planned.processes} processes could be predicted: {planned.candidates[0].reason}"
        )
    return found


def splits_table(planned: ConfigPlan, shown: list[Candidate], name: str) -> Table:
    """Each of the ``shown`` candidates' predicted step, its parts, its memory and whether it
    fits, under a title of the config's ``name``, its batch and the hardware."""
    hardware = planned.hardware
    dims_text = ", ".join(f"{k}={v}" for k, v in sorted(planned.dims.items()))
    title = (
        f"{name} on {_processes(planned.processes)}: global batch {planned.batch} ({dims_text}), "
        f"{human_bytes(hardware.memory)} each, {hardware.flops / 1e9:g} GFLOP/s each, "
        f"{hardware.bandwidth / 1e9:g} GB/s and {hardware.latency * 1e6:g} µs a message"
    )
    if hardware.node_processes:
        title += f" ({hardware.node_processes} a node, on its own link: {_link_text(hardware)})"
    table = Table(title=title, title_justify="left")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "split" else "right")
    for candidate in shown:
        p = candidate.prediction
        table.add_row(
            str(candidate.split), f"{p.step_s * 1e3:.2f} ms", f"{p.compute_s * 1e3:.2f} ms",
            f"{p.tensor_s * 1e3:.2f} ms", f"{p.data_s * 1e3:.2f} ms", f"{p.bubble:.0%}",
            human_bytes(p.memory), "yes" if p.fits else "no",
        )  # fmt: skip
    return table


def refusals(planned: ConfigPlan) -> list[tuple[str, str]]:
    """What to say of the splits that could not be weighed, as (label, text): the first
    REASONS_SHOWN each with its reason, the others named together."""
    refused = [c for c in planned.candidates if c.prediction is None]
    said = [("not a candidate", c.reason) for c in refused[:REASONS_SHOWN]]
    if len(refused) > REASONS_SHOWN:
        said.append(("not candidates either", ", ".join(str(c.split) for c in refused[REASONS_SHOWN:])))
    return said


def best_fit(planned: ConfigPlan) -> Candidate:
    """The fastest split that fits the memory; an error naming the least memory any split
    needs (and which) where none fits."""
    candidates = predicted(planned)
    best = next((c for c in candidates if c.prediction.fits), None)
    if best is None:
        least = min(candidates, key=lambda c: c.prediction.memory)
        raise GraphforgeError(
            f"no split of {_processes(planned.processes)} fits {human_bytes(planned.hardware.memory)} a process; "
            f"the least any needs is {human_bytes(least.prediction.memory)} a process ({least.split})"
        )
    return best


def run_note(planned: ConfigPlan, best: Candidate, target: Path) -> str:
    """The note on top of the config written to ``target`` with ``best``'s split: what was
    predicted, and the command that runs it from the folder graphforge plan ran in."""
    train = f"graphforge train {shlex.quote(str(target))}"
    launch = f"torchrun --nproc-per-node={planned.processes} -m {train}" if planned.processes > 1 else train
    return (
        f"planned by graphforge plan for {_processes(planned.processes)}: {best.split}, predicted "
        f"{best.prediction.step_s * 1e3:.2f} ms a step, {human_bytes(best.prediction.memory)} a process\n"
        f"run (from the folder graphforge plan ran in): {launch}"
    )


def _processes(count: int) -> str:
    return f"{count} process{'es' if count != 1 else ''}"


def _link_text(hardware: Hardware) -> str:
    bandwidth, latency = hardware.link(hardware.node_processes)
    return f"{bandwidth / 1e9:g} GB/s and {latency * 1e6:g} µs a message"
