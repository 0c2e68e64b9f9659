"""``graphforge train`` with a pipeline program: under torchrun, one process per stage, it
ends with the model one process training the same config ends with (the micro-batches in
turn), its checkpoints hold every stage's tensors and resume on another stage count, and
starting the wrong number of processes is refused in one line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from _launch import REPO, torchrun
from _tracebacks import assert_no_traceback
from onnx import numpy_helper

import graphforge.train
from graphforge.train.logs import read_jsonl

pytest.importorskip("torch")

TIMEOUT_S = 180
STEPS = 16
EXAMPLE = REPO / "examples" / "digits" / "train_pipeline.toml"


def _config(folder: Path, batch_size: int = 8) -> Path:
    """The shipped example with absolute paths, a checkpoint every 8 steps, and ``batch_size``."""
    text = EXAMPLE.read_text().replace("batch_size = 8 ", f"batch_size = {batch_size} ")
    text = text.replace('"model.onnx"', f'"{EXAMPLE.parent / "model.onnx"}"')
    text = text.replace('"../../data/', f'"{REPO / "data"}/').replace("every = 45\nkeep_last", "every = 8\nkeep_last")
    path = folder / f"train_pipeline-{batch_size}.toml"
    path.write_text(text)
    return path


def _train(config: Path, out: Path, *extra: str, processes: int = 2) -> subprocess.CompletedProcess:
    args = ["--standalone", f"--nproc-per-node={processes}", "-m", "graphforge", "train", str(config)]
    done = torchrun([*args, "--out", str(out), *extra], timeout=TIMEOUT_S)
    return done


def _export(out: Path) -> dict[str, np.ndarray]:
    path = out.parent / f"{out.name}.onnx"
    graphforge.train.export(out / "program.onnx", path, checkpoint=out)
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(out / "log.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pp-train")
    config = _config(root)
    done = _train(config, root / "stages", "--steps", str(STEPS))
    assert done.returncode == 0, done.stdout[-4000:]
    graphforge.train.run(config, steps=STEPS, out=root / "one", quiet=True)
    return root


def test_the_stages_export_the_model_one_process_exports(runs):
    theirs, ours = _export(runs / "one"), _export(runs / "stages")
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_losses(runs / "stages"), _losses(runs / "one"), rtol=1e-5)


def test_each_stage_writes_its_own_tensors_and_the_checkpoint_reads_them_all(runs, tmp_path):
    import safetensors

    from graphforge.errors import CheckpointError
    from graphforge.program import ProgramRoles
    from graphforge.runtime import CheckpointState

    folder = runs / "stages" / "checkpoints"
    main, shard = (
        folder / f"checkpoint-{STEPS:08d}.safetensors",
        folder / f"checkpoint-{STEPS:08d}.stage1-of-2.safetensors",
    )
    role = ProgramRoles.read(runs / "stages" / "program.onnx").stages
    with safetensors.safe_open(str(main), framework="numpy") as f:
        first = set(f.keys())
    with safetensors.safe_open(str(shard), framework="numpy") as f:
        second = set(f.keys())
    assert set(role.parameters[0]) <= first and not set(role.parameters[1]) & first
    assert set(role.parameters[1]) <= second and not first & second
    state = CheckpointState.load(main, runs / "stages" / "program.onnx")  # checks every tensor is there
    assert set(state.tensors) == first | second
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / shard.name).unlink()
    with pytest.raises(CheckpointError, match=f"its shard {shard.name} is missing"):
        CheckpointState.load(broken / main.name)


def test_the_checkpoint_resumes_on_another_stage_count(runs, tmp_path):
    """The stages' checkpoint of step 8 holds every tensor: one process goes on from it to
    step 16 and ends where the stages (and one process) did."""
    out = tmp_path / "resumed"
    shutil.copytree(runs / "stages", out)
    (out / "checkpoints" / f"checkpoint-{STEPS:08d}.safetensors").unlink()
    graphforge.train.run(runs / "train_pipeline-8.toml", steps=STEPS, out=out, quiet=True)
    theirs, ours = _export(runs / "one"), _export(out)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-7)


def test_two_data_parallel_pipelines_train_as_one_process_with_the_doubled_batch(tmp_path):
    """2 × 2 on 4 processes: each pipeline takes every other sample of each micro-batch of 16."""
    done = _train(_config(tmp_path), tmp_path / "dp-pp", "--steps", "12", processes=4)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "data-parallel × 2" in done.stdout
    graphforge.train.run(_config(tmp_path, batch_size=16), steps=12, out=tmp_path / "one", quiet=True)
    theirs, ours = _export(tmp_path / "one"), _export(tmp_path / "dp-pp")
    for name, value in theirs.items():  # norm-wise: AdamW amplifies the averaging's rounding
        assert np.linalg.norm(ours[name] - value) <= 1e-5 * np.linalg.norm(value), name


def test_the_wrong_number_of_processes_is_refused(tmp_path):
    done = _train(EXAMPLE, tmp_path / "three", "--steps", "2", processes=3)
    assert done.returncode != 0
    assert "the program has 2 pipeline stages, but 3 processes were started" in done.stdout
    assert_no_traceback(done.stdout, launcher=True)  # torchrun prints its launcher's own
