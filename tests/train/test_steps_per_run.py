"""[train] steps_per_run = k: ``graphforge train`` runs k steps in one onnxruntime run (the steps
pass, Module.train_steps). The run ends where the same run one step a run ends, bit for bit
(the program's ONNX update, dropout, a schedule, evaluation and checkpoints between runs, a
last run shorter than k), logs every step alike, and refuses what cannot happen between runs."""

from __future__ import annotations

import json

import _train_helpers as th
import numpy as np
import pytest

import graphforge.train
from graphforge import CheckpointState
from graphforge.errors import ConfigError

pytest.importorskip("torch")


def _config(folder, name: str, **train):
    document = th.base_config(
        train={"steps": 10, "update": "onnx", **train},
        eval={"every": 4},
        checkpoint={"every": 8},
        schedule={"kind": "cosine", "warmup_steps": 2},
        log={"every": 1, "tensorboard": False, "progress": False},
    )
    return th.write_config(folder, document, f"{name}.toml")


def test_k_steps_a_run_end_where_one_step_a_run_ends(tmp_path):
    folder = th.with_dropout(th.workspace(tmp_path / "ws"))
    single = graphforge.train.run(_config(folder, "single"), out=folder / "single", quiet=True)
    several = graphforge.train.run(_config(folder, "several", steps_per_run=4), out=folder / "several", quiet=True)
    assert several.step == single.step == 10
    want, got = (CheckpointState.load(r.checkpoint) for r in (single, several))
    assert set(got.tensors) == set(want.tensors)
    for name, value in want.tensors.items():
        np.testing.assert_array_equal(got.tensors[name], value, err_msg=name)
    assert got.scheduler == want.scheduler and got.properties["samples"] == want.properties["samples"]
    logged = [[json.loads(line) for line in r.log.read_text().splitlines()] for r in (single, several)]
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss")
    single_log, several_log = ([{k: r.get(k) for k in keys} for r in log] for log in logged)
    assert several_log == single_log
    # evaluations at 4, 8 and the end; checkpoints at 8 and the end (10: a last run of two steps)
    assert [r["step"] for r in logged[1] if "eval_loss" in r] == [4, 8, 10]
    saved = sorted(int(p.stem.split("-")[1]) for p in (folder / "several" / "checkpoints").glob("*.safetensors"))
    assert saved == [8, 10]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"eval": {"every": 3}}, "eval.every = 3 is not a multiple of train.steps_per_run = 4"),
        ({"checkpoint": {"every": 6}}, "checkpoint.every = 6 is not a multiple of train.steps_per_run = 4"),
        ({"train": {"accumulate": 2}}, "no accumulation across runs"),
        ({"train": {"update": "torch"}}, 'train.update = "torch" cannot run there'),
        ({"profile": {"start": 2}, "data": {"eval": None}}, r"\[profile\] traces single steps"),
    ],
    ids=["eval", "checkpoint", "accumulate", "torch", "profile"],
)
def test_what_cannot_happen_between_runs_is_refused_in_one_line(tmp_path, change, words):
    folder = th.workspace(tmp_path / "ws", count=16, eval_count=8)
    train = {"steps": 8, "steps_per_run": 4, **change.pop("train", {})}
    document = th.base_config(train=train, **change)
    with pytest.raises(ConfigError, match=words):
        graphforge.train.run(th.write_config(folder, document), out=folder / "out", quiet=True)
