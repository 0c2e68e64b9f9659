"""onnxruntime's per-op profile of chosen training steps.

onnxruntime profiles a whole session or nothing (``SessionOptions.enable_profiling`` is fixed
when the session is made), so the profiled steps run in a second session of the same
program with profiling on, beside the training session: for each batch of a profiled step
it runs the whole training step on a copy of the current state, and training itself goes
on untouched. ``end_profiling`` then writes the trace (Chrome trace-event JSON: one
``model_run`` event per run, one event per node and kernel) and it is moved to
``profile/steps-<first>-<last>.json`` in the output folder. Open it in chrome://tracing or
https://ui.perfetto.dev.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx

from graphforge import roles
from graphforge.runtime import Module, create_session
from graphforge.runtime.sessions import CPU, CUDA, session_options

PROFILE_DIR = "profile"


class StepProfiler:
    """Profiles steps ``first`` .. ``first + count - 1`` (steps count from 1)."""

    def __init__(self, program: onnx.ModelProto, folder: Path, first: int, count: int):
        self.program = program
        self.folder = folder
        self.first = first
        self.last = first + count - 1
        self.path: Path | None = None
        self._session = None
        meta = {p.key: p.value for p in program.metadata_props}
        self._lr = meta.get(roles.LR, "lr")
        self._step = meta.get(roles.STEP, "step")
        self._reset = meta.get(roles.RESET_GRAD)

    def wants(self, step: int) -> bool:
        """Whether step ``step`` (counting from 1) is profiled."""
        return self.first <= step <= self.last

    def run(self, module: Module, batch: dict[str, np.ndarray]) -> None:
        """The training step on ``batch`` from the module's current state, in the profiled session."""
        if self._session is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            options = session_options()
            options.enable_profiling = True
            options.profile_file_prefix = str((self.folder / "onnxruntime").resolve())
            providers = _providers(module.device)
            self._session = create_session(
                self.program, providers=providers, options=options, where="the profiled program"
            )
        feeds = dict(module.state.tensors)
        feeds[self._lr] = np.array(module.learning_rate, np.float32)
        feeds[self._step] = np.array(module.state.step, np.int64)
        if self._reset is not None:
            feeds[self._reset] = np.array(True)
        feeds.update(batch)
        self._session.run(None, feeds)

    def finish(self) -> Path | None:
        """Write the trace (if any step was profiled); returns its path."""
        if self._session is None:
            return self.path
        written = Path(self._session.end_profiling())
        self._session = None
        self.path = self.folder / f"steps-{self.first}-{self.last}.json"
        os.replace(written, self.path)
        return self.path


def _providers(device: str) -> list:
    """The providers of a Module's device ("cpu" or "cuda:N"), to profile where it trains."""
    kind, _, index = device.partition(":")
    return [CPU] if kind == "cpu" else [(CUDA, {"device_id": index or "0"}), CPU]
