"""The training loop behind ``graphforge train``: everything is checked first, then it trains.

``prepare`` reads the model, compiles it, opens the data and the checkpoint to resume from,
and checks every option against them; it writes nothing, so a bad config leaves no file
behind. ``Run.train`` then writes the output folder::

    OUT/program.onnx                           the compiled training program
    OUT/checkpoints/checkpoint-<step>.safetensors   every checkpoint.every steps and at the end
    OUT/log.jsonl  OUT/tensorboard/            one record per logged step (graphforge/train/logs.py)
    OUT/profile/steps-<a>-<b>.json             onnxruntime's trace of the profiled steps

A checkpoint holds the step, the learning rate, the schedule's state, the data seed and the
stream position (epoch, batch), so resuming from it continues bit-identically to a run that
was never interrupted. Ctrl-C stops at the end of the current step, saves a checkpoint and
raises :class:`Interrupted` (a second Ctrl-C stops at once; the checkpoint then holds the
state before the unfinished step).

Started by torchrun as N processes, the run is data-parallel (graphforge/distributed/): the
program gets the allreduce pass if its pipeline has none, each process takes its share of
every global batch (train/data.py), evaluation is split across the processes and summed,
and rank 0 alone writes the output folder while the others wait for it at a barrier after
each checkpoint. The ranks first check that they run the same program and settings; a
stop (Ctrl-C) is agreed on at the end of a step, so all stop after the same one. With
``[distributed] tensor = T`` the processes are tensor-parallel groups of T instead (one, or
N / T data-parallel replicas of one: World.mesh): each compiles its member's program
(``tensor_parallel(size=T, rank=r)`` in model.pipeline after its loss pass, with the
allreduce pass where there are replicas), each replica's group takes data.batch_size samples a step (every
member all of them) and evaluates every batch, and each checkpoint is the first group's
members' slices beside rank 0's file, which loads as the whole program's state
(OUT/program.onnx's). With a pipeline program too, each T × S processes are the stages of
one pipeline, each stage a tensor group: each process runs its stage of its member's program,
and each checkpoint is the first pipeline's processes' pieces of their stages, listed by rank
0's file. N / (T × S) such pipelines are data-parallel replicas (T × S × D): each takes its
share of every batch, and each stage averages its accumulated gradients with its replicas'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from rich.console import Console
from rich.markup import escape

from graphforge.analysis.size import human_bytes
from graphforge.distributed import DataParallel, DistributedError, Mesh, World, ZeroDataParallel, digest, launched
from graphforge.distributed.pipeline_parallel import PipelineStage, StageReplicas, TorchTransport
from graphforge.distributed.tensor_parallel import TensorParallel, member_state
from graphforge.errors import CheckpointError, ConfigError, DeviceError, GraphforgeError
from graphforge.model_io import load, save
from graphforge.pass_manager import PassManager, parse_pipeline
from graphforge.passes import AllReduce, Zero
from graphforge.passes import TensorParallel as TensorParallelPass
from graphforge.passes.tensor_parallel import with_tensor_parallel
from graphforge.payloads import copy_without_initializers
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointManager, CheckpointState, Module, Optimizer
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.fused_update import FusedUpdate, Refused, use_fused_update
from graphforge.runtime.lr_schedules import LRSchedule, make_schedule, schedule_from_state_dict
from graphforge.tempfiles import remove_stale
from graphforge.train.config import Config, load_config, shown
from graphforge.train.data import ALL, ArraySource, Conformer, Shard, Source, Stream, open_source
from graphforge.train.evaluation import evaluate
from graphforge.train.logs import RunLog
from graphforge.train.profiling import PROFILE_DIR, StepProfiler

PROGRAM = "program.onnx"
CHECKPOINTS = "checkpoints"


@dataclass
class TrainResult:
    """What a run did and wrote."""

    step: int
    total_steps: int
    #: the mean training loss of the last step (None when no step ran)
    loss: float | None
    #: the last evaluation: eval_loss, and eval_accuracy for class-id labels
    eval: dict[str, float]
    out: Path
    program: Path
    checkpoint: Path | None
    log: Path | None
    tensorboard: Path | None
    profile: Path | None
    resumed_from: Path | None
    seconds: float


class Interrupted(KeyboardInterrupt):
    """Training stopped on Ctrl-C after saving a checkpoint (still a KeyboardInterrupt)."""

    def __init__(self, step: int, checkpoint: Path):
        super().__init__(step, checkpoint)
        self.step = step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return f"interrupted at step {self.step}; saved {self.checkpoint} (run the same command again to resume)"


class NonFiniteLoss(GraphforgeError):
    """Training stopped because a step's loss (or gradient norm) was not finite.

    The update of that step is undone, so the state is the last finite one, after step
    ``step``; it was saved to ``checkpoint`` when its tensors are all finite (None when
    they are not: then the newest checkpoint written before is the one to resume from,
    and none is overwritten). ``graphforge train`` exits with status 3."""

    EXIT_STATUS = 3

    def __init__(self, message: str, step: int, checkpoint: Path | None):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class _NotFinite(Exception):
    """Raised inside the loop by a step whose loss or gradient norm is not finite (already undone)."""

    def __init__(self, what: str, value: float):
        super().__init__(what, value)
        self.what = what
        self.value = value


# --------------------------------------------------------------------------- checking everything first


@dataclass
class Plan:
    """A checked config with what it refers to, ready to train; nothing written yet."""

    config: Config
    out: Path
    program: onnx.ModelProto
    compiled_from: str
    train: Source
    eval: Source | None
    eval_output: str | None
    labels: str | None
    total_steps: int
    state: CheckpointState
    resumed_from: Path | None
    module: Module | None
    schedule_options: dict
    notes: list[str]
    #: the settings that fix the data order and the schedule, saved in every checkpoint
    settings: dict = dataclasses.field(default_factory=dict)
    #: settings that differ from the checkpoint resumed from (allowed by allow_config_change): key -> (old, new)
    changed: dict = dataclasses.field(default_factory=dict)
    #: the data-parallel group this process is one rank of (None: a single process)
    world: World | None = None
    #: this process's stage of a pipeline-parallel run (then ``module`` is None)
    pipeline: PipelineStage | None = None
    #: the tensor-parallel group this process's Module is a member of ([distributed] tensor)
    tensor_group: TensorParallel | None = None
    #: this process's groups when [distributed] tensor = T (data replicas of tensor groups)
    mesh: Mesh | None = None


def run(
    config: Config | str | Path,
    *,
    steps: int | None = None,
    out: str | Path | None = None,
    resume: bool | None = None,
    allow_config_change: bool | None = None,
    quiet: bool = False,
    console: Console | None = None,
) -> TrainResult:
    """Train as ``config`` (a Config or a TOML file path) says.

    ``steps``, ``out``, ``resume`` and ``allow_config_change`` override ``train.steps``
    (instead of steps or epochs), ``out`` (relative to the current folder here),
    ``checkpoint.resume`` and ``checkpoint.allow_config_change``.
    Prints progress on ``console`` (default: stdout), nothing with ``quiet``. Raises a
    ConfigError for a bad config before writing anything, and :class:`Interrupted` on Ctrl-C.
    Started by torchrun, it is one rank of a data-parallel run (only rank 0 prints).
    """
    config = config if isinstance(config, Config) else load_config(config)
    config = with_overrides(config, steps=steps, out=out, resume=resume, allow_config_change=allow_config_change)
    world = join(config) if launched() else None
    try:
        if quiet or (world is not None and world.rank != 0):
            console = Console(quiet=True)
        plan = prepare(config, world)
        return Run(plan, console or Console()).train()
    finally:
        if world is not None:
            world.leave()


def join(config: Config) -> World:
    """Join the data-parallel group torchrun started: NCCL when ``train.device`` asks for
    (or defaults to) CUDA, each process on its LOCAL_RANK's GPU; else gloo."""
    try:
        cuda = resolve_device(config.train.device).type == "cuda"
    except DeviceError as exc:
        raise ConfigError(f"{config.where}: train.device: {exc}") from None
    return World.join(cuda=cuda, timeout_s=config.distributed.timeout_s)


def with_overrides(
    config: Config,
    *,
    steps: int | None = None,
    out: str | Path | None = None,
    resume: bool | None = None,
    allow_config_change: bool | None = None,
) -> Config:
    """``config`` with the command line's --steps, --out, --resume/--no-resume and
    --allow-config-change applied."""
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"steps must be a whole number ≥ 1, got {steps!r}")
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps, epochs=None))
    if out is not None:
        config = dataclasses.replace(config, out=Path(out))
    if resume is not None:
        config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, resume=bool(resume)))
    if allow_config_change is not None:
        checkpoint = dataclasses.replace(config.checkpoint, allow_config_change=bool(allow_config_change))
        config = dataclasses.replace(config, checkpoint=checkpoint)
    return config


def prepare(config: Config, world: World | None = None) -> Plan:
    """Check the config against the model, data and checkpoints; writes nothing. With a
    ``world``, this process is one rank of a data-parallel run (see the module docstring)."""
    where = config.where
    notes: list[str] = []
    out = config.out if config.out is not None else Path("runs") / (config.source.stem if config.source else "train")
    tensor = config.distributed.tensor if world is not None else 1
    mesh = None
    if tensor > 1:
        _check_tensor_parallel(config, world)
    program, compiled_from = _program(config, tensor)
    if tensor > 1:
        mesh = world.mesh(tensor=tensor, pipeline=_tensor_stages(config, program, world))
    # this member's program (tensor > 1); the whole one is what OUT/program.onnx and the checkpoints hold
    member = _program(config, tensor, mesh.tensor.rank)[0] if mesh is not None else None
    if mesh is not None and mesh.data.size == 1 and config.distributed.zero:
        raise ConfigError(
            f"{where}: distributed.zero = {config.distributed.zero} shards optimizer states across data-parallel "
            f"replicas, but the {world.size} processes are one tensor group of {tensor}: start a multiple of "
            f"{tensor} processes, or leave distributed.zero out"
        )
    staged = ProgramRoles.of_proto(program).pipeline
    # data replicas of the tensor groups: the gradients averaged (a pipeline's stages average
    # theirs themselves, StageReplicas, after accumulating)
    if mesh is not None and mesh.data.size > 1 and staged is None:
        zero, bucket_mb = config.distributed.zero, config.distributed.bucket_mb
        added = Zero(stage=zero, bucket_mb=bucket_mb) if zero else AllReduce(bucket_mb=bucket_mb)
        member = PassManager([added]).run(member).model
    if staged is not None:
        config = _pipeline_config(config, staged, world)
    zero = config.distributed.zero
    if zero and staged is not None:
        raise ConfigError(
            f"{where}: distributed.zero = {zero} with pipeline stages: each stage already keeps only its own "
            "parameters' optimizer states; leave distributed.zero out (or 0)"
        )
    if world is not None and staged is None and tensor == 1:
        reduction = ProgramRoles.of_proto(program).allreduce
        bucket_mb = config.distributed.bucket_mb
        if reduction is None:
            added = Zero(stage=zero, bucket_mb=bucket_mb) if zero else AllReduce(bucket_mb=bucket_mb)
            program = PassManager([added]).run(program).model
            compiled_from += f", + {added.name}({f'stage={zero}, ' if zero else ''}bucket_mb={bucket_mb:g})"
        elif zero and not reduction.zero:
            raise ConfigError(
                f"{where}: distributed.zero = {zero}, but the program was compiled with the allreduce pass: "
                f"compile it without it (graphforge train adds zero(stage={zero})) or with zero(stage={zero})"
            )
    program_roles = ProgramRoles.of_proto(program)
    sharded = world is not None and program_roles.allreduce is not None and program_roles.allreduce.zero > 0
    zero_stage = (zero or program_roles.allreduce.zero) if sharded else 0
    if mesh is not None and mesh.data.size > 1 and zero:  # ZeRO over the replicas of the tensor groups
        sharded, zero_stage = True, zero
    # pipeline stages all read every micro-batch (the first its inputs, the last its labels);
    # data-parallel pipelines each their share, rank = replica × stages + stage
    shard = ALL  # a tensor-parallel group's members all take every batch whole (their replica's share)
    if mesh is not None and mesh.data.size > 1:
        shard = Shard(mesh.data.size, mesh.data.rank)
    if world is not None and tensor == 1:
        shard = Shard(world.size, world.rank) if staged is None else _pipeline_shard(world, staged.stages)

    accumulate = config.train.accumulate
    if accumulate > 1 and not program_roles.accumulates:
        raise ConfigError(
            f"{where}: train.accumulate = {accumulate} needs a program compiled with accumulate=true "
            "(e.g. adamw(lr=1e-3, accumulate=true) in model.pipeline)"
        )

    inputs = list(program_roles.batch_inputs)
    data = config.data

    def note(text: str) -> None:
        if text not in notes:
            notes.append(text)

    def source(
        location, key: str, *, shuffle: bool, drop_last: bool, batch_size: int, pad: bool, shard: Shard = shard
    ) -> Source:
        conformer = Conformer(inputs, f"{where}: {key}", note)
        return open_source(
            location,
            conformer,
            names=data.inputs,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=data.seed,
            drop_last=drop_last,
            shard=shard,
            pad=pad,
        )

    train = source(
        data.train, "data.train", shuffle=data.shuffle, drop_last=data.drop_last, batch_size=data.batch_size, pad=True
    )
    eval_source = None
    if data.eval is not None:
        eval_batch = config.eval.batch_size or data.batch_size
        # a pipeline evaluates on rank 0, with every stage's parameters gathered there: all of the data
        eval_shard = ALL if staged is not None else shard
        eval_source = source(
            data.eval, "data.eval", shuffle=False, drop_last=False, batch_size=eval_batch, pad=False, shard=eval_shard
        )

    total_steps = _total_steps(config, train)
    outputs = list(program_roles.forward_outputs)
    eval_output = config.eval.output
    if eval_output is not None and eval_output not in outputs:
        raise ConfigError(
            f"{where}: eval.output {eval_output!r} is not an output of the model; it has: {', '.join(outputs) or 'none'}"
        )
    if eval_output is None and len(outputs) == 1:
        eval_output = outputs[0]
    split_axis = ProgramRoles.of_proto(member).tensor_parallel.split_outputs.get(eval_output) if member else None
    if split_axis not in (None, 1):  # (the members' argmax is joined along the classes' axis, 1)
        note(
            f"no eval accuracy: {eval_output!r} is split across the tensor group along its axis {split_axis}, "
            "and accuracy takes the classes on axis 1"
        )
        eval_output = None
    if config.profile is not None and config.profile.start > total_steps:
        raise ConfigError(
            f"{where}: profile.start = {config.profile.start} is past the run's last step ({total_steps})"
        )

    state, resumed_from = _starting_state(config, out, program)
    schedule_options = _schedule_options(config, program_roles, total_steps)
    settings = run_settings(config, train, schedule_options)
    changed = {}
    if resumed_from is not None:
        _check_resumable(state, resumed_from)
        changed = _changed_settings(config, state, settings, resumed_from)
        for key, (old, new) in changed.items():
            note(f"resuming with {key} = {_setting(new)} instead of the checkpoint's {_setting(old)} (allowed)")
        processes = world.size // (staged.stages if staged else 1) // tensor if world is not None else 1
        if _world_size(state) != processes:
            note(
                f"resuming a checkpoint of {_world_size(state)} process(es) on {processes}: the global batch "
                "changes with it, and the data goes on from the first sample not consumed yet"
            )
    device = config.train.device if world is None else world.device
    threads = _threads_per_process() if world is not None and world.device == "cpu" else None
    module, pipeline, tensor_group = None, None, None
    try:
        if staged is not None and mesh is not None:  # a stage of this member's program (T × S, × D)
            state = member_state(state, member)  # (the run's state: the stage advances its step)
            replicas = StageReplicas.of_mesh(mesh) if mesh.data.size > 1 else None
            pipeline = PipelineStage(
                member, state, TorchTransport(mesh.pipeline), device=device, intra_op_threads=threads,
                replicas=replicas,
            )  # fmt: skip
        elif staged is not None and world is not None:
            stages = staged.stages
            replicas = StageReplicas(world, stages) if world.size > stages else None
            transport = TorchTransport(world, first=world.rank - world.rank % stages, stages=stages)
            pipeline = PipelineStage(
                program, state, transport, device=device, intra_op_threads=threads, replicas=replicas
            )
        else:
            if member is not None:  # the checkpoint's (or the first) state is the whole program's: this member's slices
                state = member_state(state, member)
            module = Module(
                member if member is not None else program,
                state,
                device=device,
                dropout=config.train.dropout,
                intra_op_threads=threads,
                shard_optimizer_states=sharded,
                update="onnx",  # train.update is chosen below, once the Module is data-parallel or not
            )
    except DeviceError as exc:
        raise ConfigError(f"{where}: train.device: {exc}") from None
    if world is not None:
        agreed = {
            "program (sha256)": digest(copy_without_initializers(program).SerializeToString(deterministic=True)),
            **settings,
            "total steps": total_steps,
            "starting step": state.step,
            "resumed from": resumed_from.name if resumed_from is not None else None,
            "train samples": getattr(train, "samples", None),
            "eval samples": getattr(eval_source, "samples", None),
            "eval.every": config.eval.every,
            "checkpoint.every": config.checkpoint.every,
            "train.device": (module or pipeline).runner.device.type,
        }
        world.agree("program and config", agreed)
        if tensor > 1:
            tensor_group = TensorParallel(module or pipeline, mesh.tensor)
            held = f"1/{tensor} of {len(tensor_group.axes)} carried tensors"
            if pipeline is not None:
                held = f"its stage's tensors, {held} of them"
                replicated = f" × {mesh.data.size} data-parallel replicas of it" if mesh.data.size > 1 else ""
                note(f"tensor-parallel groups of {tensor} as the {pipeline.stages} stages of a pipeline{replicated}")
            note(f"tensor-parallel: each process holds {held}")
            if mesh.data.size > 1 and module is not None:
                overlap = config.distributed.overlap
                if sharded:
                    ZeroDataParallel(module, mesh.data, stage=zero_stage, overlap=overlap)
                else:
                    DataParallel(module, mesh.data, overlap=overlap)
                zeroed = f", ZeRO stage {zero_stage} over the replicas" if sharded else ""
                note(f"tensor-parallel groups of {tensor} × {mesh.data.size} data-parallel replicas{zeroed}")
        elif module is not None and sharded:
            zero_run = ZeroDataParallel(module, world, stage=zero_stage, overlap=config.distributed.overlap)
            note(
                f"zero: stage {zero_stage}, this process holds {human_bytes(zero_run.state_bytes())} of optimizer state "
                f"(1/{world.size}); its shard of the update runs in torch's kernels"
            )
        elif module is not None:
            DataParallel(module, world, overlap=config.distributed.overlap)
    if module is not None and config.train.update != "onnx" and not sharded:
        insisted = config.train.update == "torch"
        # a profile traces onnxruntime's runs, the update's among them
        profiled = "[profile] traces the update as onnxruntime runs it" if config.profile is not None else None
        if insisted:
            try:
                if profiled is not None:
                    raise Refused(profiled)
                kernel = FusedUpdate(module, foreach=True)
            except Refused as exc:
                raise ConfigError(f'{where}: train.update = "torch": {exc.why}') from None
            module.use_update_kernel(kernel)
            note(f"update: {kernel.description}")
        else:
            note(f"update: the program's ONNX update ({profiled})" if profiled else use_fused_update(module))
    return Plan(
        config=config,
        out=out,
        program=program,
        compiled_from=compiled_from,
        train=train,
        eval=eval_source,
        eval_output=eval_output,
        labels=program_roles.labels,
        total_steps=total_steps,
        state=state,
        resumed_from=resumed_from,
        module=module,
        schedule_options=schedule_options,
        notes=notes,
        settings=settings,
        changed=changed,
        world=world,
        pipeline=pipeline,
        tensor_group=tensor_group,
        mesh=mesh,
    )


def _check_tensor_parallel(config: Config, world: World) -> None:
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


def _tensor_stages(config: Config, program: onnx.ModelProto, world: World) -> int:
    """The pipeline stages of a tensor-parallel run (1 without): tensor groups as the stages
    of a pipeline (T × S), and data-parallel replicas of that pipeline (T × S × D)."""
    staged = ProgramRoles.of_proto(program).pipeline
    if staged is None:
        return 1
    tensor, stages = config.distributed.tensor, staged.stages
    if world.size % (tensor * stages):
        raise ConfigError(
            f"{config.where}: distributed.tensor = {tensor} with {stages} pipeline stages runs on a multiple of "
            f"{tensor * stages} processes (a tensor group of {tensor} as each stage, × data-parallel replicas of the "
            f"pipeline), but {world.size} were started"
        )
    return stages


def _pipeline_shard(world: World, stages: int) -> Shard:
    replicas = world.size // stages
    return Shard(replicas, world.rank // stages) if replicas > 1 else ALL


def _pipeline_config(config: Config, staged, world: World | None) -> Config:
    """A pipeline program's step is its micro-batches (``data.batch_size`` each): on one
    process they run in turn (``train.accumulate`` = micro-batches), under torchrun one
    process per stage."""
    where, micro = config.where, staged.microbatches
    if config.train.accumulate not in (1, micro):
        raise ConfigError(
            f"{where}: train.accumulate = {config.train.accumulate}, but the program's pipeline runs "
            f"{micro} micro-batches per step; leave train.accumulate out"
        )
    if world is not None and world.size % staged.stages:
        raise ConfigError(
            f"{where}: the program has {staged.stages} pipeline stages, but {world.size} processes were started; "
            f"start one per stage, or a multiple of that for data-parallel pipelines "
            f"(torchrun --nproc-per-node={staged.stages} or {2 * staged.stages}, ...)"
        )
    return dataclasses.replace(config, train=dataclasses.replace(config.train, accumulate=micro))


def _threads_per_process() -> int:
    """onnxruntime's threads in each of several processes on one machine's CPUs: what
    OMP_NUM_THREADS says (torchrun sets 1 unless told otherwise, as for torch), else the
    cores shared out between the processes (LOCAL_WORLD_SIZE)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _world_size(state: CheckpointState) -> int:
    """How many processes trained the state (1 before data parallelism was recorded)."""
    return int(state.properties.get(WORLD_SIZE, 1))


def _program(config: Config, tensor: int = 1, rank: int | None = None) -> tuple[onnx.ModelProto, str]:
    """The training program: model.path compiled with model.pipeline, or model.program. With
    ``tensor`` > 1, with ``tensor_parallel(size=tensor, rank=rank)`` after its loss: member ``rank``'s
    program, or without ``rank`` the whole one (what the checkpoints and the export hold)."""
    where, model = config.where, config.model
    if model.program is not None:
        program = _load(model.program, where, "model.program")
        source = shown(model.program)
        key = "model.program"
    else:
        try:
            passes = parse_pipeline(model.pipeline)
        except GraphforgeError as exc:
            raise ConfigError(f"{where}: model.pipeline: {exc}") from None
        forward = _load(model.path, where, "model.path")
        if tensor > 1:
            passes = with_tensor_parallel(passes, TensorParallelPass(size=tensor, rank=rank))
        started = time.perf_counter()
        try:
            program = PassManager(passes).run(forward).model
        except GraphforgeError as exc:  # a pass refused the model: say which config key compiled it
            raise ConfigError(f"{where}: model.pipeline: {exc}") from None
        pipeline = ", ".join(p.spec() for p in passes) if tensor > 1 else model.pipeline
        source = f'{shown(model.path)}, compiled with "{pipeline}" in {time.perf_counter() - started:.2f} s'
        key = "model.pipeline"
    if not ProgramRoles.of_proto(program).is_training_program:
        raise ConfigError(
            f"{where}: {key}: not a training program; the pipeline must end with an optimizer pass, e.g. "
            '"loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-3)"'
        ) from None
    return program, source


def _load(path: Path, where: str, key: str) -> onnx.ModelProto:
    if not path.is_file():
        raise ConfigError(f"{where}: {key}: no such file {shown(path)}")
    try:
        return load(path)
    except GraphforgeError as exc:
        raise ConfigError(f"{where}: {key}: {exc}") from None


def _total_steps(config: Config, train: Source) -> int:
    where, accumulate = config.where, config.train.accumulate
    if config.train.steps is not None:
        return config.train.steps
    if config.train.epochs is None:
        raise ConfigError(f"{where}: give train.steps or train.epochs (how long to train), or --steps")
    per_epoch = train.batches_per_epoch
    if per_epoch is None:
        per_epoch = train.count_batches()
        if per_epoch is None:
            raise ConfigError(
                f"{where}: train.epochs needs the number of batches per epoch, and the iterable "
                f"{train.label} returns has no len(); give train.steps instead"
            )
    total = config.train.epochs * per_epoch // accumulate
    if total < 1:
        raise ConfigError(
            f"{where}: train.epochs = {config.train.epochs} of {per_epoch} batches make no step of "
            f"train.accumulate = {accumulate} batches"
        )
    return total


def _starting_state(config: Config, out: Path, program: onnx.ModelProto) -> tuple[CheckpointState, Path | None]:
    """The checkpoint to resume from (checkpoint.resume_from, or the latest in OUT/checkpoints), or a fresh state."""
    where, options = config.where, config.checkpoint
    manager = CheckpointManager(out / CHECKPOINTS, keep_last=options.keep_last)
    path = None
    if options.resume_from is not None:
        path = options.resume_from
        if path.is_dir():
            path = CheckpointManager(path).latest()
            if path is None:
                raise ConfigError(f"{where}: checkpoint.resume_from: the folder {shown(path)} holds no checkpoint")
        elif not path.is_file():
            raise ConfigError(f"{where}: checkpoint.resume_from: no such checkpoint {shown(path)}")
    elif options.resume:
        path = manager.latest()
    elif manager.checkpoints():
        last_step, _ = manager.checkpoints()[-1]
        raise ConfigError(
            f"{manager.directory} already holds checkpoints of an earlier run (up to step {last_step}); "
            "resume it (--resume), or choose another output folder (--out)"
        )
    if path is None:
        state = CheckpointState.from_program(program)
        state.seeds["dropout"] = config.data.seed  # the dropout masks' seed (graphforge/runtime/dropout.py)
        return state, None
    return CheckpointState.load(path, program), path


def _schedule_options(config: Config, program_roles: ProgramRoles, total_steps: int) -> dict:
    """The schedule's options, checked by building it once (free-standing)."""
    schedule = config.schedule
    default_lr = program_roles.default_lr if program_roles.default_lr is not None else math.nan
    base_lr = config.train.lr if config.train.lr is not None else default_lr
    if not math.isfinite(base_lr):
        raise ConfigError(f"{config.where}: the program has no learning rate; set train.lr")
    options = {
        "base_lr": base_lr,
        "warmup_steps": schedule.warmup_steps,
        "warmup_start_factor": schedule.warmup_start_factor,
        "end_lr": schedule.end_lr,
        "total_steps": schedule.total_steps or total_steps,
    }
    if schedule.kind == "polynomial":
        options["power"] = schedule.power
    try:
        make_schedule(schedule.kind, None, **options)
    except GraphforgeError as exc:
        raise ConfigError(f"{config.where}: schedule: {exc}") from None
    return options


#: the key of CheckpointState.properties under which a run saves its settings
SETTINGS = "settings"
#: ... and the number of data-parallel processes that trained it
WORLD_SIZE = "world_size"


def run_settings(config: Config, train: Source, schedule_options: dict) -> dict:
    """The config values that fix the data order and the learning-rate schedule, by key."""
    settings: dict = {}
    if isinstance(train, ArraySource):  # a Python source batches and orders itself
        data = config.data
        settings.update(
            {
                "data.batch_size": data.batch_size,
                "data.shuffle": data.shuffle,
                "data.seed": data.seed,
                "data.drop_last": data.drop_last,
            }
        )
    schedule = config.schedule
    settings["train.accumulate"] = config.train.accumulate
    settings["train.lr"] = schedule_options["base_lr"]
    settings["schedule.kind"] = schedule.kind
    settings["schedule.warmup_steps"] = schedule.warmup_steps
    if schedule.warmup_steps:
        settings["schedule.warmup_start_factor"] = schedule.warmup_start_factor
    if schedule.kind != "constant":  # a decay: where it ends, and at what lr
        settings["schedule.total_steps"] = schedule_options["total_steps"]
        settings["schedule.end_lr"] = schedule.end_lr
    if schedule.kind == "polynomial":
        settings["schedule.power"] = schedule.power
    return settings


def _changed_settings(config: Config, state: CheckpointState, settings: dict, path: Path) -> dict:
    """Settings that differ from those the checkpoint was written with: refused (ConfigError
    naming the key and both values) unless checkpoint.allow_config_change. Checkpoints from
    before settings were saved are not compared."""
    saved = state.properties.get(SETTINGS)
    if not isinstance(saved, dict):
        return {}
    missing = object()
    changed = {
        key: (saved.get(key, missing), settings.get(key, missing))
        for key in dict.fromkeys([*saved, *settings])
        if saved.get(key, missing) != settings.get(key, missing)
    }
    changed = {k: tuple(None if v is missing else v for v in pair) for k, pair in changed.items()}
    if changed and not config.checkpoint.allow_config_change:
        key, (old, new) = next(iter(changed.items()))
        more = f" (and {len(changed) - 1} more: {', '.join(list(changed)[1:])})" if len(changed) > 1 else ""
        raise ConfigError(
            f"{config.where}: {key} is {_setting(new)} but {shown(path)} was written with {key} = {_setting(old)}{more}; "
            "resuming with it changed alters the data order or the learning-rate schedule. Put it back, or "
            "pass --allow-config-change (checkpoint.allow_config_change = true) to go on with the new value"
        )
    return changed


def _setting(value) -> str:
    """A setting's value in a message; a key one side does not have is 'unset'."""
    return "unset" if value is None else repr(value)


def _check_resumable(state: CheckpointState, path: Path) -> None:
    """Refuse (CheckpointError, one line) what a checkpoint holds that the loop cannot go on
    from: a data position that is not {"epoch": E, "batch": B}, a schedule state that does
    not rebuild, a tensor with nan or inf values."""
    where = shown(path)
    position = state.data_position
    ok = position is None or (isinstance(position, dict) and set(position) <= {"epoch", "batch"})
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (position or {}).values())
    if not ok:
        raise CheckpointError(
            f"{where}: its data_position is {json.dumps(position)[:80]}, expected "
            '{"epoch": E, "batch": B} with whole numbers ≥ 0'
        )
    if state.scheduler:
        try:
            schedule_from_state_dict(state.scheduler)
        except GraphforgeError as exc:
            raise CheckpointError(f"{where}: its schedule state is unusable: {exc}") from None
    bad = [name for name, value in state.tensors.items() if not _all_finite(value)]
    if bad:
        raise CheckpointError(
            f"{where}: tensor(s) {_listed(bad)} hold nan or inf values; resume from an earlier checkpoint "
            "(checkpoint.resume_from)"
        )


# --------------------------------------------------------------------------- training


class Run:
    """One run of a Plan: the loop, its logs, checkpoints, evaluation and profiling."""

    def __init__(self, plan: Plan, console: Console):
        self.plan = plan
        self.config = plan.config
        self.console = console
        self.module = plan.module
        self.pipeline = plan.pipeline
        #: what trains here: the Module, or this process's pipeline stage
        self.trainer = plan.pipeline if plan.pipeline is not None else plan.module
        self._eval_module: Module | None = None  # a pipeline's evaluation, on rank 0
        self.state = plan.state
        self.world = plan.world
        #: the process that writes the output folder (and prints): the only one, or rank 0
        self.lead = self.world is None or self.world.rank == 0
        self.checkpoints = CheckpointManager(plan.out / CHECKPOINTS, keep_last=self.config.checkpoint.keep_last)
        self.last_saved: Path | None = None
        self.saved_step: int | None = None
        self.last_eval: dict[str, float] = {}
        self.last_loss: float | None = None
        self.profile_summary = None  # where the profiled steps' kernel time went
        self._stop_requested = False

    # ------------------------------------------------------------------ the run

    def train(self) -> TrainResult:
        plan, config, state = self.plan, self.config, self.state
        started, start_step = time.perf_counter(), state.step
        program_path = plan.out / PROGRAM
        if self.lead:
            plan.out.mkdir(parents=True, exist_ok=True)
            save(plan.program, program_path)
        self._describe(program_path)
        if self.lead:
            self._remove_stale_temporaries()
        # a pipeline stage is its own optimizer (the update is in its segments): the schedule sets its rate
        optimizer = self.pipeline if self.pipeline is not None else Optimizer(self.module)
        schedule = self._schedule(optimizer)
        self._say(f"[bold]schedule[/] {escape(_describe_schedule(schedule))}")
        if isinstance(plan.train, ArraySource) and plan.resumed_from is not None and "data.seed" not in plan.changed:
            seed = int(state.seeds.get("data", config.data.seed))
            if seed != config.data.seed:  # a checkpoint from before the settings were saved
                self._say(
                    f"         resuming with the checkpoint's data seed {seed} (the config says {config.data.seed})"
                )
            plan.train.seed = seed
        stream = Stream(plan.train, self._resumed_position())
        profile = config.profile
        profiler = StepProfiler(plan.out / PROFILE_DIR, profile.start, profile.steps) if profile is not None else None
        log_config = config.log if self.lead else dataclasses.replace(config.log, jsonl=False, tensorboard=False)
        log = RunLog(
            plan.out,
            log_config,
            start_step=state.step,
            total_steps=plan.total_steps,
            console=self.console,
            progress=config.log.progress and self.lead,
        )
        if state.step >= plan.total_steps:
            self._say(f"[bold]done[/]     already at step {state.step} of {plan.total_steps}: nothing to train")
        try:
            with self._stop_on_ctrl_c(), self._stop_on_sigterm():
                self._loop(optimizer, schedule, stream, profiler, log)
        finally:
            log.close()
            profile_path = profiler.finish() if profiler is not None else None
            self.profile_summary = profiler.summary if profiler is not None else None
        if self.saved_step != state.step:
            if plan.resumed_from is not None and self.saved_step is None and state.step == start_step:
                self.last_saved = plan.resumed_from  # no step ran: the checkpoint resumed from is the latest
            else:
                self.last_saved = self._save(schedule, stream)
        seconds = time.perf_counter() - started
        self._summary(seconds, profile_path)
        return TrainResult(
            step=state.step,
            total_steps=plan.total_steps,
            loss=self.last_loss,
            eval=dict(self.last_eval),
            out=plan.out,
            program=program_path,
            checkpoint=self.last_saved,
            log=log.jsonl,
            tensorboard=log.tensorboard,
            profile=profile_path,
            resumed_from=plan.resumed_from,
            seconds=seconds,
        )

    def _loop(self, optimizer: Optimizer, schedule: LRSchedule, stream: Stream, profiler, log: RunLog) -> None:
        state = self.state
        while state.step < self.plan.total_steps:
            if self._stop_agreed():
                raise self._interrupt(schedule, stream, None, log, profiler)
            before, position = state.step, stream.position
            try:
                lr = optimizer.get_learning_rate()
                loss, samples, seconds = self._step(optimizer, schedule, stream, profiler)
                self._after_step(loss, samples, seconds, lr, schedule, stream, profiler, log)
            except KeyboardInterrupt:
                raise self._interrupt(schedule, stream, (before, position), log, profiler) from None
            except _NotFinite as exc:
                raise self._stop_not_finite(exc, schedule, stream, position, log, profiler) from None

    def _step(self, optimizer: Optimizer, schedule: LRSchedule, stream: Stream, profiler) -> tuple[float, int, float]:
        """One optimizer step: its mean loss, samples and seconds (a profiled step's include
        the profiling, and its sessions' first runs)."""
        module, accumulate = self.module, self.config.train.accumulate
        if profiler is not None and profiler.wants(self.state.step + 1):
            profiler.start(self.trainer)  # this step's runs go through profiled twin sessions
        started = time.perf_counter()
        if self.pipeline is not None:
            return self._pipeline_step(schedule, stream, started)
        losses, samples = [], 0
        for _ in range(accumulate):
            batch = stream.next()
            samples += len(next(iter(batch.values()))) * self._replicas()
            # one micro-batch per step: the fused step, one session.run; else accumulate, then update
            losses.append(float(module.train_step(**batch) if accumulate == 1 else module(**batch)))
            _check_finite(module, "loss", losses[-1])
        if accumulate > 1:
            optimizer.step()
            module.lazy_reset_grad()
        # a program that scales its loss skipped the update itself and lowered the scale
        scaler_skipped = module.roles.loss_scaling is not None and module.last_update_skipped
        if module.last_grad_norm is not None and not scaler_skipped:
            _check_finite(module, "gradient norm", module.last_grad_norm)
        schedule.step()
        return sum(losses) / len(losses), samples, time.perf_counter() - started

    def _pipeline_step(self, schedule: LRSchedule, stream: Stream, started: float) -> tuple[float, int, float]:
        """One step of this process's pipeline stage over the step's micro-batches."""
        pipeline = self.pipeline
        batches = [stream.next() for _ in range(pipeline.microbatches)]
        result = pipeline.train_step(batches)
        _check_finite(pipeline, "loss", result.loss)
        if pipeline.last_grad_norm is not None:
            _check_finite(pipeline, "gradient norm", pipeline.last_grad_norm)
        schedule.step()
        samples = sum(len(next(iter(b.values()))) for b in batches) * self._replicas()
        return result.loss, samples, time.perf_counter() - started

    def _evaluate(self) -> dict[str, float]:
        """The evaluation: the Module's; a pipeline's on rank 0, with every stage's parameters
        gathered there (the others get {})."""
        plan = self.plan
        if self.pipeline is None:
            # a tensor-parallel group's members all evaluate every batch, to the same figures
            across = self.world if plan.tensor_group is None else None
            split = plan.tensor_group is not None and plan.eval_output in plan.tensor_group.role.split_outputs
            return evaluate(
                self.module, plan.eval.epoch(0), output=plan.eval_output, labels=plan.labels, across=across,
                classes_across=plan.tensor_group if split else None,
            )  # fmt: skip
        gathered = self.pipeline.gathered_tensors()
        if gathered is not None and plan.tensor_group is not None:  # stage 0's members: their slices joined
            gathered = plan.tensor_group.join(gathered)
        if gathered is None or not self.lead:
            return {}
        if self._eval_module is None:
            snapshot = self.state.copy()
            snapshot.tensors.update(gathered)
            self._eval_module = Module(
                plan.program, snapshot, device=self.trainer.device, dropout=self.config.train.dropout, update="onnx"
            )
        else:
            self._eval_module.runner.write_tensors(gathered)
        return evaluate(self._eval_module, plan.eval.epoch(0), output=plan.eval_output, labels=plan.labels)

    def _after_step(self, loss, samples, seconds, lr, schedule, stream: Stream, profiler, log: RunLog) -> None:
        """Log, evaluate, print and save as the config asks at this step."""
        plan, config, state = self.plan, self.config, self.state
        step, total = state.step, plan.total_steps
        self.last_loss = loss
        log.step(step, loss, samples, seconds)
        if profiler is not None and step == profiler.last:
            profiler.finish()
        state.properties["samples"] = int(state.properties.get("samples", 0)) + samples
        values = {
            "epoch": round(stream.fractional_epoch(), 4),
            "samples": state.properties["samples"],
            "lr": lr,
            "grad_norm": self.trainer.last_grad_norm,
        }
        if self.pipeline is None and self.module.roles.loss_scaling is not None:
            values["loss_scale"] = self.module.loss_scale
            values["skipped_updates"] = self.module.skipped_updates
        every_eval = config.eval.every
        evaluated = plan.eval is not None and ((every_eval and step % every_eval == 0) or step == total)
        if evaluated:
            self.last_eval = self._evaluate()
            values.update(self.last_eval)
        if evaluated or step % config.log.every == 0 or step == total:
            record = log.record(step, values)
            # without evaluations to print, about ten lines of progress (at logged steps)
            milestones = config.log.every * max(1, total // (10 * config.log.every)) if plan.eval is None else 0
            if evaluated or (milestones and (step % milestones == 0 or step == total)):
                log.print(_line(record, total))
        every_checkpoint = config.checkpoint.every
        if (every_checkpoint and step % every_checkpoint == 0) or step == total:
            self.last_saved = self._save(schedule, stream)

    # ------------------------------------------------------------------ checkpoints and Ctrl-C

    def _replicas(self) -> int:
        """How many processes share each global batch: data-parallel ranks, or pipelines."""
        if self.world is None:
            return 1
        stages = self.pipeline.stages if self.pipeline is not None else 1
        if self.plan.tensor_group is not None:
            return self.world.size // self.plan.tensor_group.role.size // stages
        return self.world.size // stages

    def _resumed_position(self) -> dict | None:
        """Where the data stream of a resumed run starts: the checkpoint's position, or with
        a changed global batch (data.batch_size, or the number of processes), the batch of
        the new size holding the first sample not consumed yet in that epoch (a few samples
        may be seen twice in that epoch)."""
        plan, position = self.plan, self.state.data_position
        if plan.resumed_from is None or position is None:
            return None
        size = self.config.data.batch_size if isinstance(plan.train, ArraySource) else 1  # a Python source: batches
        old_size, new_size = plan.changed.get("data.batch_size", (size, size))
        old = int(old_size) * _world_size(self.state)
        new = int(new_size) * self._replicas()
        if old != new:
            consumed = int(position.get("batch", 0)) * old
            position = {"epoch": int(position.get("epoch", 0)), "batch": consumed // new}
        return position

    def _schedule(self, optimizer: Optimizer) -> LRSchedule:
        state = self.state
        schedule_changed = any(k.startswith("schedule.") or k == "train.lr" for k in self.plan.changed)
        if self.plan.resumed_from is not None and state.scheduler and not schedule_changed:
            try:
                return schedule_from_state_dict(state.scheduler, optimizer)
            except GraphforgeError as exc:
                raise ConfigError(f"{self.plan.resumed_from}: its schedule state is unusable: {exc}") from None
        return make_schedule(self.config.schedule.kind, optimizer, **self.plan.schedule_options, last_step=state.step)

    def _save(self, schedule: LRSchedule, stream: Stream, position: dict | None = None) -> Path:
        """Checkpoint the state (rank 0 writes it: the state is the same on every rank, the
        others wait for it at a barrier)."""
        state = self.state
        state.scheduler = schedule.state_dict()
        state.seeds = {**state.seeds, "data": int(getattr(stream.source, "seed", self.config.data.seed))}
        state.properties[SETTINGS] = self.plan.settings
        state.properties[WORLD_SIZE] = self._replicas()
        state.data_position = position if position is not None else stream.position
        if self.pipeline is not None:
            path = self._save_stages(state)
        elif self.plan.tensor_group is not None:  # each member its slices, then rank 0: loads whole
            tensors = self.plan.tensor_group.current_tensors()  # (ZeRO's shards gathered: every replica)
            if self.plan.mesh.data.rank == 0:  # the first replica's group: the others hold the same
                path = self.plan.tensor_group.save(self.checkpoints, tensors)
            else:
                path = self.checkpoints.path_for(int(state.step))
        elif self.module is not None and getattr(self.module.reducer, "shards_update", False):
            path = self.module.reducer.save(self.checkpoints)  # each process its shard, then rank 0
        else:
            path = self.checkpoints.save(state) if self.lead else self.checkpoints.path_for(int(state.step))
        if self.world is not None:
            self.world.barrier(f"waiting for rank 0 to write the checkpoint of step {state.step}")
        self.saved_step = state.step
        return path

    def _save_stages(self, state: CheckpointState) -> Path:
        """A pipeline's checkpoint: each stage of the first pipeline writes its own tensors
        (stage s > 0 a shard beside the checkpoint), then rank 0 writes the checkpoint file
        itself, with stage 0's tensors and the list of shards: that file, the last written,
        makes the checkpoint whole. Loading it reads the shards too (any stage count resumes)."""
        pipeline, step = self.pipeline, int(state.step)
        if self.plan.tensor_group is not None:
            return self._save_tensor_stages(state)
        mine = pipeline.tensors()
        state.tensors.update(mine)  # the state's other tensors are stale here: only ``mine`` is written
        if self.world.rank < pipeline.stages and pipeline.stage > 0 and mine:
            self.checkpoints.save_shard(state, list(mine), pipeline.stage, pipeline.stages)
        holding = 1.0 if mine else 0.0
        counts = self.world.sum(
            [holding if self.world.rank == s else 0.0 for s in range(pipeline.stages)],
            f"waiting for the stages' shards of the checkpoint of step {step}",
        )
        if not self.lead:
            return self.checkpoints.path_for(step)
        shards = [self.checkpoints.shard_path(step, s, pipeline.stages) for s in range(1, pipeline.stages) if counts[s]]
        return self.checkpoints.save(state, names=list(mine), shards=shards)

    def _save_tensor_stages(self, state: CheckpointState) -> Path:
        """A checkpoint of tensor groups as pipeline stages (T × S): each process of the first
        pipeline writes its stage's tensors in a file of its own (its slices of the split ones;
        member 0 the whole ones too; the other replicas hold the same), then rank 0 the
        checkpoint file, listing them all: it loads as the whole program's state, as a single
        run's checkpoint does."""
        pipeline, group, step = self.pipeline, self.plan.tensor_group, int(state.step)
        members = group.role.size
        mine = group.current_tensors()
        state.tensors.update(mine)  # the state's other tensors are stale here: only ``mine`` is written
        whole = [n for n in mine if n not in group.axes] if group.role.rank == 0 else []
        path = self.checkpoints.piece_path(step, pipeline.stage, pipeline.stages, group.role.rank, members)
        if self.plan.mesh.data.rank == 0:
            self.checkpoints.directory.mkdir(parents=True, exist_ok=True)
            state.save(path, names=whole, parts=group.parts(mine))
        self.world.barrier(f"waiting for every stage's pieces of the checkpoint of step {step}")
        if not self.lead:
            return self.checkpoints.path_for(step)
        pieces = [
            self.checkpoints.piece_path(step, s, pipeline.stages, t, members)
            for s in range(pipeline.stages)
            for t in range(members)
        ]
        return self.checkpoints.save(state, names=[], shards=pieces)

    def _interrupt(self, schedule, stream, unfinished, log: RunLog, profiler) -> Interrupted:
        """Save the checkpoint of the last finished step; the Interrupted to raise."""
        state = self.state
        position = None
        if unfinished is not None:
            before, position_then = unfinished
            if state.step == before:  # the update did not happen: redo the step's batches on resume
                position = position_then
                state.grad_reset_pending = True
                state.micro_batch = 0
            elif schedule.last_step < state.step:  # updated, but the schedule had not moved on yet
                schedule.step()
        log.close()
        if profiler is not None:
            profiler.finish()
        self.last_saved = self._save(schedule, stream, position)
        return Interrupted(state.step, self.last_saved)

    def _stop_not_finite(self, exc: _NotFinite, schedule, stream: Stream, position, log: RunLog, profiler):
        """The NonFiniteLoss to raise: the failed step is undone (by _step), logged, and the
        state after the step before it is saved, unless it is not finite itself (a
        checkpoint never holds nan parameters) or was saved already."""
        state = self.state
        failed = state.step + 1
        log.step(failed, exc.value if exc.what == "loss" else math.nan, 0, 0.0)
        log.record(failed, {"lr": self.trainer.learning_rate, "stopped": f"{exc.what} is {exc.value}"})
        log.close()
        if profiler is not None:
            profiler.finish()
        state.grad_reset_pending = True  # the failed step's partial accumulation is dropped
        state.micro_batch = 0
        if self.pipeline is not None:  # each stage looks at its own tensors; the stages agree
            bad = [name for name, value in self.pipeline.tensors().items() if not _all_finite(value)]
            (elsewhere,) = self.world.sum([len(bad)], f"checking the state after step {state.step}")
            if elsewhere and not bad:
                bad = [f"{int(elsewhere)} tensor(s) of other stages"]
        else:
            bad = [name for name, value in state.tensors.items() if not _all_finite(value)]
        saved = None
        if bad:
            kept = f"; the newest checkpoint is {self.last_saved}" if self.last_saved is not None else ""
            what = f"the state after step {state.step} is not finite either ({_listed(bad)}), so no checkpoint was written{kept}"
        elif self.saved_step == state.step and self.last_saved is not None:
            saved = self.last_saved
            what = f"the last finite state (step {state.step}) is {saved}"
        else:
            saved = self.last_saved = self._save(schedule, stream, position)
            what = f"saved the last finite state (step {state.step}) to {saved}"
        return NonFiniteLoss(
            f"step {failed}: the {exc.what} is {exc.value} (not finite); training stopped and the step was undone; "
            f"{what}. Resume from it with a lower learning rate (train.lr, and --allow-config-change), "
            "or look for bad values in the data",
            state.step,
            saved,
        )

    def _stop_agreed(self) -> bool:
        """Whether to stop before the next step: asked for (Ctrl-C) here, or on any rank."""
        if self.world is None:
            return self._stop_requested
        (asked,) = self.world.sum([float(self._stop_requested)], f"agreeing on a stop after step {self.state.step}")
        return asked > 0

    @contextlib.contextmanager
    def _stop_on_sigterm(self) -> Iterator[None]:
        """One rank of several: SIGTERM (what torchrun sends the others when one rank fails)
        stops at once with one line; the run's checkpoints are all complete (atomic writes)."""
        if self.world is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        world = self.world

        def handler(signum, frame):
            raise DistributedError(
                f"rank {world.rank}: stopped by SIGTERM during step {self.state.step + 1} (torchrun stops every "
                "rank when one fails; its report names which)"
            )

        previous = signal.signal(signal.SIGTERM, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    @contextlib.contextmanager
    def _stop_on_ctrl_c(self) -> Iterator[None]:
        """The first Ctrl-C asks the loop to stop after the current step; a second one stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    # ------------------------------------------------------------------ what it prints

    def _remove_stale_temporaries(self) -> None:
        """A run killed while it wrote a checkpoint (or the program, a log, a profile) left that
        file's temporary behind: remove those no live process is writing, in one line."""
        out = self.plan.out
        removed = [p for folder in (out, out / CHECKPOINTS, out / PROFILE_DIR) for p in remove_stale(folder)]
        if removed:
            shown = ", ".join(escape(str(p.relative_to(out))) for p in removed[:3])
            more = f" and {len(removed) - 3} more" if len(removed) > 3 else ""
            self._say(f"[bold]cleanup[/]  removed {len(removed)} temporary file(s) a stopped run left: {shown}{more}")

    def _say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)  # quiet on ranks other than 0

    def _describe(self, program_path: Path) -> None:
        plan, config = self.plan, self.config
        optimizer = ProgramRoles.of_proto(plan.program).optimizer or "?"
        self._say(f"[bold]model[/]    {escape(plan.compiled_from)} → {escape(str(program_path))}")
        train = plan.train
        text = f"train {escape(train.describe())}"
        processes = self._replicas()
        if train.batches_per_epoch is not None and hasattr(train, "batch_size"):
            size = f"{processes}×{train.batch_size}" if processes > 1 else str(train.batch_size)
            text += f", {train.batches_per_epoch} batches of {size} per epoch"
        if plan.eval is not None:
            text += f"; eval {escape(plan.eval.describe())}"
        self._say(f"[bold]data[/]     {text}")
        for note in plan.notes:
            self._say(f"         {escape(note)}")
        what = f"{plan.total_steps} steps"
        if config.train.epochs is not None:
            what += f" ({config.train.epochs} epochs)"
        if config.train.accumulate > 1:
            what += f" of {config.train.accumulate} micro-batches"
        what += f" on {self.trainer.device}, {optimizer}"
        if self.pipeline is not None:
            role = ProgramRoles.of_proto(plan.program).pipeline
            what += (
                f"; pipeline of {role.stages} stages × {role.microbatches} micro-batches ({role.schedule}, "
                f"{self.world.backend})"
            )
            if self._replicas() > 1:
                what += f", data-parallel × {self._replicas()}"
        elif plan.tensor_group is not None:
            what += f"; tensor-parallel on {self.world.size} processes ({self.world.backend})"
        elif self.world is not None:
            what += f"; data-parallel on {self.world.size} processes ({self.world.backend})"
        self._say(f"[bold]run[/]      {what} → {escape(str(plan.out))}")
        if plan.resumed_from is not None:
            self._say(f"[bold]resume[/]   from {escape(str(plan.resumed_from))} at step {self.state.step}")

    def _summary(self, seconds: float, profile: Path | None) -> None:
        parts = [f"step {self.state.step}"]
        if self.last_loss is not None:
            parts.append(f"last batch loss {self.last_loss:.4f}")
        if "eval_loss" in self.last_eval:
            parts.append(f"eval loss {self.last_eval['eval_loss']:.4f}")
        if "eval_accuracy" in self.last_eval:
            parts.append(f"accuracy {self.last_eval['eval_accuracy']:.4f}")
        self._say(f"[bold]done[/]     {', '.join(parts)} in {seconds:.1f} s")
        self._say(f"[bold]saved[/]    {escape(str(self.last_saved))}")
        if profile is not None:
            self._say(f"[bold]profile[/]  {escape(str(profile))}")
            if self.profile_summary is not None and self.profile_summary.total:
                self._say(f"          kernel time: {escape(self.profile_summary.line())}")


def _describe_schedule(schedule: LRSchedule) -> str:
    """The schedule a run uses, as built (from the config, or the checkpoint resumed from)."""
    text = f"{schedule.kind} from lr {schedule.base_lr:g}"
    if schedule.needs_total:
        text += f" to {schedule.end_lr:g} at step {schedule.total_steps}"
    if schedule.warmup_steps:
        text += f", warmup {schedule.warmup_steps} steps from {schedule.base_lr * schedule.warmup_start_factor:g}"
    if schedule.last_step:
        text += f"; at step {schedule.last_step}: lr {schedule.get_last_lr():.4g}"
    return text


def _check_finite(module: Module | PipelineStage, what: str, value: float) -> None:
    """Undo the run that gave a non-finite ``value`` and stop the loop."""
    if not math.isfinite(value):
        module.undo_last_run()
        raise _NotFinite(what, value)


def _all_finite(value) -> bool:
    return not np.issubdtype(value.dtype, np.floating) or bool(np.isfinite(value).all())


def _listed(names: list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _line(record: dict, total: int) -> str:
    text = f"step {record['step']:>{len(str(total))}}/{total}"
    if "loss" in record:  # the logged interval's mean (the summary's last line names its last batch's)
        text += f"  mean loss {record['loss']:.4f}"
    if "lr" in record:
        text += f"  lr {record['lr']:.3g}"
    if "samples_per_s" in record:
        text += f"  {record['samples_per_s']:,.0f} samples/s"
    if "eval_loss" in record:
        text += f"  eval loss {record['eval_loss']:.4f}"
    if "eval_accuracy" in record:
        text += f"  accuracy {record['eval_accuracy']:.4f}"
    return text
