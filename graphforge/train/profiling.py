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
import os
from pathlib import Path

from graphforge.runtime import Module

PROFILE_DIR = "profile"


class StepProfiler:
    """Profiles steps ``first`` .. ``first + count - 1`` (steps count from 1)."""

    def __init__(self, folder: Path, first: int, count: int):
        self.folder = folder
        self.first = first
        self.last = first + count - 1
        self.path: Path | None = None
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
        """Stop profiling and write the merged trace (if any step was profiled); returns its path."""
        if self._module is None:
            return self.path
        traces = self._module.end_profiling()
        self._module = None
        self.path = self.folder / f"steps-{self.first}-{self.last}.json"
        merge_traces(traces, self.path)
        return self.path


def merge_traces(traces: list[tuple[Path, int]], path: Path) -> None:
    """One trace of several sessions' traces, on one clock: each event's ``ts`` (microseconds
    since its session's profiling start) moved to microseconds since the earliest start.
    The session traces are removed."""
    events = []
    origin = min((start for _, start in traces), default=0)
    for file, start in traces:
        offset = (start - origin) / 1000
        for event in json.loads(file.read_text()):
            if offset and isinstance(event.get("ts"), int | float):
                event["ts"] = event["ts"] + offset
            events.append(event)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(events))
    os.replace(tmp, path)
    for file, _ in traces:
        file.unlink(missing_ok=True)
