"""The trainers that run a whole program (or a tensor-parallel member's) in one Module: one
process, data parallel, ZeRO, and a member of a tensor group."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from graphforge.analysis.size import human_bytes
from graphforge.distributed import DataParallel, ZeroDataParallel
from graphforge.distributed.tensor_parallel import TensorParallel, member_state
from graphforge.runtime import CheckpointManager, CheckpointState, Module, Optimizer
from graphforge.runtime.fused_update import FusedUpdate, Refused, use_fused_update
from graphforge.train.data import Source
from graphforge.train.evaluation import evaluate
from graphforge.train.trainers.base import NotFinite, Topology, Trainer, check_finite
from graphforge.train.trainers.options import TrainerOptions

#: why a profiled run keeps the program's own update
PROFILED = "[profile] traces the update as onnxruntime runs it"


class ModuleTrainer(Trainer):
    """A Module over this process's program; ``module(...)`` for each micro-batch and an
    optimizer step when a step accumulates, else one ``train_step``. ``train.update`` picks its
    update where its topology leaves a choice (``refusals``: not ZeRO's, not a replica's)."""

    def __init__(self, topology: Topology, state: CheckpointState, options: TrainerOptions):
        super().__init__(topology, state, options)
        self.module = self.engine = Module(
            topology.own,
            self.state,
            device=options.device,
            dropout=options.train.dropout,
            intra_op_threads=options.threads,
            shard_optimizer_states=self.sharded,
            update="onnx",  # train.update is chosen below, once the Module is data-parallel or not
        )
        self.connect()
        if options.train.steps_per_run > 1:
            self.notes.append(
                f"update: the program's ONNX update (train.steps_per_run = {options.train.steps_per_run} runs it "
                "inside its loop)"
            )
        elif not self.sharded and options.train.update != "onnx":
            self._choose_update()
        self.optimizer = Optimizer(self.module)

    @classmethod
    def refusals(cls, options: TrainerOptions, topology: Topology) -> dict[str, str]:
        refused = super().refusals(options, topology)
        update = options.train.update
        if options.profiled and update == "torch" and not cls.shards_states(topology):
            refused["update"] = PROFILED
        elif cls.shards_states(topology) and update == "onnx":
            refused["update"] = "each process updates its shard of the optimizer states in torch's kernels"
        elif cls.replicated(topology) and not cls.shards_states(topology) and update == "torch":
            refused["update"] = "the program's ONNX update reads the gradients reduced across the replicas"
        return refused

    @classmethod
    def replicated(cls, topology: Topology) -> bool:
        """Whether the Module is one of data-parallel replicas (its gradients reduced across them)."""
        return False

    @classmethod
    def shards_states(cls, topology: Topology) -> bool:
        """Whether the optimizer states are sharded across the data-parallel replicas (ZeRO)."""
        return False

    @property
    def sharded(self) -> bool:
        return self.shards_states(self.topology)

    def connect(self) -> None:
        """Join the process groups this trainer's Module takes part in (a collective)."""

    def _choose_update(self) -> None:
        """train.update: torch's fused kernels where they compute the program's update ("auto"),
        or those kernels or an error ("torch"). A profile traces the update as onnxruntime runs it."""
        options, module = self.options, self.module
        profiled = PROFILED if options.profiled else None
        if options.train.update == "torch":
            try:
                kernel = FusedUpdate(module, foreach=True)
            except Refused as exc:
                raise options.refused("update", self.topology_name, exc.why) from None
            module.use_update_kernel(kernel)
            self.notes.append(f"update: {kernel.description}")
        else:
            self.notes.append(
                f"update: the program's ONNX update ({profiled})" if profiled else use_fused_update(module)
            )

    def step(self, batches: list[dict[str, np.ndarray]]) -> float:
        module = self.module
        losses = []
        for batch in batches:
            # one micro-batch per step: the fused step, one session.run; else accumulate, then update
            losses.append(float(module.train_step(**batch) if len(batches) == 1 else module(**batch)))
            check_finite(module, "loss", losses[-1])
        if len(batches) > 1:
            self.optimizer.step()
            module.lazy_reset_grad()
        # a program that scales its loss skipped the update itself and lowered the scale
        scaler_skipped = module.roles.loss_scaling is not None and module.last_update_skipped
        if module.last_grad_norm is not None and not scaler_skipped:
            check_finite(module, "gradient norm", module.last_grad_norm)
        return sum(losses) / len(losses)

    def evaluate(self, source: Source, output: str | None, labels: str | None) -> dict[str, float]:
        return evaluate(self.module, source.epoch(0), output=output, labels=labels, across=self.world)

    def log_values(self) -> dict[str, float]:
        if self.module.roles.loss_scaling is None:
            return {}
        return {"loss_scale": self.module.loss_scale, "skipped_updates": self.module.skipped_updates}


class OneProcess(ModuleTrainer):
    """The only process of a run; with train.steps_per_run = k, k steps a run (Module.train_steps)."""

    several_steps = True

    def run_steps(self, batches: list[dict[str, np.ndarray]], rates: list[float]) -> list[tuple[float, float | None]]:
        module = self.module
        stacked = {name: np.stack([b[name] for b in batches]) for name in batches[0]}
        losses = [float(x) for x in module.train_steps(**stacked, lr=rates)]
        norms = module.last_grad_norms
        norms = [None] * len(losses) if norms is None else [float(x) for x in norms]
        for offset, (loss, norm) in enumerate(zip(losses, norms, strict=True)):
            for what, value in (("loss", loss), ("gradient norm", norm)):
                if value is not None and not np.isfinite(value):
                    module.undo_last_run()
                    raise NotFinite(what, value, offset)
        return list(zip(losses, norms, strict=True))

    def save(self, checkpoints: CheckpointManager) -> Path:
        return checkpoints.save(self.state)


class DataParallelTrainer(ModuleTrainer):
    """One replica of a data-parallel run: its share of each batch; the gradients averaged
    across the replicas (DataParallel) before each update. Rank 0 writes the checkpoints: every
    replica holds the same state."""

    topology_name = "a data-parallel process"

    @classmethod
    def replicated(cls, topology: Topology) -> bool:
        return True

    @property
    def replicas(self) -> int:
        return self.world.size

    def connect(self) -> None:
        DataParallel(self.module, self.world, overlap=self.topology.overlap)

    def save(self, checkpoints: CheckpointManager) -> Path:
        step = int(self.state.step)
        path = checkpoints.save(self.state) if self.world.rank == 0 else checkpoints.path_for(step)
        self.barrier(f"waiting for rank 0 to write the checkpoint of step {step}")
        return path

    def describe(self) -> str:
        return f"data-parallel on {self.world.size} processes ({self.world.backend})"


class ZeroTrainer(DataParallelTrainer):
    """A data-parallel replica that holds its shard of the optimizer states (ZeRO) and runs its
    shard of the update in torch's kernels; each writes its shard of a checkpoint."""

    topology_name = "a ZeRO process"

    @classmethod
    def shards_states(cls, topology: Topology) -> bool:
        return True

    def connect(self) -> None:
        stage = self.topology.zero
        run = ZeroDataParallel(self.module, self.world, stage=stage, overlap=self.topology.overlap)
        self.notes.append(
            f"zero: stage {stage}, this process holds {human_bytes(run.state_bytes())} of optimizer state "
            f"(1/{self.world.size}); its shard of the update runs in torch's kernels"
        )

    def save(self, checkpoints: CheckpointManager) -> Path:
        path = self.module.reducer.save(checkpoints)  # each process its shard, then rank 0
        self.barrier(f"waiting for rank 0 to write the checkpoint of step {self.state.step}")
        return path


class TensorGroupTrainer(ModuleTrainer):
    """A member of a tensor group ([distributed] tensor = T): its slices of the split layers,
    every batch whole, the group's sums between its runs; with N / T processes, one of N / T
    data-parallel replicas of the group (its gradients averaged, or ZeRO over the replicas).
    A checkpoint is the first group's members' slices beside rank 0's file, which loads as
    the whole program's state."""

    topology_name = "a tensor group's member"

    @classmethod
    def replicated(cls, topology: Topology) -> bool:
        return topology.mesh.data.size > 1

    @classmethod
    def shards_states(cls, topology: Topology) -> bool:
        return topology.mesh.data.size > 1 and bool(topology.zero)

    @property
    def replicas(self) -> int:
        return self.mesh.data.size

    def resume(self, state: CheckpointState) -> CheckpointState:
        return member_state(state, self.topology.own)

    def connect(self) -> None:
        mesh, tensor = self.mesh, self.mesh.tensor.size
        self.group = TensorParallel(self.module, mesh.tensor)
        self.notes.append(f"tensor-parallel: each process holds 1/{tensor} of {len(self.group.axes)} carried tensors")
        if mesh.data.size > 1:
            overlap = self.topology.overlap
            if self.sharded:
                ZeroDataParallel(self.module, mesh.data, stage=self.topology.zero, overlap=overlap)
            else:
                DataParallel(self.module, mesh.data, overlap=overlap)
            zeroed = f", ZeRO stage {self.topology.zero} over the replicas" if self.sharded else ""
            self.notes.append(f"tensor-parallel groups of {tensor} × {mesh.data.size} data-parallel replicas{zeroed}")

    def evaluate(self, source: Source, output: str | None, labels: str | None) -> dict[str, float]:
        # the members all evaluate every batch, to the same figures
        split = output in self.group.role.split_outputs
        return evaluate(
            self.module, source.epoch(0), output=output, labels=labels, classes_across=self.group if split else None
        )

    def save(self, checkpoints: CheckpointManager) -> Path:
        tensors = self.group.current_tensors()  # (ZeRO's shards gathered: every replica)
        if self.mesh.data.rank == 0:  # the first replica's group: the others hold the same
            path = self.group.save(checkpoints, tensors)
        else:
            path = checkpoints.path_for(int(self.state.step))
        self.barrier(f"waiting for rank 0 to write the checkpoint of step {self.state.step}")
        return path

    def describe(self) -> str:
        return f"tensor-parallel on {self.world.size} processes ({self.world.backend})"
