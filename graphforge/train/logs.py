"""What a training run reports: a JSONL log, TensorBoard scalars, and a progress bar.

Every logged step is one JSON object on one line of ``log.jsonl`` (step, epoch, samples,
loss averaged since the previous line, lr, grad_norm, samples_per_s, elapsed_s, and
eval_loss / eval_accuracy at an evaluation; loss_scale and skipped_updates for a program
with mixed precision's loss scaling) and the same numbers as TensorBoard scalars
(``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/samples_per_s``, ``eval/loss``,
``eval/accuracy``, ``train/loss_scale``, ``train/skipped_updates``) in ``tensorboard/``; a number that is not finite (a loss gone nan) is
``null`` in the log and left out of TensorBoard. A resumed run first drops what the log holds past
the checkpoint's step (TensorBoard's purge_step does the same for the event files), so the
log reads as one run.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from graphforge.tempfiles import write_atomically
from graphforge.train.config import LogConfig

JSONL = "log.jsonl"
TENSORBOARD = "tensorboard"
#: JSONL key → TensorBoard tag
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "skipped_updates": "train/skipped_updates",
    "samples_per_s": "train/samples_per_s",
    "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy",
}


class RunLog:
    """The JSONL file, the TensorBoard writer and the progress bar of one run."""

    def __init__(
        self,
        out: Path,
        config: LogConfig,
        *,
        start_step: int,
        total_steps: int,
        console: Console,
        progress: bool,
    ):
        self.console = console
        self.jsonl = out / JSONL if config.jsonl else None
        self.tensorboard = out / TENSORBOARD if config.tensorboard else None
        self._file = None
        self._writer = None
        if self.jsonl is not None:
            _drop_records_after(self.jsonl, start_step)
            self._file = open(self.jsonl, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if self.tensorboard is not None:
            from tensorboardX import SummaryWriter

            # purge_step: TensorBoard hides what earlier event files hold from this step on. The
            # file name has the time in seconds: the suffix keeps a quick resume from overwriting it.
            self._writer = SummaryWriter(
                str(self.tensorboard),
                purge_step=start_step + 1,
                flush_secs=10,
                filename_suffix=f".{os.getpid()}.step{start_step}",
            )
        self._started = time.perf_counter()
        self._reset_interval()
        self._progress: Progress | None = None
        if progress and console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} samples/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, loss="-", rate="-")
            self._progress.start()

    def _reset_interval(self) -> None:
        self._loss_sum, self._loss_count, self._samples, self._seconds = 0.0, 0, 0, 0.0

    def step(self, step: int, loss: float, samples: int, seconds: float) -> None:
        """One optimizer step done: its loss, samples and training time."""
        self._loss_sum += loss
        self._loss_count += 1
        self._samples += samples
        self._seconds += seconds
        if self._progress is not None:
            rate = self._samples / self._seconds if self._seconds > 0 else 0.0
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", rate=f"{rate:,.0f}")

    def record(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Write one record: the interval's mean loss and throughput, plus ``values``."""
        record: dict[str, Any] = {"step": step}
        if self._loss_count:
            record["loss"] = self._loss_sum / self._loss_count
            record["samples_per_s"] = self._samples / self._seconds if self._seconds > 0 else None
        record.update(values)
        record["elapsed_s"] = round(time.perf_counter() - self._started, 3)
        # a non-finite number (a loss that became nan) is null in the JSONL log and left out
        # of TensorBoard, which would only print a warning for it
        record = {k: _plain(v) for k, v in record.items() if v is not None}
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        if self._writer is not None:
            for key, tag in TAGS.items():
                if record.get(key) is not None:
                    self._writer.add_scalar(tag, record[key], step)
        self._reset_interval()
        return record

    def print(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _plain(value: Any) -> Any:
    """A JSON-safe number: numpy scalars become Python ones, non-finite ones None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _drop_records_after(path: Path, step: int) -> None:
    """Keep only the records up to ``step`` (atomically: temp file, then rename)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record_step = json.loads(line).get("step", 0)
        except (json.JSONDecodeError, AttributeError):
            continue  # a line cut short by a crash
        if isinstance(record_step, int) and record_step <= step:
            kept.append(line + "\n")
    write_atomically(path, "".join(kept).encode("utf-8"))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL log."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
