"""graphforge: compile ordinary ONNX models into training programs that run on stock onnxruntime."""

from importlib.metadata import PackageNotFoundError, version

# the passes are part of the public API (graphforge.passes.FoldConstants(...)); imported
# last because they build on everything above
from graphforge import passes
from graphforge.errors import (
    CheckpointError,
    ConfigError,
    GenerationError,
    GraphforgeError,
    InvalidModelError,
    ModelLoadError,
    ModelSaveError,
    PassError,
    PipelineError,
    PipelineSpecError,
)
from graphforge.graph import Model
from graphforge.model_io import load, save
from graphforge.ondevice import artifacts  # `from graphforge import artifacts`, as from onnxruntime.training
from graphforge.pass_infra import Pass, PassRegistry, PassResult
from graphforge.pass_manager import CompileResult, PassManager, PassRecord, compile, default_registry, parse_pipeline
from graphforge.program import ProgramRoles
from graphforge.runtime import (
    CheckpointManager,
    CheckpointState,
    Module,
    Optimizer,
    available_providers,
    create_session,
)
from graphforge.verify import verify_model

try:
    __version__ = version("graphforge")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointState",
    "CompileResult",
    "ConfigError",
    "GenerationError",
    "GraphforgeError",
    "InvalidModelError",
    "Model",
    "ModelLoadError",
    "ModelSaveError",
    "Module",
    "Optimizer",
    "Pass",
    "PassError",
    "PassManager",
    "PassRecord",
    "PassRegistry",
    "PassResult",
    "PipelineError",
    "PipelineSpecError",
    "ProgramRoles",
    "__version__",
    "artifacts",
    "available_providers",
    "compile",
    "create_session",
    "default_registry",
    "load",
    "parse_pipeline",
    "passes",
    "save",
    "verify_model",
]
