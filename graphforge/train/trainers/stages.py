"""The trainers that run one pipeline stage of a program: a process per stage, and
data-parallel replicas of the pipeline; each stage may be a tensor group (T × S, T × S × D)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from graphforge.distributed.stages import Stage, StageReplicas, TorchTransport
from graphforge.distributed.tensor_parallel import TensorParallel, member_state
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointManager, CheckpointState, Module
from graphforge.train.data import Source
from graphforge.train.evaluation import evaluate
from graphforge.train.trainers.base import Topology, Trainer, all_finite, check_finite
from graphforge.train.trainers.options import TrainerOptions

#: why a stage's update is the program's own: torch's kernels run a whole program's update
#: (graphforge/runtime/fused_update.py), and a stage runs its part of it
STAGE_UPDATE = "each stage updates its own parameters"


class StageTrainer(Trainer):
    """One stage of a pipeline program (torchrun starts one process per stage, or a multiple:
    data-parallel pipelines, rank = replica × stages + stage). Every stage reads every
    micro-batch of its pipeline's share (the first its inputs, the last its labels); rank 0
    evaluates with every stage's parameters gathered. A checkpoint is each stage's tensors in
    a shard of its own, listed by rank 0's file, which loads whole."""

    topology_name = "a pipeline stage"

    def __init__(self, topology: Topology, state: CheckpointState, options: TrainerOptions):
        super().__init__(topology, state, options)
        self.stage = self.optimizer = self.engine = self._make_stage(topology)
        if options.train.update == "auto":
            self.notes.append(f"update: the program's ONNX update ({STAGE_UPDATE})")
        self._eval_module: Module | None = None  # rank 0's evaluation copy of the whole program

    @classmethod
    def refusals(cls, options: TrainerOptions, topology: Topology) -> dict[str, str]:
        refused = super().refusals(options, topology)
        if options.train.update == "torch":
            refused["update"] = f"{STAGE_UPDATE} in the program's ONNX update segments"
        return refused

    def _stage_options(self) -> dict:
        """What the Stage takes of the options."""
        options = self.options
        return {"device": options.device, "intra_op_threads": options.threads, "dropout": options.train.dropout}

    def _make_stage(self, topology: Topology) -> Stage:
        world, stages = self.world, ProgramRoles.of_proto(topology.own).stages.stages
        replicas = StageReplicas(world, stages) if world.size > stages else None
        transport = TorchTransport(world, first=world.rank - world.rank % stages, stages=stages)
        return Stage(topology.own, self.state, transport, replicas=replicas, **self._stage_options())

    @property
    def replicas(self) -> int:
        return self.world.size // self.stage.stages

    @property
    def microbatches(self) -> int:
        return self.stage.microbatches

    def step(self, batches: list[dict[str, np.ndarray]]) -> float:
        stage = self.stage
        result = stage.train_step(batches)
        check_finite(stage, "loss", result.loss)
        if stage.last_grad_norm is not None:
            check_finite(stage, "gradient norm", stage.last_grad_norm)
        return result.loss

    def gathered(self) -> dict[str, np.ndarray] | None:
        """Every stage's tensors, on rank 0 (None elsewhere; a collective)."""
        return self.stage.gathered_tensors()

    def evaluate(self, source: Source, output: str | None, labels: str | None) -> dict[str, float]:
        gathered = self.gathered()
        if gathered is None or self.world.rank != 0:
            return {}
        if self._eval_module is None:
            snapshot = self.state.copy()
            snapshot.tensors.update(gathered)
            program, dropout = self.topology.program, self.options.train.dropout
            self._eval_module = Module(program, snapshot, device=self.stage.device, dropout=dropout, update="onnx")
        else:
            self._eval_module.runner.write_tensors(gathered)
        return evaluate(self._eval_module, source.epoch(0), output=output, labels=labels)

    def save(self, checkpoints: CheckpointManager) -> Path:
        """Each stage of the first pipeline writes its own tensors (stage s > 0 a shard beside
        the checkpoint), then rank 0 writes the checkpoint file itself, with stage 0's tensors
        and the list of shards: that file, the last written, makes the checkpoint whole.
        Loading it reads the shards too (any stage count resumes)."""
        stage, state, world, step = self.stage, self.state, self.world, int(self.state.step)
        mine = stage.tensors()
        state.tensors.update(mine)  # the state's other tensors are stale here: only ``mine`` is written
        if world.rank < stage.stages and stage.stage > 0 and mine:
            checkpoints.save_shard(state, list(mine), stage.stage, stage.stages)
        holding = 1.0 if mine else 0.0
        counts = world.sum(
            [holding if world.rank == s else 0.0 for s in range(stage.stages)],
            f"waiting for the stages' shards of the checkpoint of step {step}",
        )
        if world.rank == 0:
            shards = [checkpoints.shard_path(step, s, stage.stages) for s in range(1, stage.stages) if counts[s]]
            path = checkpoints.save(state, names=list(mine), shards=shards)
        else:
            path = checkpoints.path_for(step)
        self.barrier(f"waiting for rank 0 to write the checkpoint of step {step}")
        return path

    def bad_tensors(self) -> list[str]:
        """Each stage looks at its own tensors; the stages agree."""
        bad = [name for name, value in self.stage.tensors().items() if not all_finite(value)]
        (elsewhere,) = self.world.sum([len(bad)], f"checking the state after step {self.state.step}")
        if elsewhere and not bad:
            bad = [f"{int(elsewhere)} tensor(s) of other stages"]
        return bad

    def describe(self) -> str:
        role = self.stage.role
        text = f"pipeline of {role.stages} stages × {role.microbatches} micro-batches ({role.schedule}, {self.world.backend})"
        return text + (f", data-parallel × {self.replicas}" if self.replicas > 1 else "")


class TensorStageTrainer(StageTrainer):
    """A member of the tensor group that is one stage of a pipeline (T × S), and of
    data-parallel replicas of that pipeline (T × S × D), each stage averaging its accumulated
    gradients with its replicas'. A checkpoint is the first pipeline's processes' pieces of
    their stages (their slices; member 0 the whole tensors too), listed by rank 0's file."""

    def resume(self, state: CheckpointState) -> CheckpointState:
        return member_state(state, self.topology.own)  # (the run's state: the stage advances its step)

    topology_name = "a pipeline stage of tensor groups"

    def _make_stage(self, topology: Topology) -> Stage:
        mesh = self.mesh
        replicas = StageReplicas.of_mesh(mesh) if mesh.data.size > 1 else None
        stage = Stage(topology.own, self.state, TorchTransport(mesh.stages), replicas=replicas, **self._stage_options())
        self.group = TensorParallel(stage, mesh.tensor)
        replicated = f" × {mesh.data.size} data-parallel replicas of it" if mesh.data.size > 1 else ""
        tensor = mesh.tensor.size
        self.notes.append(f"tensor-parallel groups of {tensor} as the {stage.stages} stages of a pipeline{replicated}")
        held = f"1/{tensor} of {len(self.group.axes)} carried tensors"
        self.notes.append(f"tensor-parallel: each process holds its stage's tensors, {held} of them")
        return stage

    @property
    def replicas(self) -> int:
        return self.mesh.data.size

    def gathered(self) -> dict[str, np.ndarray] | None:
        gathered = self.stage.gathered_tensors()
        if gathered is not None:  # stage 0's members: their slices joined
            gathered = self.group.join(gathered)
        return gathered

    def save(self, checkpoints: CheckpointManager) -> Path:
        """Each process of the first pipeline writes its stage's tensors in a file of its own
        (its slices of the split ones; member 0 the whole ones too; the other replicas hold the
        same), then rank 0 the checkpoint file, listing them all: it loads as the whole
        program's state, as a single run's checkpoint does."""
        stage, group, state, step = self.stage, self.group, self.state, int(self.state.step)
        members = group.role.size
        mine = group.current_tensors()
        state.tensors.update(mine)  # the state's other tensors are stale here: only ``mine`` is written
        whole = [n for n in mine if n not in group.axes] if group.role.rank == 0 else []
        path = checkpoints.piece_path(step, stage.stage, stage.stages, group.role.rank, members)
        if self.mesh.data.rank == 0:
            checkpoints.directory.mkdir(parents=True, exist_ok=True)
            state.save(path, names=whole, parts=group.parts(mine))
        self.world.barrier(f"waiting for every stage's pieces of the checkpoint of step {step}")
        if self.world.rank == 0:
            pieces = [
                checkpoints.piece_path(step, s, stage.stages, t, members)
                for s in range(stage.stages)
                for t in range(members)
            ]
            path = checkpoints.save(state, names=[], shards=pieces)
        else:
            path = checkpoints.path_for(step)
        self.barrier(f"waiting for rank 0 to write the checkpoint of step {step}")
        return path
