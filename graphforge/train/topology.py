"""Which way this process takes part in a run, decided once, before any data or state is read.

``place`` reads the run's processes (torchrun's World, or none), ``[distributed]`` and the
compiled program, and says which trainer this process is (graphforge/train/trainers/): one
process, data parallel, ZeRO, a member of a tensor group (with data-parallel replicas of the
group, or not), a pipeline stage (of one pipeline or of data-parallel replicas of it), or a
stage that is a tensor group (T × S, T × S × D). It compiles what only this process runs (a
tensor-parallel member's program, the reduction a data-parallel program needs) and says which
share of the data it reads. The rest of ``prepare`` and the loop never ask which it is.
"""

from __future__ import annotations

import dataclasses
import os

import onnx

from graphforge.distributed import World
from graphforge.errors import ConfigError
from graphforge.pass_manager import PassManager, parse_pipeline
from graphforge.passes import AllReduce, Zero
from graphforge.program import ProgramRoles, StagesRole
from graphforge.train.config import Config
from graphforge.train.data import ALL, Shard
from graphforge.train.trainers import (
    DataParallelTrainer,
    OneProcess,
    StageTrainer,
    TensorGroupTrainer,
    TensorStageTrainer,
    ZeroTrainer,
)
from graphforge.train.trainers.base import Topology, Trainer
from graphforge.train.trainers.options import refusal


def place(
    config: Config, world: World | None, program: onnx.ModelProto, compiled_from: str, compile_member
) -> Topology:
    """This process's Topology. ``program`` is the whole program (with ``tensor_parallel(size=T)``
    where [distributed] tensor = T); ``compile_member(rank)`` compiles tensor-parallel member
    ``rank``'s program, and says how (as ``compiled_from`` does)."""
    staged = ProgramRoles.of_proto(program).stages
    if world is None:  # a pipeline program's micro-batches then run in turn, accumulated
        notes = []
        if config.distributed.tensor > 1:
            tensor = config.distributed.tensor
            notes.append(
                f"distributed.tensor = {tensor} splits the model across processes that torchrun starts; started "
                f"alone, this run trains the whole model on one process (torchrun --nproc-per-node={tensor} -m "
                "graphforge train ... splits it)"
            )
        if staged is not None:
            config = _stages_config(config, staged, None, OneProcess)
            _refuse_zero_with_stages(config)
        return Topology(OneProcess, config, program, program, compiled_from, notes=notes)
    if config.distributed.tensor > 1:
        return _tensor_groups(config, world, program, compiled_from, compile_member)
    if staged is not None:
        config = _stages_config(config, staged, world, StageTrainer)
        _refuse_zero_with_stages(config)
        replicas = world.size // staged.stages
        shard = Shard(replicas, world.rank // staged.stages) if replicas > 1 else ALL
        # a pipeline evaluates on rank 0, with every stage's parameters gathered there: all of the data
        return Topology(StageTrainer, config, program, program, compiled_from, world, shard=shard)
    zero, bucket_mb = config.distributed.zero, config.distributed.bucket_mb
    reduction = ProgramRoles.of_proto(program).allreduce
    if reduction is None:
        added = Zero(stage=zero, bucket_mb=bucket_mb) if zero else AllReduce(bucket_mb=bucket_mb)
        program = PassManager([added]).run(program).model
        compiled_from += f", + {added.name}({f'stage={zero}, ' if zero else ''}bucket_mb={bucket_mb:g})"
    elif zero and not reduction.zero:
        raise ConfigError(
            f"{config.where}: distributed.zero = {zero}, but the program was compiled with the allreduce pass: "
            f"compile it without it (graphforge train adds zero(stage={zero})) or with zero(stage={zero})"
        )
    sharded = ProgramRoles.of_proto(program).allreduce.zero
    shard = Shard(world.size, world.rank)
    kind = ZeroTrainer if sharded else DataParallelTrainer
    return Topology(
        kind, config, program, program, compiled_from, world, shard=shard, eval_shard=shard, zero=zero or sharded
    )


def _tensor_groups(config: Config, world: World, program, compiled_from: str, compile_member) -> Topology:
    """Tensor groups of [distributed] tensor = T processes: alone, as a pipeline's stages, and
    data-parallel replicas of either."""
    where, tensor = config.where, config.distributed.tensor
    staged = ProgramRoles.of_proto(program).stages
    stages = _tensor_stages(config, staged, world) if staged is not None else 1
    mesh = world.mesh(tensor=tensor, stages=stages)
    member, compiled_from = compile_member(mesh.tensor.rank)  # (rank 0 prints it: member 0's)
    compiled_from += f"; each of the {tensor} members of a group compiles its own rank's"
    zero = config.distributed.zero
    if mesh.data.size == 1 and zero:
        raise ConfigError(
            f"{where}: distributed.zero = {zero} shards optimizer states across data-parallel "
            f"replicas, but the {world.size} processes are one tensor group of {tensor}: start a multiple of "
            f"{tensor} processes, or leave distributed.zero out"
        )
    # a tensor group's members all take every batch whole (their replica's share)
    shard = Shard(mesh.data.size, mesh.data.rank) if mesh.data.size > 1 else ALL
    if staged is not None:
        config = _stages_config(config, staged, world, TensorStageTrainer)
        _refuse_zero_with_stages(config)
        return Topology(TensorStageTrainer, config, program, member, compiled_from, world, mesh, shard)
    if mesh.data.size > 1:  # the replicas' gradients averaged
        added = (
            Zero(stage=zero, bucket_mb=config.distributed.bucket_mb)
            if zero
            else AllReduce(bucket_mb=config.distributed.bucket_mb)
        )
        member = PassManager([added]).run(member).model
    return Topology(TensorGroupTrainer, config, program, member, compiled_from, world, mesh, shard, shard, zero)


def check_tensor_parallel(config: Config, world: World) -> None:
    """[distributed] tensor = T: refuse what a tensor-parallel run cannot do (yet), by name."""
    where, tensor = config.where, config.distributed.tensor
    if config.model.program is not None:
        raise ConfigError(
            f"{where}: distributed.tensor = {tensor} needs model.path and model.pipeline: each process compiles "
            "its own member's program (tensor_parallel(size=T, rank=r) before the pipeline)"
        )
    if any(p.name == "tensor_parallel" for p in parse_pipeline(config.model.pipeline)):
        raise ConfigError(
            f"{where}: model.pipeline has tensor_parallel(...) and distributed.tensor = {tensor} adds it: leave it "
            "out of the pipeline"
        )
    if world.size % tensor:
        raise ConfigError(
            f"{where}: distributed.tensor = {tensor}, but {world.size} process(es) were started: start a multiple "
            f"of {tensor} (tensor groups of {tensor} × data-parallel replicas)"
        )


def _tensor_stages(config: Config, staged: StagesRole, world: World) -> int:
    """The pipeline stages of a tensor-parallel run: tensor groups as the stages of a
    pipeline (T × S), and data-parallel replicas of that pipeline (T × S × D)."""
    tensor, stages = config.distributed.tensor, staged.stages
    if world.size % (tensor * stages):
        raise ConfigError(
            f"{config.where}: distributed.tensor = {tensor} with {stages} pipeline stages runs on a multiple of "
            f"{tensor * stages} processes (a tensor group of {tensor} as each stage, × data-parallel replicas of the "
            f"pipeline), but {world.size} were started"
        )
    return stages


def _stages_config(config: Config, staged: StagesRole, world: World | None, kind: type[Trainer]) -> Config:
    """A pipeline program's step is its micro-batches (``data.batch_size`` each): on one
    process they run in turn (``train.accumulate`` = micro-batches), under torchrun one
    process per stage (``kind``, the trainer place() chose, names it in a refusal)."""
    where, micro = config.where, staged.microbatches
    if config.train.accumulate not in (1, micro):
        why = f"the program's pipeline runs {micro} micro-batches per step; leave train.accumulate out"
        raise refusal(where, "accumulate", config.train.accumulate, kind.topology_name, why)
    if world is not None and world.size % staged.stages:
        raise ConfigError(
            f"{where}: the program has {staged.stages} pipeline stages, but {world.size} processes were started; "
            f"start one per stage, or a multiple of that for data-parallel pipelines "
            f"(torchrun --nproc-per-node={staged.stages} or {2 * staged.stages}, ...)"
        )
    return dataclasses.replace(config, train=dataclasses.replace(config.train, accumulate=micro))


def _refuse_zero_with_stages(config: Config) -> None:
    zero = config.distributed.zero
    if zero:
        raise ConfigError(
            f"{config.where}: distributed.zero = {zero} with pipeline stages: each stage already keeps only its own "
            "parameters' optimizer states; leave distributed.zero out (or 0)"
        )


def threads_per_process() -> int:
    """onnxruntime's threads in each of several processes on one machine's CPUs: what
    OMP_NUM_THREADS says (torchrun sets 1 unless told otherwise, as for torch), else the
    cores shared out between the processes (LOCAL_WORLD_SIZE)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
