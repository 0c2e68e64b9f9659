"""One trainer per way a process takes part in ``graphforge train``: one process
(``OneProcess``), data parallel (``DataParallelTrainer``), ZeRO (``ZeroTrainer``), a member of a
tensor group, alone or replicated (``TensorGroupTrainer``), a pipeline stage, of one pipeline or
of replicas of it (``StageTrainer``), and a stage that is a tensor group (``TensorStageTrainer``).

Each has the surface of ``Trainer``: ``resume`` (its part of the run's state), ``step``,
``evaluate``, ``save`` and ``bad_tensors``; the loop (graphforge/train/loop.py) calls them
without asking which one it has. graphforge/train/topology.py picks the one a process is.
"""

from graphforge.train.trainers.base import Trainer
from graphforge.train.trainers.modules import DataParallelTrainer, OneProcess, TensorGroupTrainer, ZeroTrainer
from graphforge.train.trainers.stages import StageTrainer, TensorStageTrainer

__all__ = [
    "DataParallelTrainer",
    "OneProcess",
    "StageTrainer",
    "TensorGroupTrainer",
    "TensorStageTrainer",
    "Trainer",
    "ZeroTrainer",
]
