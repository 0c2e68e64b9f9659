"""Resuming: a run interrupted at step k and resumed from its checkpoint ends with parameters
and optimizer states bit-identical to a run that was never interrupted, with shuffling,
epochs that end mid-batch-group, a warmup + cosine schedule, and gradient accumulation."""

from __future__ import annotations

import _train_helpers as th
import numpy as np
import pytest

import graphforge.train
from graphforge import CheckpointManager, CheckpointState
from graphforge.train import Interrupted
from graphforge.train.data import Stream
from graphforge.train.logs import read_jsonl

STEPS = 20


def _config(folder, *, accumulate: int = 1):
    pipeline = th.PIPELINE.replace("adamw(lr=0.05)", "adamw(lr=0.05, accumulate=true)") if accumulate > 1 else None
    document = th.base_config(
        data={"batch_size": 7, "shuffle": True},  # 48 samples: 7 batches an epoch, the last one of 6
        train={"steps": STEPS, "accumulate": accumulate},
        schedule={"kind": "cosine", "warmup_steps": 4},
        eval={"every": 5},
        checkpoint={"every": 6, "keep_last": 2},
        log={"every": 2},
    )
    if pipeline:
        document["model"]["pipeline"] = pipeline
    return th.write_config(folder, document, f"train{accumulate}.toml")


def _interrupt_at_batch(monkeypatch, number: int) -> None:
    """Make the number-th batch the stream is asked for raise KeyboardInterrupt (as Ctrl-C would)."""
    calls = {"count": 0}
    original = Stream.next

    def next_or_interrupt(self):
        calls["count"] += 1
        if calls["count"] == number:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(Stream, "next", next_or_interrupt)


def _final_state(result) -> CheckpointState:
    return CheckpointState.load(result.checkpoint, result.program)


def _assert_identical(a: CheckpointState, b: CheckpointState) -> None:
    assert a.step == b.step == STEPS
    assert a.learning_rate == b.learning_rate and a.scheduler == b.scheduler
    assert a.data_position == b.data_position and a.seeds == b.seeds
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, value in a.tensors.items():
        assert np.array_equal(value, b.tensors[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = th.workspace(tmp_path_factory.mktemp("resume"))
    runs = {accumulate: graphforge.train.run(_config(folder, accumulate=accumulate), out=folder / f"straight{accumulate}",
                                             quiet=True) for accumulate in (1, 2)}  # fmt: skip
    return folder, runs


@pytest.mark.parametrize(("accumulate", "batch"), [(1, 12), (2, 2 * 9 + 2)])
def test_interrupted_then_resumed_equals_uninterrupted(uninterrupted, monkeypatch, accumulate, batch):
    """Interrupted while fetching a batch: at step 12 (after 11 steps), or mid-accumulation of step 10."""
    folder, straight = uninterrupted
    config = _config(folder, accumulate=accumulate)
    out = folder / f"interrupted{accumulate}"
    with monkeypatch.context() as patch:
        _interrupt_at_batch(patch, batch)
        with pytest.raises(Interrupted) as caught:
            graphforge.train.run(config, out=out, quiet=True)
    done = 11 if accumulate == 1 else 9
    assert caught.value.step == done
    assert caught.value.checkpoint == CheckpointManager(out / "checkpoints").latest()
    assert f"interrupted at step {done}; saved" in str(caught.value)
    saved = CheckpointState.load(caught.value.checkpoint)
    assert saved.step == done and saved.grad_reset_pending

    resumed = graphforge.train.run(config, out=out, quiet=True)
    assert resumed.resumed_from == caught.value.checkpoint
    _assert_identical(_final_state(resumed), _final_state(straight[accumulate]))

    steps = [r["step"] for r in read_jsonl(resumed.log)]
    assert steps == [r["step"] for r in read_jsonl(straight[accumulate].log)]  # nothing logged twice
    assert read_jsonl(resumed.log)[-1]["loss"] == read_jsonl(straight[accumulate].log)[-1]["loss"]
    assert len(list(resumed.tensorboard.glob("events.out.tfevents.*"))) == 2


def test_stopped_by_steps_then_continued_equals_uninterrupted(uninterrupted):
    """--steps 7 then the full run, with the schedule's length fixed in the config."""
    folder, _ = uninterrupted
    document = th.base_config(
        data={"batch_size": 7},
        train={"steps": STEPS},
        schedule={"kind": "linear", "warmup_steps": 2, "total_steps": STEPS},
    )
    config = th.write_config(folder, document, "fixed.toml")
    straight = graphforge.train.run(config, out=folder / "fixed-straight", quiet=True)
    first = graphforge.train.run(config, out=folder / "fixed-split", steps=7, quiet=True)
    assert first.step == 7
    second = graphforge.train.run(config, out=folder / "fixed-split", quiet=True)
    assert second.resumed_from == first.checkpoint
    _assert_identical(_final_state(second), _final_state(straight))


def test_a_resume_removes_the_temporaries_a_killed_run_left_and_says_so(uninterrupted, tmp_path, monkeypatch):
    """A run killed while writing a checkpoint leaves its temporary: the resume removes it (and
    one written before temporaries were locked) in one line, and ends as the uninterrupted run."""
    import signal
    import subprocess
    import sys

    folder, straight = uninterrupted
    config = _config(folder)
    out = tmp_path / "killed"
    with monkeypatch.context() as patch:
        _interrupt_at_batch(patch, 12)
        with pytest.raises(Interrupted):
            graphforge.train.run(config, out=out, quiet=True)
    checkpoints = out / "checkpoints"
    # a writer killed mid-write, as `kill -9` leaves one: its temporary, which it held locked
    writer = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from graphforge.tempfiles import "
         "temp_file_beside\nwith temp_file_beside(Path(sys.argv[1])) as tmp:\n    tmp.write_bytes(b'half')\n"
         "    print(tmp, flush=True); time.sleep(600)", str(checkpoints / "checkpoint-00000012.safetensors")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    killed = writer.stdout.readline().strip()
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    writer.stdout.close()
    unlocked = checkpoints / ".checkpoint-00000006.safetensors.x1y2z3w4.tmp"
    unlocked.write_bytes(b"half")
    left = sorted(p.name for p in checkpoints.iterdir() if p.name.endswith(".tmp"))
    assert left == sorted([unlocked.name, killed.rsplit("/", 1)[-1]])

    done = th.cli("train", config, "--out", out, "--resume", cwd=folder)
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("cleanup")]
    assert "removed 2 temporary file(s) a stopped run left: checkpoints/" in line, line
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    _assert_identical(CheckpointState.load(CheckpointManager(checkpoints).latest()), _final_state(straight[1]))
