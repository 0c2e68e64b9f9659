"""The inference model of a trained program: ``graphforge export PROGRAM --checkpoint CKPT -o OUT``.

The program is pruned to its forward outputs (the ``prune`` pass, through
graphforge/runtime/inference.py: loss, gradients and optimizer go, Dropout and BatchNorm switch to
inference) holding the checkpoint's trained parameters and buffers, and written atomically. A
LoRA program's adapters are merged into their base weights, or kept apart
(``--adapters onnx``: onnxruntime's adapter file beside a model that reads them as inputs;
``--adapters peft``: PEFT's folder, graphforge/train/adapter_export.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from graphforge.analysis.size import ModelSize, human_bytes
from graphforge.errors import CheckpointError, GraphforgeError
from graphforge.graph import Model
from graphforge.model_io import ModelSource, load, save
from graphforge.passes.lora_peft import CONFIG, WEIGHTS, peft_config, write_peft
from graphforge.program import LoraAdapter, ProgramRoles
from graphforge.runtime import CheckpointManager, CheckpointState
from graphforge.runtime.inference import adapters_merged, export_inference_model
from graphforge.train.adapter_export import adapter_path, adapter_values, with_adapter_inputs, write_onnx_adapter
from graphforge.train.resume import CHECKPOINTS

#: how ``export`` writes a LoRA program's adapters: folded into the base weights, onnxruntime's
#: adapter file beside a model reading them as inputs, or PEFT's folder
ADAPTER_FORMATS = ("merge", "onnx", "peft")


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
    adapter_file: Path | None = None
    #: a LoRA program's adapters: "merged", "kept" (beside a quantized base, in the model) or
    #: "onnx" (the adapter file); None without adapters
    adapters: str | None = None

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
    adapters: str = "merge",
) -> ExportReport:
    """Write the inference model of ``program`` to ``out``: ``outputs`` (default: the forward
    outputs) computed with the trained values of ``checkpoint`` (a file, or a folder: its
    latest checkpoint; None: the program's own values), in float32 or (``dtype``) float16
    or bfloat16. A LoRA program's ``adapters``: "merge" folds them into their base weights
    (W + scale · B A in W's layout and type: the plain model again; a quantized base keeps
    them beside it, in the model, as merging would undo the quantization); "onnx" writes a model
    whose adapters are inputs defaulting to zeros (the base model) and their trained values
    in onnxruntime's adapter file beside it (``model.onnx_adapter``). PEFT's folder:
    ``export_peft``."""
    if dtype not in ("float32", "float16", "bfloat16"):
        raise GraphforgeError(f"--dtype {dtype}: use float32, float16 or bfloat16")
    if adapters not in ADAPTER_FORMATS[:2]:
        raise GraphforgeError(f"--adapters {adapters}: use {', '.join(ADAPTER_FORMATS)}")
    proto = load(program)
    values, step, checkpoint_path = _trained_values(proto, checkpoint)
    wanted = list(outputs) if outputs else None
    adapter_file = None
    if adapters == "onnx":
        lora = _adapters(proto, program, "onnx", dtype)
        model = export_inference_model(proto, values, wanted, merge_adapters=False)
        trained = adapter_values(model, lora)
        model = with_adapter_inputs(model, lora)
    else:
        model = export_inference_model(proto, values, wanted, dtype=dtype)
    roles = ProgramRoles.read(proto)
    done = None if not roles.lora else "onnx" if adapters == "onnx" else "merged" if adapters_merged(roles) else "kept"
    path = save(model, out)
    if adapters == "onnx":
        adapter_file = write_onnx_adapter(adapter_path(path), trained)
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
        adapter_file=adapter_file,
        adapters=done,
    )


@dataclass(frozen=True)
class PeftExport:
    """What ``export_peft`` wrote: PEFT's folder, its two files, the adapters and their
    parameter count, and the checkpoint the values came from."""

    folder: Path
    files: tuple[Path, Path]
    modules: tuple[str, ...]
    parameters: int
    checkpoint: Path | None
    step: int | None


def export_peft(
    program: ModelSource,
    out: str | os.PathLike,
    *,
    checkpoint: str | os.PathLike | None = None,
    base_model: str | None = None,
    task_type: str | None = None,
) -> PeftExport:
    """Write a LoRA program's adapters as PEFT's folder ``out``: ``adapter_model.safetensors``
    (``base_model.model.<module>.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r], the
    modules named as the export recorded them) and ``adapter_config.json`` (``base_model``
    and ``task_type`` recorded there where given), with ``checkpoint``'s trained values.
    ``peft.PeftModel.from_pretrained(base, out)`` loads them onto the torch model."""
    if Path(out).exists() and not Path(out).is_dir():
        raise GraphforgeError(f"--adapters peft: {out} is a file, not a folder")
    proto = load(program)
    lora = _adapters(proto, program, "peft", "float32")
    values, step, checkpoint_path = _trained_values(proto, checkpoint)
    model = export_inference_model(proto, values, merge_adapters=False)
    trained = adapter_values(model, lora)
    weights = {a.module: (_peft_array(trained[a.a]), _peft_array(trained[a.b])) for a in lora}
    folder = write_peft(out, peft_config(lora, base_model=base_model, task_type=task_type), weights)
    return PeftExport(
        folder=folder,
        files=(folder / WEIGHTS, folder / CONFIG),
        modules=tuple(a.module for a in lora),
        parameters=sum(int(a.size) + int(b.size) for a, b in weights.values()),
        checkpoint=checkpoint_path,
        step=step,
    )


def _trained_values(proto: onnx.ModelProto, checkpoint) -> tuple[dict | None, int | None, Path | None]:
    """The parameters and buffers of ``checkpoint`` (None: none), its step and its file."""
    if checkpoint is None:
        return None, None, None
    checkpoint_path = find_checkpoint(checkpoint)
    state = CheckpointState.load(checkpoint_path, proto)
    kept = {spec.name for spec in state.specs if spec.role in ("parameter", "buffer")}
    return {name: value for name, value in state.tensors.items() if name in kept}, state.step, checkpoint_path


def _adapters(proto: onnx.ModelProto, program: ModelSource, how: str, dtype: str) -> tuple[LoraAdapter, ...]:
    """The program's adapters, for ``--adapters how``; an error where it has none."""
    lora = ProgramRoles.read(proto).lora
    where = program if isinstance(program, str | os.PathLike) else "the program"
    if not lora:
        raise GraphforgeError(f"--adapters {how}: {where} has no LoRA adapters (compile it with the lora pass)")
    if dtype != "float32":
        raise GraphforgeError(f"--adapters {how} keeps the model's float32 weights: leave --dtype {dtype} out")
    return lora


def _peft_array(values: np.ndarray) -> np.ndarray:
    """float32 and float16 as they are; bfloat16 (which NumPy's safetensors cannot write) as float32."""
    return values if values.dtype in (np.float32, np.float16) else values.astype(np.float32)
