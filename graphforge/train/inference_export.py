"""The inference model of a trained program: ``graphforge export PROGRAM --checkpoint CKPT -o OUT``.

The program is pruned to its forward outputs (the ``prune`` pass, through
graphforge/runtime/inference.py: loss, gradients and optimizer go, Dropout and BatchNorm switch to
inference) holding the checkpoint's trained parameters and buffers, and written atomically.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from graphforge.analysis.size import ModelSize, human_bytes
from graphforge.errors import CheckpointError, GraphforgeError
from graphforge.graph import Model
from graphforge.model_io import ModelSource, load, save
from graphforge.runtime import CheckpointManager, CheckpointState
from graphforge.runtime.inference import export_inference_model
from graphforge.train.resume import CHECKPOINTS


@dataclass(frozen=True)
class ExportReport:
    """What was exported, and how the inference model compares with the program."""

    path: Path
    outputs: list[str]
    checkpoint: Path | None
    step: int | None
    program_size: ModelSize
    exported_size: ModelSize
    program_bytes: int
    exported_bytes: int

    def rows(self) -> list[tuple[str, str, str]]:
        """(what, program, exported) for the size table."""
        before, after = self.program_size, self.exported_size
        return [
            ("nodes", f"{before.nodes:,}", f"{after.nodes:,}"),
            ("inputs", f"{before.inputs:,}", f"{after.inputs:,}"),
            ("outputs", f"{before.outputs:,}", f"{after.outputs:,}"),
            ("stored tensors", human_bytes(before.tensor_bytes), human_bytes(after.tensor_bytes)),
            ("file", human_bytes(self.program_bytes), human_bytes(self.exported_bytes)),
        ]


def find_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint file; for a folder, the latest checkpoint in it (or in its checkpoints/
    subfolder, so a training run's output folder works too)."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for folder in (path, path / CHECKPOINTS):
            latest = CheckpointManager(folder).latest()
            if latest is not None:
                return latest
        raise CheckpointError(f"{path}: no checkpoint in this folder (checkpoint-<step>.safetensors)")
    raise CheckpointError(f"{path}: no such checkpoint file or folder")


def export(
    program: ModelSource,
    out: str | os.PathLike,
    *,
    checkpoint: str | os.PathLike | None = None,
    outputs: Sequence[str] | None = None,
    dtype: str = "float32",
) -> ExportReport:
    """Write the inference model of ``program`` to ``out``: ``outputs`` (default: the forward
    outputs) computed with the trained values of ``checkpoint`` (a file, or a folder: its
    latest checkpoint; None: the program's own values), in float32 or (``dtype``) float16
    or bfloat16."""
    if dtype not in ("float32", "float16", "bfloat16"):
        raise GraphforgeError(f"--dtype {dtype}: use float32, float16 or bfloat16")
    proto = load(program)
    values, step, checkpoint_path = None, None, None
    if checkpoint is not None:
        checkpoint_path = find_checkpoint(checkpoint)
        state = CheckpointState.load(checkpoint_path, proto)
        kept = {spec.name for spec in state.specs if spec.role in ("parameter", "buffer")}
        values = {name: value for name, value in state.tensors.items() if name in kept}
        step = state.step
    model = export_inference_model(proto, values, list(outputs) if outputs else None, dtype=dtype)
    path = save(model, out)
    exported_bytes = path.stat().st_size
    data = path.parent / (path.name + ".data")
    if data.is_file():
        exported_bytes += data.stat().st_size
    program_bytes = Path(program).stat().st_size if isinstance(program, str | os.PathLike) else proto.ByteSize()
    return ExportReport(
        path=path,
        outputs=[o.name for o in model.graph.output],
        checkpoint=checkpoint_path,
        step=step,
        program_size=ModelSize.of(Model.from_proto(proto)),
        exported_size=ModelSize.of(Model.from_proto(model)),
        program_bytes=program_bytes,
        exported_bytes=exported_bytes,
    )
