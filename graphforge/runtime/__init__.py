"""onnxruntime execution: providers, sessions, the training API, checkpoints and LR schedules."""

from graphforge.runtime.checkpoint import CheckpointManager, CheckpointState
from graphforge.runtime.lr_schedules import (
    ConstantSchedule,
    CosineSchedule,
    LinearSchedule,
    LRSchedule,
    PolynomialSchedule,
    make_schedule,
    schedule_from_state_dict,
)
from graphforge.runtime.sessions import available_providers, create_session
from graphforge.runtime.training import Module, Optimizer

__all__ = [
    "CheckpointManager",
    "CheckpointState",
    "ConstantSchedule",
    "CosineSchedule",
    "LRSchedule",
    "LinearSchedule",
    "Module",
    "Optimizer",
    "PolynomialSchedule",
    "available_providers",
    "create_session",
    "make_schedule",
    "schedule_from_state_dict",
]
