"""onnxruntime execution: providers, sessions, the runner and its executor of segments, the training
API, checkpoints and LR schedules."""

from graphforge.runtime.checkpoint import CheckpointManager, CheckpointState
from graphforge.runtime.devices import Device, resolve_device
from graphforge.runtime.lr_schedules import (
    ConstantSchedule,
    CosineSchedule,
    LinearSchedule,
    LRSchedule,
    PolynomialSchedule,
    make_schedule,
    schedule_from_state_dict,
)
from graphforge.runtime.runner import Execution, Runner, SegmentRun
from graphforge.runtime.sessions import available_providers, create_session
from graphforge.runtime.training import Module, Optimizer

__all__ = [
    "CheckpointManager",
    "CheckpointState",
    "ConstantSchedule",
    "CosineSchedule",
    "Device",
    "Execution",
    "LRSchedule",
    "LinearSchedule",
    "Module",
    "Optimizer",
    "PolynomialSchedule",
    "Runner",
    "SegmentRun",
    "available_providers",
    "create_session",
    "make_schedule",
    "resolve_device",
    "schedule_from_state_dict",
]
