"""``graphforge train`` with ``[distributed] zero``: a 2-process run stopped and resumed equals
the uninterrupted one bit for bit; its sharded checkpoint resumes on 1 and on 4 processes;
a deleted shard is refused by name; a process killed mid-run stops the other with one line,
and every checkpoint left loads."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import _train_runs as runs
import numpy as np
import pytest
from _launch import REPO, finish, free_port, kill, rank_environment, spawn
from _tracebacks import assert_no_traceback

import graphforge.train
from graphforge.errors import CheckpointError
from graphforge.runtime import CheckpointState

pytest.importorskip("torch")
sys.path.insert(0, str(REPO / "tests" / "train"))
import _train_helpers as th

STEPS = 8


def config(folder: Path, name: str = "zero.toml", **sections) -> Path:
    defaults = {
        "data": {"batch_size": 8},
        "checkpoint": {"every": 4, "keep_last": 10},
        "distributed": {"timeout_s": 10, "zero": 2, "bucket_mb": 0.002},
    }
    return runs.config(folder, name, defaults, **sections)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return th.workspace(tmp_path_factory.mktemp("zero-train"), count=256, eval_count=37)


def test_a_zero_run_resumes_bit_for_bit_and_on_other_process_counts(folder):
    cfg = config(folder)
    whole = runs.launch(folder, cfg, folder / "whole", "--steps", str(STEPS))
    assert "zero: stage 2" in whole.stdout and "(1/2)" in whole.stdout
    names = sorted(p.name for p in (folder / "whole" / "checkpoints").iterdir())
    assert names == [
        f"checkpoint-{s:08d}{part}.safetensors" for s in (4, 8) for part in ("", ".zero0-of-2", ".zero1-of-2")
    ]
    out = folder / "stopped"
    runs.launch(folder, cfg, out, "--steps", "4")
    for other in ("on-1", "on-4"):
        shutil.copytree(out, folder / other)
    runs.launch(folder, cfg, out, "--steps", str(STEPS))
    resumed, uninterrupted = (CheckpointState.load(runs.checkpoint_path(o, STEPS)) for o in (out, folder / "whole"))
    assert sorted(resumed.tensors) == sorted(uninterrupted.tensors)
    assert any(n.endswith(".exp_avg_sq") for n in resumed.tensors)
    for name, value in uninterrupted.tensors.items():
        assert np.array_equal(resumed.tensors[name], value), name

    # the checkpoint of step 4 goes on in one process, and on four (each then holds a quarter)
    result = graphforge.train.run(cfg, steps=6, out=folder / "on-1", quiet=True)
    assert result.resumed_from.name == "checkpoint-00000004.safetensors" and result.step == 6
    assert CheckpointState.load(result.checkpoint).properties["world_size"] == 1
    four = runs.launch(folder, cfg, folder / "on-4", "--steps", "6", ranks=4)
    assert "(1/4)" in four.stdout and "resuming a checkpoint of 2 process(es) on 4" in four.stdout
    assert CheckpointState.load(runs.checkpoint_path(folder / "on-4", 6)).step == 6
    assert len(list((folder / "on-4" / "checkpoints").glob("checkpoint-00000006.zero*-of-4.safetensors"))) == 4

    name = "checkpoint-00000004.zero1-of-2.safetensors"
    (out / "checkpoints" / name).unlink()
    with pytest.raises(CheckpointError, match=f"its shard {name} is missing"):
        CheckpointState.load(runs.checkpoint_path(out, 4))


def test_a_killed_process_stops_the_other_with_one_line_and_the_checkpoints_load(folder, tmp_path):
    timeout = 6
    cfg = config(
        folder,
        "long.toml",
        checkpoint={"every": 25, "keep_last": 2},
        log={"every": 25},
        distributed={"timeout_s": timeout},
    )
    out = tmp_path / "out"
    port = free_port()
    argv = [sys.executable, *runs.TRAIN, str(cfg), "--out", str(out), "--steps", "1000000", "-q"]
    procs = [spawn(argv, cwd=folder, env=rank_environment(r, 2, port)) for r in range(2)]
    deadline = time.monotonic() + 60
    while not list((out / "checkpoints").glob("checkpoint-????????.safetensors")):
        assert time.monotonic() < deadline, "no checkpoint written"
        assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs]
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGKILL)
    try:
        done = finish(procs[0], 60)
    finally:
        kill(procs[1])
        procs[1].communicate()
    assert done.returncode == 2, done.stdout
    assert_no_traceback(done.stdout)
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("error:")]
    assert "rank 0:" in line and "rank 1 did not answer" in line, line
    newest = sorted((out / "checkpoints").glob("checkpoint-????????.safetensors"))[-1]
    state = CheckpointState.load(newest, out / "program.onnx")  # whole: the shards it names are all there
    assert any(n.endswith(".exp_avg") for n in state.tensors)
