"""What a trainer is asked to do: the run's ``[train]`` keys and this process's part of them,
in one object that setup.py builds once and hands to every trainer."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from graphforge.errors import ConfigError
from graphforge.train.config import TrainConfig


@dataclass(frozen=True)
class TrainerOptions:
    """Every ``[train]`` key of a run (``train``: the config's TrainConfig, ``accumulate`` as the
    topology runs it: a pipeline's micro-batches), with what this process makes of them.

    Each trainer honours each option or refuses it: ``Trainer.refusals`` says, before the
    trainer is made, which values its topology cannot honour and why, and ``refused`` is the
    one error a refusal raises (``train.toml: train.update = "torch" is not available for a
    pipeline stage: ...``). Some keys are honoured around the trainers rather than in them:
    ``steps`` and ``epochs`` by the loop, ``lr`` by the schedule that sets the trainer's
    optimizer, ``device`` where setup.py builds these options.

    A new option is a field of TrainConfig (graphforge/train/config.py) and the code that
    uses it, reading ``options.train.<key>``; a trainer that cannot honour some value adds it
    to its ``refusals``. Nothing here changes: the options carry every key, and the processes
    of a run agree on all of them (setup.py). tests/distributed/test_train_options.py holds a
    row per key and topology, and fails for a key without one.
    """

    train: TrainConfig
    #: where this process runs: train.device alone; under torchrun the rank's (World.device)
    device: str | None = None
    #: onnxruntime's intra-op threads (None: its default)
    threads: int | None = None
    #: whether [profile] traces the run (which then keeps the program's own update, to trace it)
    profiled: bool = False
    #: the config file, for messages
    where: str = "the config"

    def agreed(self) -> dict[str, Any]:
        """What every process of a run must have the same of (the device is each process's own)."""
        return {f"train.{key}": value for key, value in dataclasses.asdict(self.train).items() if key != "device"}

    def refused(self, key: str, topology: str, why: str) -> ConfigError:
        """The error refusing ``train.<key>``'s value on ``topology`` ("a pipeline stage"), for ``why``."""
        return refusal(self.where, key, getattr(self.train, key), topology, why)


def refusal(where: str, key: str, value: Any, topology: str, why: str) -> ConfigError:
    """The one error of a [train] key's value that ``topology`` cannot honour (TrainerOptions.refused's)."""
    shown = json.dumps(value) if isinstance(value, str) else repr(value)
    return ConfigError(f"{where}: train.{key} = {shown} is not available for {topology}: {why}")
