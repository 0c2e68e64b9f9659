"""The error hierarchy: every failure a user can cause is a GraphforgeError with one clear message."""

from __future__ import annotations


class GraphforgeError(Exception):
    """Base of every error graphforge raises on purpose.

    The message is one line that names what failed and where; the CLI prints it
    without a traceback and exits with status 2.
    """


class ModelLoadError(GraphforgeError):
    """A model file is missing, unreadable, not ONNX, or refers to unsafe external data."""


class ModelSaveError(GraphforgeError):
    """A model could not be written (the destination is left as it was)."""


class InvalidModelError(GraphforgeError):
    """A model failed the ONNX checker, shape inference, or onnxruntime's own loader."""


class PipelineSpecError(GraphforgeError):
    """A textual pipeline names an unknown pass or parameter, or a value of the wrong type."""


class PassError(GraphforgeError):
    """A pass refused or failed; the PassManager adds the pipeline position and pass name."""

    def __init__(self, message: str, *, node: str | None = None, op_type: str | None = None):
        parts = [f"node {node!r}"] if node is not None else []
        parts += [f"op {op_type}"] if op_type is not None else []
        super().__init__(message + (f" ({', '.join(parts)})" if parts else ""))
        self.node = node
        self.op_type = op_type


class PipelineError(GraphforgeError):
    """A pass failed inside a pipeline; names the position and the pass, wraps the cause."""

    def __init__(self, message: str, *, position: int, pass_name: str, dumped_to: str | None = None):
        super().__init__(message)
        self.position = position
        self.pass_name = pass_name
        self.dumped_to = dumped_to


class CheckpointError(GraphforgeError):
    """A checkpoint is missing, corrupt, or does not match the program; names the file and tensor."""


class DeviceError(GraphforgeError):
    """A device was asked for that is unknown or not usable here (CUDA without a working GPU)."""


class ConfigError(GraphforgeError):
    """A training config is unreadable, names an unknown key, a value of the wrong type, or a missing file."""


class GenerationError(GraphforgeError):
    """Generation refused: a model it cannot decode with, a tokenizer that does not fit it, a
    prompt it cannot take, or a setting out of range; names the model, file or setting."""


def one_line(exc: BaseException) -> str:
    """An exception's message as one line: onnx and onnxruntime messages span several, and
    the checker's ``==> Context: ...`` lines name the node, so they are kept, in parentheses."""
    main, context = [], []
    for line in str(exc).splitlines():
        line = " ".join(line.split())
        if line.startswith("==>"):
            context.append(line.lstrip("=> ").removeprefix("Context: "))
        elif line:
            main.append(line)
    text = " ".join(main)
    if context:
        text += f" ({'; '.join(context)})"
    return text.strip() or type(exc).__name__
