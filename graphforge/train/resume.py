"""Resuming a run: the state it starts from, the settings a checkpoint must agree with, where
the data stream goes on, and the learning-rate schedule.

A checkpoint holds the step, the learning rate, the schedule's state, the data seed and the
stream position (epoch, batch), and the settings that fix the data order and the schedule, so
resuming from it continues bit for bit as a run that was never interrupted. A setting changed
since is refused, naming it, unless ``checkpoint.allow_config_change``; a checkpoint the loop
cannot go on from (a bad data position, a schedule that does not rebuild, nan weights) is
refused before anything runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import onnx

from graphforge.errors import CheckpointError, ConfigError, GraphforgeError
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointManager, CheckpointState
from graphforge.runtime.lr_schedules import LRSchedule, make_schedule, schedule_from_state_dict
from graphforge.train.config import Config, shown
from graphforge.train.data import ArraySource, Source
from graphforge.train.trainers.base import all_finite

CHECKPOINTS = "checkpoints"
#: the key of CheckpointState.properties under which a run saves its settings
SETTINGS = "settings"
#: ... and the number of data-parallel processes that trained it
WORLD_SIZE = "world_size"


def starting_state(config: Config, out: Path, program: onnx.ModelProto) -> tuple[CheckpointState, Path | None]:
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


def schedule_options(config: Config, program_roles: ProgramRoles, total_steps: int) -> dict:
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


def run_schedule(config: Config, optimizer, options: dict, state: CheckpointState, resumed_from, changed) -> LRSchedule:
    """The schedule that sets ``optimizer``'s rate: the checkpoint's, where the run resumes
    with its schedule settings unchanged, else one made from ``options`` at the state's step."""
    schedule_changed = any(k.startswith("schedule.") or k == "train.lr" for k in changed)
    if resumed_from is not None and state.scheduler and not schedule_changed:
        try:
            return schedule_from_state_dict(state.scheduler, optimizer)
        except GraphforgeError as exc:
            raise ConfigError(f"{resumed_from}: its schedule state is unusable: {exc}") from None
    return make_schedule(config.schedule.kind, optimizer, **options, last_step=state.step)


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


def changed_settings(config: Config, state: CheckpointState, settings: dict, path: Path) -> dict:
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
            f"{config.where}: {key} is {setting(new)} but {shown(path)} was written with {key} = {setting(old)}{more}; "
            "resuming with it changed alters the data order or the learning-rate schedule. Put it back, or "
            "pass --allow-config-change (checkpoint.allow_config_change = true) to go on with the new value"
        )
    return changed


def setting(value) -> str:
    """A setting's value in a message; a key one side does not have is 'unset'."""
    return "unset" if value is None else repr(value)


def check_resumable(state: CheckpointState, path: Path) -> None:
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
    bad = [name for name, value in state.tensors.items() if not all_finite(value)]
    if bad:
        raise CheckpointError(
            f"{where}: tensor(s) {listed(bad)} hold nan or inf values; resume from an earlier checkpoint "
            "(checkpoint.resume_from)"
        )


def world_size(state: CheckpointState) -> int:
    """How many processes trained the state (1 before data parallelism was recorded)."""
    return int(state.properties.get(WORLD_SIZE, 1))


def resumed_position(
    config: Config, train: Source, state: CheckpointState, changed: dict, replicas: int
) -> dict | None:
    """Where the data stream of a resumed run starts: the checkpoint's position, or with a
    changed global batch (data.batch_size, or the number of processes), the batch of the new
    size holding the first sample not consumed yet in that epoch (a few samples may be seen
    twice in that epoch)."""
    position = state.data_position
    if position is None:
        return None
    size = config.data.batch_size if isinstance(train, ArraySource) else 1  # a Python source: batches
    old_size, new_size = changed.get("data.batch_size", (size, size))
    old = int(old_size) * world_size(state)
    new = int(new_size) * replicas
    if old != new:
        consumed = int(position.get("batch", 0)) * old
        position = {"epoch": int(position.get("epoch", 0)), "batch": consumed // new}
    return position


def listed(names: list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
