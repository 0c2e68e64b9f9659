"""onnxruntime's per-op profile of chosen training steps, of the very runs that train.

onnxruntime profiles a whole session or nothing (``SessionOptions.enable_profiling`` is fixed
when the session is made). So for the profiled steps the Module trains through twin sessions
of its lean models, made with profiling on and bound to the same ping-pong buffers
(``Module.start_profiling``): the trace holds exactly the runs of those steps, the fused step
or, with ``train.accumulate > 1``, every micro-batch's forward/backward and the update, and
training goes on from their results as from any other step. After the last profiled step the
twins end (``Module.end_profiling``) and their traces (Chrome trace-event JSON: one
``model_run`` event per run, one event per node and kernel) are merged on one clock into
``profile/steps-<first>-<last>.json`` in the output folder. Open it in chrome://tracing or
https://ui.perfetto.dev. Each twin's first run includes its memory arena's first
allocations; profile more than one step to see the steady state.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from graphforge.roles import PROGRAM_PARTS
from graphforge.runtime import Module
from graphforge.tempfiles import write_atomically

PROFILE_DIR = "profile"


class StepProfiler:
    """Profiles steps ``first`` .. ``first + count - 1`` (steps count from 1)."""

    def __init__(self, folder: Path, first: int, count: int):
        self.folder = folder
        self.first = first
        self.last = first + count - 1
        self.path: Path | None = None
        self.summary: TraceSummary | None = None
        self._module: Module | None = None

    def wants(self, step: int) -> bool:
        """Whether step ``step`` (counting from 1) is profiled."""
        return self.first <= step <= self.last

    def start(self, module: Module) -> None:
        """Profile the module's runs from now on (once; later calls do nothing)."""
        if self._module is None and self.path is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            module.start_profiling((self.folder / "onnxruntime").resolve())
            self._module = module

    def finish(self) -> Path | None:
        """Stop profiling and write the merged trace (if any step was profiled); returns its path.
        ``summary`` then holds where the kernel time went."""
        if self._module is None:
            return self.path
        traces = self._module.end_profiling()
        self._module = None
        self.path = self.folder / f"steps-{self.first}-{self.last}.json"
        self.summary = summarize_events(merge_traces(traces, self.path))  # each trace read once
        return self.path


@dataclass
class TraceSummary:
    """Kernel time (microseconds, summed over threads' critical path as onnxruntime reports
    it per node) by program part (forward, loss, backward, optimizer) and by op type."""

    runs: int = 0
    by_part: Counter = field(default_factory=Counter)
    by_op: Counter = field(default_factory=Counter)

    @property
    def total(self) -> float:
        return sum(self.by_part.values())

    def shares(self, counter: Counter, top: int | None = None) -> list[tuple[str, float]]:
        """(name, share of the total kernel time), largest first."""
        total = self.total or 1.0
        return [(name, value / total) for name, value in counter.most_common(top)]

    def line(self, top: int = 5) -> str:
        """One line: the parts' shares, then the ``top`` op types'."""
        parts = ", ".join(f"{name} {share:.0%}" for name, share in self.shares(self.by_part))
        ops = ", ".join(f"{name} {share:.0%}" for name, share in self.shares(self.by_op, top))
        return f"{parts}; top ops: {ops}"


def part_of(node_name: str) -> str:
    """The program part a node belongs to, from its name (onnxruntime's fusions keep the
    name of the node they started from, after a ``fused `` prefix)."""
    name = node_name.removeprefix("fused ")
    return next((part for prefix, part in PROGRAM_PARTS.items() if name.startswith(prefix)), "forward")


def summarize_traces(files: list[Path], *, skip_first_run: bool = True) -> TraceSummary:
    """Where the kernel time of the profiled runs went, from trace files (one per session)."""
    return summarize_events([json.loads(Path(file).read_text()) for file in files], skip_first_run=skip_first_run)


def summarize_events(sessions: list[list[dict]], *, skip_first_run: bool = True) -> TraceSummary:
    """Where the kernel time of the profiled runs went, from each session's trace events.
    ``skip_first_run``: leave out each session's first run, which also pays for its memory
    arena's first allocations (kept when a session ran only once)."""
    summary = TraceSummary()
    for events in sessions:
        runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
        skip_until = runs[0][1] if skip_first_run and len(runs) > 1 else float("-inf")
        summary.runs += len(runs) - (1 if skip_until > float("-inf") else 0)
        for event in events:
            name = event.get("name", "")
            if event.get("cat") != "Node" or not name.endswith("_kernel_time") or event["ts"] < skip_until:
                continue
            node = name.removesuffix("_kernel_time")
            summary.by_part[part_of(node)] += event["dur"]
            summary.by_op[event.get("args", {}).get("op_name", "?")] += event["dur"]
    return summary


def merge_traces(traces: list[tuple[Path, int]], path: Path) -> list[list[dict]]:
    """One trace of several sessions' traces, on one clock: each event's ``ts`` (microseconds
    since its session's profiling start) moved to microseconds since the earliest start.
    The session traces are removed; returns each session's events, moved."""
    sessions = []
    origin = min((start for _, start in traces), default=0)
    for file, start in traces:
        offset = (start - origin) / 1000
        events = json.loads(file.read_text())
        for event in events:
            if offset and isinstance(event.get("ts"), int | float):
                event["ts"] = event["ts"] + offset
        sessions.append(events)
    write_atomically(path, json.dumps([event for events in sessions for event in events]).encode())
    for file, _ in traces:
        file.unlink(missing_ok=True)
    return sessions
