"""The training loop behind ``graphforge train``: everything is checked first (setup.py), then it
trains, the same way whichever way this process takes part (graphforge/train/trainers/).

``Run.train`` writes the output folder::

    OUT/program.onnx                           the compiled training program
    OUT/checkpoints/checkpoint-<step>.safetensors   every checkpoint.every steps and at the end
    OUT/log.jsonl  OUT/tensorboard/            one record per logged step (graphforge/train/logs.py)
    OUT/profile/steps-<a>-<b>.json             onnxruntime's trace of the profiled steps

Started by torchrun as N processes, rank 0 alone writes the folder and prints; the trainers
make each checkpoint whole before any rank goes on. Resuming continues bit for bit as a run that
was never interrupted (resume.py); Ctrl-C saves a checkpoint after the current step (stops.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from graphforge.distributed import World, launched
from graphforge.errors import ConfigError, DeviceError
from graphforge.model_io import save
from graphforge.runtime import CheckpointManager
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.lr_schedules import LRSchedule
from graphforge.tempfiles import remove_stale
from graphforge.train import progress, resume
from graphforge.train.config import Config, load_config
from graphforge.train.data import ArraySource, Stream
from graphforge.train.logs import RunLog
from graphforge.train.profiling import PROFILE_DIR, StepProfiler
from graphforge.train.resume import CHECKPOINTS
from graphforge.train.setup import Setup, prepare
from graphforge.train.stops import Interrupted, NonFiniteLoss, StopRequests
from graphforge.train.trainers.base import NotFinite

PROGRAM = "program.onnx"
__all__ = ["CHECKPOINTS", "PROGRAM", "Interrupted", "NonFiniteLoss", "Run", "TrainResult", "run"]


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
    Started by torchrun, it is one rank of the run (only rank 0 prints).
    """
    config = config if isinstance(config, Config) else load_config(config)
    config = with_overrides(config, steps=steps, out=out, resume=resume, allow_config_change=allow_config_change)
    world = join(config) if launched() else None
    try:
        if quiet or (world is not None and world.rank != 0):
            console = Console(quiet=True)
        return Run(prepare(config, world), console or Console()).train()
    finally:
        if world is not None:
            world.leave()


def join(config: Config) -> World:
    """Join the processes torchrun started: NCCL when ``train.device`` asks for (or defaults
    to) CUDA, each process on its LOCAL_RANK's GPU; else gloo."""
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


class Run:
    """One run of a Setup: the loop, its logs, checkpoints, evaluation and profiling."""

    def __init__(self, setup: Setup, console: Console):
        self.setup = setup
        self.config = setup.config
        self.console = console
        self.trainer = setup.trainer
        self.state = setup.state
        #: the process that writes the output folder (and prints): the only one, or rank 0
        self.lead = self.trainer.world is None or self.trainer.world.rank == 0
        self.checkpoints = CheckpointManager(setup.out / CHECKPOINTS, keep_last=self.config.checkpoint.keep_last)
        self.stops = StopRequests(self.trainer.world)
        self.last_saved: Path | None = None
        self.saved_step: int | None = None
        self.last_eval: dict[str, float] = {}
        self.last_loss: float | None = None

    def train(self) -> TrainResult:
        setup, config, state = self.setup, self.config, self.state
        started, start_step = time.perf_counter(), state.step
        program_path = setup.out / PROGRAM
        if self.lead:
            setup.out.mkdir(parents=True, exist_ok=True)
            save(setup.program, program_path)
        for line in progress.run_lines(setup, program_path):
            self._say(line)
        if self.lead:
            removed = [
                p for f in (setup.out, self.checkpoints.directory, setup.out / PROFILE_DIR) for p in remove_stale(f)
            ]
            line = progress.cleanup_line(removed, setup.out)
            if line is not None:
                self._say(line)
        options, changed = setup.schedule_options, setup.changed
        schedule = resume.run_schedule(config, self.trainer.optimizer, options, state, setup.resumed_from, changed)
        self._say(progress.schedule_line(schedule))
        if isinstance(setup.train, ArraySource) and setup.resumed_from is not None and "data.seed" not in changed:
            seed = int(state.seeds.get("data", config.data.seed))
            if seed != config.data.seed:  # a checkpoint from before the settings were saved
                self._say(
                    f"         resuming with the checkpoint's data seed {seed} (the config says {config.data.seed})"
                )
            setup.train.seed = seed
        position = None
        if setup.resumed_from is not None:
            position = resume.resumed_position(config, setup.train, state, changed, self.trainer.replicas)
        stream = Stream(setup.train, position)
        profile = config.profile
        profiler = StepProfiler(setup.out / PROFILE_DIR, profile.start, profile.steps) if profile is not None else None
        log_config = config.log if self.lead else dataclasses.replace(config.log, jsonl=False, tensorboard=False)
        log = RunLog(
            setup.out,
            log_config,
            start_step=state.step,
            total_steps=setup.total_steps,
            console=self.console,
            progress=config.log.progress and self.lead,
        )
        if state.step >= setup.total_steps:
            self._say(f"[bold]done[/]     already at step {state.step} of {setup.total_steps}: nothing to train")
        try:
            with self.stops.watching(lambda: int(self.state.step)):
                self._loop(schedule, stream, profiler, log)
        finally:
            log.close()
            profile_path = profiler.finish() if profiler is not None else None
        if self.saved_step != state.step:
            if setup.resumed_from is not None and self.saved_step is None and state.step == start_step:
                self.last_saved = setup.resumed_from  # no step ran: the checkpoint resumed from is the latest
            else:
                self.last_saved = self._save(schedule, stream)
        seconds = time.perf_counter() - started
        kernel_time = profiler.summary if profiler is not None else None
        for line in progress.summary_lines(
            state.step, self.last_loss, self.last_eval, seconds, self.last_saved, profile_path, kernel_time
        ):
            self._say(line)
        return TrainResult(
            step=state.step,
            total_steps=setup.total_steps,
            loss=self.last_loss,
            eval=dict(self.last_eval),
            out=setup.out,
            program=program_path,
            checkpoint=self.last_saved,
            log=log.jsonl,
            tensorboard=log.tensorboard,
            profile=profile_path,
            resumed_from=setup.resumed_from,
            seconds=seconds,
        )

    def _loop(self, schedule: LRSchedule, stream: Stream, profiler, log: RunLog) -> None:
        state, trainer = self.state, self.trainer
        while state.step < self.setup.total_steps:
            if self.stops.agreed(state.step):
                raise self._interrupt(schedule, stream, None, log, profiler)
            before, position = state.step, stream.position
            if trainer.steps_per_run > 1:
                self._run_of_steps(schedule, stream, log, before, position)
                continue
            try:
                lr = trainer.optimizer.get_learning_rate()
                if profiler is not None and profiler.wants(state.step + 1):
                    profiler.start(trainer.engine)  # this step's runs go through profiled twin sessions
                started = time.perf_counter()
                batches = [stream.next() for _ in range(trainer.microbatches)]
                loss = trainer.step(batches)
                schedule.step()
                samples = sum(len(next(iter(b.values()))) for b in batches) * trainer.replicas
                self._after_step(loss, samples, time.perf_counter() - started, lr, schedule, stream, profiler, log)
            except KeyboardInterrupt:
                raise self._interrupt(schedule, stream, (before, position), log, profiler) from None
            except NotFinite as exc:
                raise self._stop_not_finite(exc, schedule, stream, position, log, profiler) from None

    def _run_of_steps(self, schedule: LRSchedule, stream: Stream, log: RunLog, before: int, position) -> None:
        """train.steps_per_run = k: the next steps in one run, up to the next multiple of k (so
        that evaluations and checkpoints, every multiple of k, come between runs) or the end;
        then each step logged as it would be alone."""
        trainer, k = self.trainer, self.trainer.steps_per_run
        count = min(k - before % k, self.setup.total_steps - before)
        try:
            started = time.perf_counter()
            batches = [stream.next() for _ in range(count)]
            rates = schedule.next_rates(count)
            done = trainer.run_steps(batches, rates)
            seconds = (time.perf_counter() - started) / count
            for i, (loss, grad_norm) in enumerate(done):
                schedule.step()
                samples = len(next(iter(batches[i].values()))) * trainer.replicas
                self._after_step(
                    loss,
                    samples,
                    seconds,
                    rates[i],
                    schedule,
                    stream,
                    None,
                    log,
                    step=before + i + 1,
                    grad_norm=grad_norm,
                )
        except KeyboardInterrupt:
            raise self._interrupt(schedule, stream, (before, position), log, None) from None
        except NotFinite as exc:
            raise self._stop_not_finite(exc, schedule, stream, position, log, None) from None

    def _after_step(
        self, loss, samples, seconds, lr, schedule, stream: Stream, profiler, log: RunLog, *, step=None, grad_norm=None
    ) -> None:
        """Log, evaluate, print and save as the config asks at this step (``step``: one of a run
        of several, default the state's; ``grad_norm``: its gradient norm, default the trainer's last)."""
        setup, config, state = self.setup, self.config, self.state
        step, total = state.step if step is None else step, setup.total_steps
        self.last_loss = loss
        log.step(step, loss, samples, seconds)
        if profiler is not None and step == profiler.last:
            profiler.finish()
        state.properties["samples"] = int(state.properties.get("samples", 0)) + samples
        values = {
            "epoch": round(stream.fractional_epoch(), 4),
            "samples": state.properties["samples"],
            "lr": lr,
            "grad_norm": self.trainer.last_grad_norm if grad_norm is None else grad_norm,
            **self.trainer.log_values(),
        }
        every_eval = config.eval.every
        evaluated = setup.eval is not None and ((every_eval and step % every_eval == 0) or step == total)
        if evaluated:
            self.last_eval = self.trainer.evaluate(setup.eval, setup.eval_output, setup.labels)
            values.update(self.last_eval)
        if evaluated or step % config.log.every == 0 or step == total:
            record = log.record(step, values)
            # without evaluations to print, about ten lines of progress (at logged steps)
            milestones = config.log.every * max(1, total // (10 * config.log.every)) if setup.eval is None else 0
            if evaluated or (milestones and (step % milestones == 0 or step == total)):
                log.print(progress.step_line(record, total))
        every_checkpoint = config.checkpoint.every
        if (every_checkpoint and step % every_checkpoint == 0) or step == total:
            self.last_saved = self._save(schedule, stream)

    def _save(self, schedule: LRSchedule, stream: Stream, position: dict | None = None) -> Path:
        """Checkpoint the state with what resuming needs besides the tensors (the trainer
        writes it, as its processes hold it)."""
        state = self.state
        state.scheduler = schedule.state_dict()
        state.seeds = {**state.seeds, "data": int(getattr(stream.source, "seed", self.config.data.seed))}
        state.properties[resume.SETTINGS] = self.setup.settings
        state.properties[resume.WORLD_SIZE] = self.trainer.replicas
        state.data_position = position if position is not None else stream.position
        path = self.trainer.save(self.checkpoints)
        self.saved_step = state.step
        return path

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
            while schedule.last_step < state.step:  # updated, but the schedule had not moved on yet
                schedule.step()
        log.close()
        if profiler is not None:
            profiler.finish()
        self.last_saved = self._save(schedule, stream, position)
        return Interrupted(state.step, self.last_saved)

    def _stop_not_finite(self, exc: NotFinite, schedule, stream: Stream, position, log: RunLog, profiler):
        """The NonFiniteLoss to raise: the failed step is undone (by the trainer), logged, and
        the state after the step before it is saved, unless it is not finite itself (a
        checkpoint never holds nan parameters) or was saved already."""
        state = self.state
        failed = state.step + 1 + exc.offset  # (the steps of its run before it are undone too)
        log.step(failed, exc.value if exc.what == "loss" else math.nan, 0, 0.0)
        log.record(failed, {"lr": self.trainer.learning_rate, "stopped": f"{exc.what} is {exc.value}"})
        log.close()
        if profiler is not None:
            profiler.finish()
        state.grad_reset_pending = True  # the failed step's partial accumulation is dropped
        state.micro_batch = 0
        bad = self.trainer.bad_tensors()
        saved = None
        if bad:
            kept = f"; the newest checkpoint is {self.last_saved}" if self.last_saved is not None else ""
            what = f"the state after step {state.step} is not finite either ({resume.listed(bad)}), so no checkpoint was written{kept}"
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

    def _say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)  # quiet on ranks other than 0
