"""The README's data-, pipeline- and tensor-parallel commands, run as written: torchrun on the
digits examples, the Python scripts under torchrun, and graphforge schedule's timeline."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from _launch import REPO, shell

import graphforge
from graphforge.runtime import CheckpointState, Module

pytest.importorskip("torch")


def _blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


@pytest.fixture
def workspace(tmp_path) -> Path:
    """A folder that looks like a checkout to the README's relative paths; outputs stay in it."""
    for name in ("examples", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return tmp_path


def test_the_torchrun_command_trains_the_digits_on_two_processes(workspace):
    (block,) = [b for b in _blocks("sh") if "--standalone" in b and "train.toml" in b and "plan" not in b]
    done = shell(block, cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    assert done.stdout.count("data-parallel on 2 processes (gloo)") == 1  # rank 0 alone prints
    accuracy = float(re.search(r"done .*accuracy (\d\.\d+)", done.stdout).group(1))
    assert accuracy >= 0.93
    assert sorted(p.name for p in (workspace / "out" / "dp" / "checkpoints").iterdir())[-1] == (
        "checkpoint-00000345.safetensors"  # 15 epochs of 23 global batches of 2 x 32
    )


def test_the_plan_commands_write_a_config_that_torchrun_trains(workspace):
    """README's "Planning the split": plan the digits for 2 processes, then train the config it wrote."""
    (block,) = [b for b in _blocks("sh") if "graphforge plan" in b]
    done = shell(block, cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "wrote out/planned.toml" in done.stdout
    assert (workspace / "out" / "planned.toml").read_text().startswith("# planned by graphforge plan for 2 processes")
    assert "done     step 40" in done.stdout


def test_the_python_example_runs_under_torchrun(workspace):
    (block,) = [b for b in _blocks("python") if "DataParallel(module, world)" in b]
    (workspace / "train_dp.py").write_text(block)
    done = shell(".venv/bin/torchrun --standalone --nproc-per-node=2 train_dp.py", cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("loss ")]
    assert line.endswith("after 100 steps on 2 processes")
    assert float(line.split()[1]) < 1.0


def test_the_tensor_parallel_example_runs_under_torchrun_and_its_state_fits_the_whole_program(workspace):

    (block,) = [b for b in _blocks("python") if "TensorParallel(module, world)" in b]
    (workspace / "train_tp.py").write_text(block)
    done = shell(".venv/bin/torchrun --standalone --nproc-per-node=2 train_tp.py", cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("loss ")]
    assert line.endswith("after 100 steps on 2 processes")
    assert float(line.split()[1]) < 1.0
    pipeline = "loss(kind=cross_entropy, output=logits), tensor_parallel(size=2), autodiff, adamw(lr=1e-2)"
    program = graphforge.compile(str(REPO / "examples" / "digits" / "model.onnx"), pipeline).model
    state = CheckpointState.load(workspace / "digits-tp.safetensors", program)
    assert state.step == 100 and state.tensors["fc1.weight"].shape == (64, 64)
    data = np.load(REPO / "data" / "digits" / "test.npz")
    module = Module(program, state, device="cpu").eval()
    _, logits = module(data["images"], data["labels"], outputs=["logits"])
    assert (logits.argmax(1) == data["labels"]).mean() >= 0.9


def test_the_tensor_parallel_train_command_trains_the_digits_on_two_processes(workspace):
    (block,) = [b for b in _blocks("sh") if "train_tensor.toml" in b]
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
    (block,) = [b for b in _blocks("sh") if "train_pipeline.toml" in b]
    done = shell(block, cwd=workspace, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    assert done.stdout.count("pipeline of 2 stages × 4 micro-batches (1f1b, gloo)") == 1
    accuracy = float(re.search(r"done .*accuracy (\d\.\d+)", done.stdout).group(1))
    assert accuracy >= 0.9
    assert (workspace / "out" / "digits-pp.onnx").is_file()


def test_the_schedule_command_prints_the_timeline_shown(workspace):
    (command,) = [b for b in _blocks("sh") if "graphforge schedule" in b]
    done = shell(command, cwd=workspace, timeout=60)
    assert done.returncode == 0, done.stdout
    text = (REPO / "README.md").read_text()
    shown = re.search(r"^```\n(stage 0 F0.*?)^```", text, flags=re.DOTALL | re.MULTILINE).group(1)
    assert done.stdout.startswith(shown)
    assert "makespan 33, bubble 27.3% ((p-1)/(m+p-1) = 27.3% for balanced stages)" in done.stdout
