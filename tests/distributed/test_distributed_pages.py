"""The Distributed pages' commands, run as written: torchrun on the digits examples (data
parallel, ZeRO, pipeline, tensor parallel, a planned split), the Python scripts under torchrun,
and graphforge schedule's timeline."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from _launch import REPO, shell
from _pages import page_block

import graphforge
from graphforge.runtime import CheckpointState, Module

pytest.importorskip("torch")


DATA_PARALLEL = "docs/distributed/data-parallel.md"
PIPELINE = "docs/distributed/pipeline.md"
TENSOR_PARALLEL = "docs/distributed/tensor-parallel.md"


@pytest.fixture
def workspace(tmp_path) -> Path:
    """A folder that looks like a checkout to the pages' relative paths; outputs stay in it."""
    for name in ("examples", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return tmp_path


def test_the_torchrun_command_trains_the_digits_on_two_processes(workspace):
    block = page_block(DATA_PARALLEL, "sh", "--standalone", "train.toml")
    done = shell(block, cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    assert done.stdout.count("data-parallel on 2 processes (gloo)") == 1  # rank 0 alone prints
    accuracy = float(re.search(r"done .*accuracy (\d\.\d+)", done.stdout).group(1))
    assert accuracy >= 0.93
    assert sorted(p.name for p in (workspace / "out" / "dp" / "checkpoints").iterdir())[-1] == (
        "checkpoint-00000345.safetensors"  # 15 epochs of 23 global batches of 2 x 32
    )


def test_the_zero_command_trains_the_digits_with_sharded_states_on_two_processes(workspace):
    block = page_block("docs/distributed/zero.md", "sh", "train_zero.toml")
    done = shell(block, cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    # the page's line: what each process holds (rank 0 alone prints)
    assert len(re.findall(r"zero: stage 2, this process holds [\d.]+ KiB of optimizer state \(1/2\)", done.stdout)) == 1
    accuracy = float(re.search(r"done .*accuracy (\d\.\d+)", done.stdout).group(1))
    assert accuracy >= 0.9
    checkpoints = workspace / "out" / "zero" / "checkpoints"
    last = sorted(p.name for p in checkpoints.iterdir() if ".zero" not in p.name)[-1]
    shards = sorted(p.name for p in checkpoints.glob(last.replace(".safetensors", ".zero*")))
    assert shards == [last.replace(".safetensors", f".zero{r}-of-2.safetensors") for r in range(2)]


def test_the_plan_commands_write_a_config_that_torchrun_trains(workspace):
    """The planning page: plan the digits for 2 processes, then train the config it wrote."""
    block = page_block("docs/distributed/planning.md", "sh", "graphforge plan")
    done = shell(block, cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "wrote out/planned.toml" in done.stdout
    assert (workspace / "out" / "planned.toml").read_text().startswith("# planned by graphforge plan for 2 processes")
    assert "done     step 40" in done.stdout


def test_the_python_example_runs_under_torchrun(workspace):
    block = page_block(DATA_PARALLEL, "python", "DataParallel(module, world)")
    (workspace / "train_dp.py").write_text(block)
    done = shell(".venv/bin/torchrun --standalone --nproc-per-node=2 train_dp.py", cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("loss ")]
    assert line.endswith("after 100 steps on 2 processes")
    assert float(line.split()[1]) < 1.0


def test_the_tensor_parallel_example_runs_under_torchrun_and_its_state_fits_the_whole_program(workspace):

    block = page_block(TENSOR_PARALLEL, "python", "TensorParallel(module, world)")
    (workspace / "train_tp.py").write_text(block)
    done = shell(".venv/bin/torchrun --standalone --nproc-per-node=2 train_tp.py", cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("loss ")]
    assert line.endswith("after 100 steps on 2 processes")
    assert float(line.split()[1]) < 1.0
    pipeline = "loss(kind=cross_entropy, output=logits), tensor_parallel(size=2), autodiff, adamw(lr=1e-2)"
    program = graphforge.compile(str(REPO / "examples" / "digits" / "model.onnx"), pipeline).model
    assert not (workspace / "digits-tp.safetensors").exists()  # under out/, which .gitignore covers
    state = CheckpointState.load(workspace / "out" / "digits-tp.safetensors", program)
    assert state.step == 100 and state.tensors["fc1.weight"].shape == (64, 64)
    data = np.load(REPO / "data" / "digits" / "test.npz")
    module = Module(program, state, device="cpu").eval()
    _, logits = module(data["images"], data["labels"], outputs=["logits"])
    assert (logits.argmax(1) == data["labels"]).mean() >= 0.9


def test_the_tensor_parallel_train_command_trains_the_digits_on_two_processes(workspace):
    block = page_block(TENSOR_PARALLEL, "sh", "train_tensor.toml")
    done = shell(block, cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    assert done.stdout.count("tensor-parallel on 2 processes (gloo)") == 1  # rank 0 alone prints
    accuracy = float(re.search(r"done .*accuracy (\d\.\d+)", done.stdout).group(1))
    assert accuracy >= 0.93
    checkpoints = workspace / "out" / "tp" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("checkpoint-00000675*")) == [
        "checkpoint-00000675.safetensors",
        "checkpoint-00000675.tensor0-of-2.safetensors",
        "checkpoint-00000675.tensor1-of-2.safetensors",
    ]
    last = CheckpointState.load(checkpoints / "checkpoint-00000675.safetensors")
    assert last.tensors["fc1.weight"].shape == (64, 64)  # whole: the members' slices joined


def test_the_pipeline_commands_train_two_stages_and_export(workspace):
    block = page_block(PIPELINE, "sh", "train_pipeline.toml")
    done = shell(block, cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    assert done.stdout.count("pipeline of 2 stages × 4 micro-batches (1f1b, gloo)") == 1
    accuracy = float(re.search(r"done .*accuracy (\d\.\d+)", done.stdout).group(1))
    assert accuracy >= 0.9
    assert (workspace / "out" / "digits-pp.onnx").is_file()


def test_the_schedule_command_prints_the_timeline_shown(workspace):
    command = page_block(PIPELINE, "sh", "graphforge schedule")
    done = shell(command, cwd=workspace, timeout=60)
    assert done.returncode == 0, done.stdout
    shown = page_block(PIPELINE, "", "stage 0 F0")
    assert done.stdout.startswith(shown)
    assert "makespan 33, bubble 27.3% ((p-1)/(m+p-1) = 27.3% for balanced stages)" in done.stdout
