"""What a new user meets first with ``graphforge train``: what it prints is what runs, a config
for several processes started alone says what it does, a closed output stops the printing and
not the training, and what it writes gets an ordinary file's mode."""

from __future__ import annotations

import io
import os
import stat
import subprocess

import _train_helpers as th
from rich.console import Console

import graphforge.train
from graphforge.tempfiles import _UMASK


def _printed(config, out) -> tuple[graphforge.train.TrainResult, str]:
    text = io.StringIO()
    result = graphforge.train.run(config, out=out, console=Console(file=text, width=400))
    return result, text.getvalue()


def test_the_pipeline_it_prints_is_the_one_written(tmp_path):
    """The model line quotes model.pipeline as the config spells it (a default it names, the
    order of its arguments), not the passes re-spelled."""
    spelled = "loss(output=logits, kind=cross_entropy), autodiff, adamw(lr=5e-2, weight_decay=0.01)"
    folder = th.workspace(tmp_path)
    config = th.write_config(folder, th.base_config(model={"pipeline": spelled}, train={"steps": 2}))
    _, printed = _printed(config, folder / "out")
    assert f'compiled with "{spelled}"' in printed


def test_a_tensor_parallel_config_started_alone_says_it_trains_one_process(tmp_path):
    folder = th.workspace(tmp_path)
    config = th.write_config(folder, th.base_config(train={"steps": 2}, distributed={"tensor": 2}))
    result, printed = _printed(config, folder / "out")
    assert result.step == 2
    assert printed.count("started alone, this run trains the whole model on one process") == 1
    assert "torchrun --nproc-per-node=2" in printed


def test_checkpoints_programs_and_exports_get_the_mode_of_an_ordinary_file(tmp_path):
    folder = th.workspace(tmp_path)
    config = th.write_config(folder, th.base_config(train={"steps": 2}))
    result = graphforge.train.run(config, out=folder / "out", quiet=True)
    exported = graphforge.train.export(result.program, folder / "model.onnx", checkpoint=result.checkpoint)
    ordinary = 0o666 & ~_UMASK
    for path in (result.checkpoint, result.program, exported.path, result.log):
        assert stat.S_IMODE(os.stat(path).st_mode) == ordinary, path


def test_a_closed_output_stops_the_printing_not_the_training(tmp_path):
    """``graphforge train ... | head -2``: the run goes on to its last checkpoint and exits 0,
    saying once on stderr that it prints no more."""
    folder = th.workspace(tmp_path)
    config = th.write_config(folder, th.base_config(train={"steps": 24}, log={"every": 1}))
    proc = subprocess.Popen(
        [str(th.GRAPHFORGE), "train", str(config), "--out", str(folder / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = [proc.stdout.readline() for _ in range(2)]
    proc.stdout.close()  # as head does after its lines
    _, errors = proc.communicate(timeout=120)
    assert first[0].startswith("model")
    assert proc.returncode == 0, errors
    assert errors.count("the output was closed; going on without printing") == 1 and "Traceback" not in errors
    state = graphforge.CheckpointState.load(folder / "out" / "checkpoints" / "checkpoint-00000024.safetensors")
    assert state.step == 24
