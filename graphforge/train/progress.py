"""What a run prints: what it trains and how, a line per evaluation or milestone, the summary."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from graphforge.program import ProgramRoles
from graphforge.runtime.lr_schedules import LRSchedule


def run_lines(setup, program_path: Path) -> list[str]:
    """The model, data, notes, run and resume lines a run starts with."""
    config, trainer = setup.config, setup.trainer
    optimizer = ProgramRoles.of_proto(setup.program).optimizer or "?"
    lines = [f"[bold]model[/]    {escape(setup.compiled_from)} → {escape(str(program_path))}"]
    train = setup.train
    text = f"train {escape(train.describe())}"
    replicas = trainer.replicas
    if train.batches_per_epoch is not None and hasattr(train, "batch_size"):
        size = f"{replicas}×{train.batch_size}" if replicas > 1 else str(train.batch_size)
        text += f", {train.batches_per_epoch} batches of {size} per epoch"
    if setup.eval is not None:
        text += f"; eval {escape(setup.eval.describe())}"
    lines.append(f"[bold]data[/]     {text}")
    lines += [f"         {escape(note)}" for note in setup.notes]
    what = f"{setup.total_steps} steps"
    if config.train.epochs is not None:
        what += f" ({config.train.epochs} epochs)"
    if config.train.accumulate > 1:
        what += f" of {config.train.accumulate} micro-batches"
    what += f" on {trainer.device}, {optimizer}"
    if trainer.describe():
        what += f"; {trainer.describe()}"
    lines.append(f"[bold]run[/]      {what} → {escape(str(setup.out))}")
    if setup.resumed_from is not None:
        lines.append(f"[bold]resume[/]   from {escape(str(setup.resumed_from))} at step {setup.state.step}")
    return lines


def schedule_line(schedule: LRSchedule) -> str:
    """The schedule a run uses, as built (from the config, or the checkpoint resumed from)."""
    text = f"{schedule.kind} from lr {schedule.base_lr:g}"
    if schedule.needs_total:
        text += f" to {schedule.end_lr:g} at step {schedule.total_steps}"
    if schedule.warmup_steps:
        text += f", warmup {schedule.warmup_steps} steps from {schedule.base_lr * schedule.warmup_start_factor:g}"
    if schedule.last_step:
        text += f"; at step {schedule.last_step}: lr {schedule.get_last_lr():.4g}"
    return f"[bold]schedule[/] {escape(text)}"


def step_line(record: dict, total: int) -> str:
    """A logged step: the interval's mean loss, lr, throughput and the evaluation's figures."""
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


def summary_lines(
    step: int, loss: float | None, evaluated: dict, seconds: float, saved, profile, kernel_time
) -> list[str]:
    """The last lines: where it stopped, the last figures, what it saved and profiled."""
    parts = [f"step {step}"]
    if loss is not None:
        parts.append(f"last batch loss {loss:.4f}")
    if "eval_loss" in evaluated:
        parts.append(f"eval loss {evaluated['eval_loss']:.4f}")
    if "eval_accuracy" in evaluated:
        parts.append(f"accuracy {evaluated['eval_accuracy']:.4f}")
    lines = [f"[bold]done[/]     {', '.join(parts)} in {seconds:.1f} s", f"[bold]saved[/]    {escape(str(saved))}"]
    if profile is not None:
        lines.append(f"[bold]profile[/]  {escape(str(profile))}")
        if kernel_time is not None and kernel_time.total:
            lines.append(f"          kernel time: {escape(kernel_time.line())}")
    return lines


def cleanup_line(removed: list[Path], out: Path) -> str | None:
    """The line naming the temporary files a stopped run left, which were removed; None for none."""
    if not removed:
        return None
    shown = ", ".join(escape(str(p.relative_to(out))) for p in removed[:3])
    more = f" and {len(removed) - 3} more" if len(removed) > 3 else ""
    return f"[bold]cleanup[/]  removed {len(removed)} temporary file(s) a stopped run left: {shown}{more}"
