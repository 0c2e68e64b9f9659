"""``graphforge train`` as N processes: under torchrun it trains as one process with the
N-times batch, resumes bit for bit (and on another number of processes), refuses ranks that
disagree, stops with one line naming a rank that died or hangs, and rendezvouses across two
launchers as two nodes would."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import _train_runs as runs
import numpy as np
import pytest
from _launch import (
    REPO,
    children_by_rank,
    finish,
    free_port,
    kill,
    rank_environment,
    spawn,
    start_torchrun,
    wait_all,
)
from _tracebacks import assert_no_traceback

import graphforge.train
from graphforge.runtime import CheckpointState
from graphforge.train.logs import read_jsonl

pytest.importorskip("torch")
sys.path.insert(0, str(REPO / "tests" / "train"))
import _train_helpers as th

STEPS = 12


def config(folder: Path, name: str = "train.toml", **sections) -> Path:
    """The training helpers' config, batch 8 per process, a checkpoint every 3 steps, a 10 s timeout."""
    defaults = {
        "data": {"batch_size": 8},
        "checkpoint": {"every": 3, "keep_last": 10},
        "distributed": {"timeout_s": 10},
    }
    return runs.config(folder, name, defaults, **sections)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return th.workspace(tmp_path_factory.mktemp("dp-train"), count=256, eval_count=37)


def checkpoint(out: Path, step: int) -> CheckpointState:
    return CheckpointState.load(runs.checkpoint_path(out, step))


@pytest.fixture(scope="module")
def two_process_run(folder) -> Path:
    out = folder / "out-2"
    runs.launch(folder, config(folder), out, "--steps", str(STEPS))
    return out


def test_torchrun_trains_as_one_process_with_the_n_times_batch(folder, two_process_run):
    one = graphforge.train.run(
        config(folder, "one.toml", data={"batch_size": 16}), steps=STEPS, out=folder / "out-1", quiet=True
    )
    two = checkpoint(two_process_run, STEPS)
    want = CheckpointState.load(one.checkpoint)
    for name, value in want.tensors.items():
        error = np.linalg.norm(two.tensors[name].astype(np.float64) - value) / np.linalg.norm(value)
        assert error <= 1e-5, (name, error)
    assert two.properties["world_size"] == 2 and two.properties["samples"] == want.properties["samples"]
    records, reference = read_jsonl(two_process_run / "log.jsonl"), read_jsonl(folder / "out-1" / "log.jsonl")
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, expected in zip(records, reference, strict=True):  # losses averaged over ranks; eval split and summed
        for key in ("loss", "eval_loss", "eval_accuracy", "samples"):
            if key in expected:
                assert got[key] == pytest.approx(expected[key], rel=1e-5), (key, got, expected)
    assert sorted(p.name for p in two_process_run.iterdir()) == [
        "checkpoints",
        "log.jsonl",
        "program.onnx",
        "tensorboard",
    ]


def test_a_two_process_run_stopped_and_resumed_equals_the_uninterrupted_one_bit_for_bit(folder, two_process_run):
    out = folder / "out-2-resumed"
    cfg = config(folder)
    runs.launch(folder, cfg, out, "--steps", "6")
    shutil.copytree(out, folder / "out-2-then-1")
    runs.launch(folder, cfg, out, "--steps", str(STEPS))
    resumed, uninterrupted = checkpoint(out, STEPS), checkpoint(two_process_run, STEPS)
    assert sorted(resumed.tensors) == sorted(uninterrupted.tensors)
    for name, value in uninterrupted.tensors.items():
        assert np.array_equal(resumed.tensors[name], value), name
    assert resumed.data_position == uninterrupted.data_position
    assert resumed.step == uninterrupted.step and resumed.learning_rate == uninterrupted.learning_rate

    # the same checkpoint of step 6 goes on in one process: it starts at the first sample not consumed
    six = checkpoint(folder / "out-2-then-1", 6)
    result = graphforge.train.run(cfg, steps=8, out=folder / "out-2-then-1", quiet=True)
    assert result.resumed_from.name == "checkpoint-00000006.safetensors" and result.step == 8
    after = CheckpointState.load(result.checkpoint)
    consumed = six.data_position["batch"] * 16  # the two processes' global batch
    assert after.data_position["batch"] == consumed // 8 + 2 and after.properties["world_size"] == 1


def test_ranks_that_run_other_configs_are_refused_by_name(folder, tmp_path):
    cfgs = [config(folder, "a.toml"), config(folder, "b.toml", train={"lr": 0.02})]
    port = free_port()
    procs = [
        _rank(
            rank,
            count=2,
            port=port,
            argv=[*runs.TRAIN, str(cfgs[rank]), "--out", str(tmp_path / "out"), "-q"],
            cwd=folder,
        )
        for rank in range(2)
    ]
    finished = wait_all(procs, runs.TIMEOUT_S)
    for f in finished:
        assert f.returncode == 2, f.output
        assert "rank 1's train.lr is 0.02 but rank 0's is 0.05" in f.output, f.output
        assert_no_traceback(f.output)
    assert not (tmp_path / "out").exists()


def _rank(rank: int, *, count: int, port: int, argv: list[str], cwd: Path) -> subprocess.Popen:
    """One rank of a group started by hand (as torchrun would, without its agent)."""
    return spawn([sys.executable, *argv], cwd=cwd, env=rank_environment(rank, count, port))


def _wait_for_checkpoint(out: Path, procs, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not list((out / "checkpoints").glob("*.safetensors")):
        assert time.monotonic() < deadline, "no checkpoint written"
        assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs]
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["killed", "hangs"])
def test_a_rank_that_dies_or_hangs_stops_the_other_with_one_line_naming_it(folder, tmp_path, how):
    timeout = 6  # not the check-in's 10 s: the message names the one in force
    cfg = config(
        folder,
        f"long-{how}.toml",
        checkpoint={"every": 25, "keep_last": 2},
        log={"every": 25},
        distributed={"timeout_s": timeout},
    )
    out = tmp_path / "out"
    port = free_port()
    argv = [*runs.TRAIN, str(cfg), "--out", str(out), "--steps", "1000000", "-q"]
    procs = [_rank(r, count=2, port=port, argv=argv, cwd=folder) for r in range(2)]
    _wait_for_checkpoint(out, procs)
    os.kill(procs[1].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        done = finish(procs[0], 60)
    finally:
        kill(procs[1])
        procs[1].communicate()
    seconds, output = time.monotonic() - stopped, done.stdout
    assert done.returncode == 2, output
    assert_no_traceback(output)
    (line,) = [x for x in output.splitlines() if x.startswith("error:")]
    assert "rank 0:" in line and "rank 1 did not answer" in line, line
    if how == "hangs":
        assert (
            f"within the collectives' timeout of {timeout} s, and did not check in within {timeout} s after" in line
        ), line
    else:
        assert re.search(rf"the connection broke after \d+ s and rank 1 did not check in within {timeout} s", line), (
            line
        )
    assert seconds < timeout + timeout + 15  # the timeout, the check-in, and slack for a loaded machine
    for path in (out / "checkpoints").glob("*"):  # only complete checkpoints, each loads
        assert path.suffix == ".safetensors", path
        CheckpointState.load(path)


def test_torchrun_stops_the_others_when_a_rank_is_killed(folder, tmp_path):
    cfg = config(folder, "long.toml", checkpoint={"every": 25, "keep_last": 2}, log={"every": 25})
    out = tmp_path / "out"
    args = ["--standalone", "--nproc-per-node=2", *runs.TRAIN, str(cfg), "--out", str(out), "--steps", "1000000", "-q"]
    proc = start_torchrun(args, cwd=folder)
    try:
        _wait_for_checkpoint(out, [proc])
        workers = children_by_rank(proc.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        output = finish(proc, 60).stdout
    finally:
        kill(proc)
    assert proc.returncode != 0
    (line,) = [x for x in output.splitlines() if x.startswith("error:")]  # rank 0's one line
    assert "rank 0: stopped by SIGTERM" in line, output[-3000:]
    assert "rank      : 1 (local_rank: 1)" in output.split("Root Cause")[1], output[-3000:]  # torchrun's report
    for path in (out / "checkpoints").glob("*"):
        CheckpointState.load(path)


def test_two_launchers_rendezvous_as_two_nodes(folder, tmp_path):
    cfg = config(folder)
    port = free_port()
    out = tmp_path / "out"
    nodes = []
    for node in range(2):
        args = [
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            *runs.TRAIN,
            str(cfg),
            "--out",
            str(out),
            "--steps",
            "6",
        ]
        nodes.append(start_torchrun(args, cwd=folder))
    finished = wait_all(nodes, runs.TIMEOUT_S)
    for f in finished:
        assert f.returncode == 0, f.output[-3000:]
    assert "data-parallel on 2 processes" in finished[0].output
    assert checkpoint(out, 6).properties["world_size"] == 2
