"""Everything checked before a run trains: ``prepare`` reads the model, compiles it, places this
process (graphforge/train/topology.py), opens the data, finds the state to start or resume from,
builds the trainer's options (``trainer_options``) and the trainer. It writes nothing, so a bad
config leaves no file behind."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import onnx

from graphforge.distributed import World, digest
from graphforge.errors import ConfigError, DeviceError, GraphforgeError
from graphforge.model_io import load
from graphforge.pass_manager import PassManager, parse_pipeline, pipeline_text
from graphforge.passes import TensorParallel
from graphforge.passes.tensor_parallel import with_tensor_parallel
from graphforge.payloads import copy_without_initializers
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointState
from graphforge.runtime.devices import resolve_device
from graphforge.train import resume
from graphforge.train.config import Config, is_text, shown
from graphforge.train.data import Conformer, Source, open_source
from graphforge.train.text.source import open_text, text_options
from graphforge.train.topology import check_tensor_parallel, place, threads_per_process
from graphforge.train.trainers import Trainer
from graphforge.train.trainers.base import Topology
from graphforge.train.trainers.options import TrainerOptions


@dataclass
class Setup:
    """A checked config with what it refers to and this process's trainer; nothing written yet."""

    config: Config
    out: Path
    #: the whole program (OUT/program.onnx) and what it was compiled from, as the run line says
    program: onnx.ModelProto
    compiled_from: str
    trainer: Trainer
    train: Source
    eval: Source | None
    eval_output: str | None
    labels: str | None
    total_steps: int
    resumed_from: Path | None
    schedule_options: dict
    notes: list[str]
    #: the settings that fix the data order and the schedule, saved in every checkpoint
    settings: dict = dataclasses.field(default_factory=dict)
    #: settings that differ from the checkpoint resumed from (allowed by allow_config_change): key -> (old, new)
    changed: dict = dataclasses.field(default_factory=dict)

    @property
    def state(self) -> CheckpointState:
        return self.trainer.state


def prepare(config: Config, world: World | None = None) -> Setup:
    """Check the config against the model, data and checkpoints, and build this process's
    trainer; writes nothing. With a ``world``, this process is one rank of a run torchrun
    started (graphforge/train/topology.py says which part it plays)."""
    out = config.out if config.out is not None else Path("runs") / (config.source.stem if config.source else "train")
    topology = _placed(config, world)
    config, program = topology.config, topology.program
    program_roles = ProgramRoles.of_proto(program)
    _check_accumulation(config, program_roles)
    notes = Notes(topology.notes)
    train, eval_source = _open_data(config, topology, program_roles, notes)
    total_steps = _total_steps(config, train)
    eval_output = _eval_output(config, program_roles, topology.own if topology.mesh is not None else None, notes.add)
    if config.profile is not None and config.profile.start > total_steps:
        raise ConfigError(
            f"{config.where}: profile.start = {config.profile.start} is past the run's last step ({total_steps})"
        )
    start = _starting_point(config, out, program, program_roles, train, total_steps, notes)
    options = trainer_options(config, world)
    if world is not None:
        world.agree("program and config", _agreed(config, program, options, start, train, eval_source, total_steps))
    trainer = _trainer(topology, start, options, notes)
    return Setup(
        config=config,
        out=out,
        program=program,
        compiled_from=topology.compiled_from,
        trainer=trainer,
        train=train,
        eval=eval_source,
        eval_output=eval_output,
        labels=program_roles.labels,
        total_steps=total_steps,
        resumed_from=start.resumed_from,
        schedule_options=start.schedule_options,
        notes=notes,
        settings=start.settings,
        changed=start.changed,
    )


def trainer_options(config: Config, world: World | None) -> TrainerOptions:
    """What every trainer is asked to do (TrainerOptions), from ``config`` as its topology runs
    it: the [train] keys, and this process's device and threads (under torchrun the rank's
    device, of the type train.device names: loop.join joined the world on it)."""
    return TrainerOptions(
        train=config.train,
        device=config.train.device if world is None else world.device,
        threads=threads_per_process() if world is not None and world.device == "cpu" else None,
        profiled=config.profile is not None,
        where=config.where,
    )


class Notes(list):
    """The lines a run prints under its data line, each once."""

    def add(self, text: str) -> None:
        if text not in self:
            self.append(text)


@dataclass
class _Start:
    """Where a run starts: the state (a fresh one, or the checkpoint's), the schedule, and the
    settings saved with every checkpoint (and those changed since the one resumed from)."""

    state: CheckpointState
    resumed_from: Path | None
    schedule_options: dict
    settings: dict
    changed: dict


def _placed(config: Config, world: World | None) -> Topology:
    """The program compiled, and this process placed in the run (topology.place)."""
    tensor = config.distributed.tensor if world is not None else 1
    if tensor > 1:
        check_tensor_parallel(config, world)
    program, compiled_from = compile_program(config, tensor)
    return place(config, world, program, compiled_from, lambda rank: compile_program(config, tensor, rank))


def _check_accumulation(config: Config, program_roles: ProgramRoles) -> None:
    if config.train.accumulate > 1 and not program_roles.accumulates:
        raise ConfigError(
            f"{config.where}: train.accumulate = {config.train.accumulate} needs a program compiled with "
            "accumulate=true (e.g. adamw(lr=1e-3, accumulate=true) in model.pipeline)"
        )


def _open_data(
    config: Config, topology: Topology, program_roles: ProgramRoles, notes: Notes
) -> tuple[Source, Source | None]:
    """This process's share of the training data, and the evaluation data (None without)."""
    data, inputs = config.data, list(program_roles.batch_inputs)
    text = None
    if is_text(data.train) or is_text(data.eval):
        text = text_options(data, topology.program, inputs, program_roles.labels)

    def source(location, key: str, *, batch_size: int, train: bool) -> Source:
        conformer = Conformer(inputs, f"{config.where}: {key}", notes.add)
        options = {
            "names": data.inputs,
            "batch_size": batch_size,
            "shuffle": data.shuffle if train else False,
            "seed": data.seed,
            "drop_last": data.drop_last if train else False,
            "shard": topology.shard if train else topology.eval_shard,
            "pad": train,
        }
        if is_text(location):
            return open_text(location, conformer, text, key=key, **options)
        return open_source(location, conformer, **options)

    train = source(data.train, "data.train", batch_size=data.batch_size, train=True)
    if data.eval is None:
        return train, None
    return train, source(data.eval, "data.eval", batch_size=config.eval.batch_size or data.batch_size, train=False)


def _starting_point(
    config: Config,
    out: Path,
    program: onnx.ModelProto,
    program_roles: ProgramRoles,
    train: Source,
    total_steps: int,
    notes: Notes,
) -> _Start:
    """The state to start from (resume.py), with the schedule and the settings it fixes."""
    state, resumed_from = resume.starting_state(config, out, program)
    schedule_options = resume.schedule_options(config, program_roles, total_steps)
    settings = resume.run_settings(config, train, schedule_options)
    settings.update(getattr(train, "settings", {}))  # text data: the tokens' key, seq_len, pack, ...
    changed = {}
    if resumed_from is not None:
        resume.check_resumable(state, resumed_from)
        changed = resume.changed_settings(config, state, settings, resumed_from)
        for key, (old, new) in changed.items():
            notes.add(
                f"resuming with {key} = {resume.setting(new)} instead of the checkpoint's {resume.setting(old)} (allowed)"
            )
    return _Start(state, resumed_from, schedule_options, settings, changed)


def _agreed(
    config: Config,
    program: onnx.ModelProto,
    options: TrainerOptions,
    start: _Start,
    train: Source,
    eval_source: Source | None,
    total_steps: int,
) -> dict:
    """What every rank of a run must have the same of before it trains."""
    return {
        "program (sha256)": digest(copy_without_initializers(program).SerializeToString(deterministic=True)),
        **options.agreed(),
        **start.settings,
        "total steps": total_steps,
        "starting step": start.state.step,
        "resumed from": start.resumed_from.name if start.resumed_from is not None else None,
        "train samples": getattr(train, "samples", None),
        "eval samples": getattr(eval_source, "samples", None),
        "eval.every": config.eval.every,
        "checkpoint.every": config.checkpoint.every,
        "train.device": _device_type(config, options.device),
    }


def _trainer(topology: Topology, start: _Start, options: TrainerOptions, notes: Notes) -> Trainer:
    """This process's trainer, once its topology takes every option (Trainer.check)."""
    topology.kind.check(options, topology)
    try:
        trainer = topology.kind(topology, start.state, options)
    except DeviceError as exc:
        raise ConfigError(f"{options.where}: train.device: {exc}") from None
    if start.resumed_from is not None and resume.world_size(start.state) != trainer.replicas:
        notes.add(
            f"resuming a checkpoint of {resume.world_size(start.state)} process(es) on {trainer.replicas}: the "
            "global batch changes with it, and the data goes on from the first sample not consumed yet"
        )
    for text in trainer.notes:
        notes.add(text)
    return trainer


def _device_type(config: Config, device: str | None) -> str:
    try:
        return resolve_device(device).type
    except DeviceError as exc:
        raise ConfigError(f"{config.where}: train.device: {exc}") from None


def compile_program(config: Config, tensor: int = 1, rank: int | None = None) -> tuple[onnx.ModelProto, str]:
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
            passes = with_tensor_parallel(passes, TensorParallel(size=tensor, rank=rank))
        started = time.perf_counter()
        try:
            program = PassManager(passes).run(forward).model
        except GraphforgeError as exc:  # a pass refused the model: say which config key compiled it
            raise ConfigError(f"{where}: model.pipeline: {exc}") from None
        source = f'{shown(model.path)}, compiled with "{pipeline_text(passes, model.pipeline)}" in {time.perf_counter() - started:.2f} s'
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


def _eval_output(config: Config, program_roles: ProgramRoles, member: onnx.ModelProto | None, note) -> str | None:
    """The output whose argmax evaluation scores: eval.output, or the model's only one; none
    where a tensor group splits it along another axis than the classes'."""
    outputs = list(program_roles.forward_outputs)
    eval_output = config.eval.output
    if eval_output is not None and eval_output not in outputs:
        raise ConfigError(
            f"{config.where}: eval.output {eval_output!r} is not an output of the model; it has: "
            f"{', '.join(outputs) or 'none'}"
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
    return eval_output


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
