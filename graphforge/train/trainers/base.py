"""What every trainer offers the loop, and what each is made from (``Topology``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx

from graphforge.distributed import Mesh, World
from graphforge.runtime import CheckpointManager, CheckpointState
from graphforge.train.config import Config
from graphforge.train.data import ALL, Shard, Source
from graphforge.train.trainers.options import TrainerOptions


@dataclass
class Topology:
    """This process's part in a run (graphforge/train/topology.py's ``place``): which trainer
    it is, what it runs and which share of the data it reads."""

    kind: type[Trainer]
    #: the config as this topology runs it (a pipeline's micro-batches as train.accumulate),
    #: which setup.py builds the trainer's options from; trainers read their options only
    config: Config
    #: the whole program: what OUT/program.onnx and every checkpoint hold
    program: onnx.ModelProto
    #: what this process runs: the program, or its tensor-parallel member's
    own: onnx.ModelProto
    compiled_from: str
    world: World | None = None
    mesh: Mesh | None = None
    #: this process's share of the training data, and of the evaluation data
    shard: Shard = ALL
    eval_shard: Shard = ALL
    #: ZeRO's stage over the data-parallel replicas (0: none)
    zero: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def overlap(self) -> bool:
        """[distributed] overlap: reduce each gradient bucket while backward computes the next."""
        return self.config.distributed.overlap


class NotFinite(Exception):
    """Raised by a step whose loss or gradient norm is not finite, after undoing it; ``offset``:
    which of the steps of one run (train.steps_per_run), all undone."""

    def __init__(self, what: str, value: float, offset: int = 0):
        super().__init__(what, value)
        self.what = what
        self.value = value
        self.offset = offset


def check_finite(engine, what: str, value: float) -> None:
    """Undo ``engine``'s last run (a Module's, a Stage's) and raise NotFinite if ``value`` is not finite."""
    if not math.isfinite(value):
        engine.undo_last_run()
        raise NotFinite(what, value)


def all_finite(value: np.ndarray) -> bool:
    return not np.issubdtype(value.dtype, np.floating) or bool(np.isfinite(value).all())


class Trainer:
    """The way one process takes part in a run. The loop reads ``state`` (step, learning rate,
    properties), steps, evaluates and saves through this surface only.

    ``engine`` is what runs the program (a Module, or a pipeline Stage); ``optimizer`` is what
    the learning-rate schedule sets the rate of. ``options`` (TrainerOptions) is what the run
    asks of it: it honours each, or ``refusals`` names the ones it cannot before it is made."""

    #: the run line's words for it ("data-parallel on 4 processes (gloo)"), "" for one process
    describe_as: ClassVar[str] = ""
    #: what its refusals call it ("a pipeline stage")
    topology_name: ClassVar[str] = "one process"
    #: whether it runs several steps in one run (train.steps_per_run > 1: ``run_steps``)
    several_steps: ClassVar[bool] = False

    def __init__(self, topology: Topology, state: CheckpointState, options: TrainerOptions):
        self.topology = topology
        self.options = options
        self.world = topology.world
        self.mesh = topology.mesh
        self.notes: list[str] = []
        #: this process's part of the run's state: its step, learning rate and tensors
        self.state = self.resume(state)

    # ------------------------------------------------------------------ what each trainer is

    @classmethod
    def refusals(cls, options: TrainerOptions, topology: Topology) -> dict[str, str]:
        """The options this topology cannot honour, by [train] key: why not (checked before the
        trainer is made; a trainer that learns of one only as it is made raises ``options.refused``)."""
        device = options.train.device
        if topology.world is not None and device is not None and ":" in device:
            return {
                "device": "each process of a torchrun run takes its own device (cuda:LOCAL_RANK on a GPU); "
                f'name its type alone ("{device.split(":")[0]}")'
            }
        if options.train.steps_per_run > 1 and not cls.several_steps:
            return {
                "steps_per_run": "several steps in one run take one process's whole program, and here each step "
                "is cut where the processes exchange values"
            }
        return {}

    @classmethod
    def check(cls, options: TrainerOptions, topology: Topology) -> None:
        """Raise the ConfigError of the first option this topology refuses."""
        refused = cls.refusals(options, topology)
        if refused:
            key, why = next(iter(refused.items()))
            raise options.refused(key, cls.topology_name, why)

    def resume(self, state: CheckpointState) -> CheckpointState:
        """This process's part of ``state``, the whole program's (a fresh one, or a checkpoint's)."""
        return state

    @property
    def replicas(self) -> int:
        """How many processes share each global batch (each its share of it)."""
        return 1

    @property
    def microbatches(self) -> int:
        """How many batches one step reads."""
        return self.options.train.accumulate

    def step(self, batches: list[dict[str, np.ndarray]]) -> float:
        """One optimizer step over ``batches``: their mean loss. Raises NotFinite, the step undone."""
        raise NotImplementedError

    @property
    def steps_per_run(self) -> int:
        return self.options.train.steps_per_run

    def run_steps(self, batches: list[dict[str, np.ndarray]], rates: list[float]) -> list[tuple[float, float | None]]:
        """len(batches) optimizer steps in one run, one batch each at ``rates``: each step's loss
        and gradient norm. Raises NotFinite, every step of the run undone (``several_steps`` only)."""
        raise NotImplementedError

    def evaluate(self, source: Source, output: str | None, labels: str | None) -> dict[str, float]:
        """The evaluation over ``source``'s first epoch ({} on a process that gets none)."""
        raise NotImplementedError

    def save(self, checkpoints: CheckpointManager) -> Path:
        """Checkpoint ``state`` (a collective where there are several processes): the path of the checkpoint."""
        raise NotImplementedError

    def bad_tensors(self) -> list[str]:
        """The carried tensors that hold nan or inf values (where the run's processes hold others, they agree)."""
        return [name for name, value in self.state.tensors.items() if not all_finite(value)]

    def log_values(self) -> dict[str, float]:
        """What a logged step records besides the loop's own values."""
        return {}

    def describe(self) -> str:
        """The run line's part that says how the processes split the work ("" for one process)."""
        return self.describe_as

    # ------------------------------------------------------------------ the engine's

    engine = None
    optimizer = None

    @property
    def device(self) -> str:
        return self.engine.device

    @property
    def learning_rate(self) -> float:
        return self.engine.learning_rate

    @property
    def last_grad_norm(self) -> float | None:
        return self.engine.last_grad_norm

    def barrier(self, what: str) -> None:
        if self.world is not None:
            self.world.barrier(what)
