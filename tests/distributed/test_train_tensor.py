"""``graphforge train`` with ``[distributed] tensor = 2``: two processes, each compiling its
member's program and taking every batch whole, train as the same config does on one process
(which ignores the section); their checkpoints (each member's slices in a file of its own,
joined on loading) resume on one process, and one process's on two; four processes are two
data-parallel replicas of a group of two, each taking half of every batch, and train alike;
so do four as the two pipeline stages of tensor groups of two, and eight as two replicas of
that pipeline; refusals name the key."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import _train_runs as runs
import numpy as np
import pytest
from _launch import REPO
from graphforge.passes import TensorParallel
from graphforge.passes.tensor_parallel import with_tensor_parallel

import graphforge.train
from graphforge.pass_manager import parse_pipeline
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointState
from graphforge.train.config import ConfigError, load_config
from graphforge.train.setup import prepare
from graphforge.train.topology import _tensor_stages

pytest.importorskip("torch")
sys.path.insert(0, str(REPO / "tests" / "train"))
import _train_helpers as th

STEPS = 8
#: the members sum their partial products in another order than one process's product
TOLERANCE = 1e-5


def config(folder: Path, name: str = "tensor.toml", **sections) -> Path:
    defaults = {"checkpoint": {"every": 4, "keep_last": 10}, "distributed": {"timeout_s": 20, "tensor": 2}}
    return runs.config(folder, name, defaults, **sections)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return th.workspace(tmp_path_factory.mktemp("tensor-train"), count=64, eval_count=20)


def _assert_close(a: Path, b: Path) -> None:
    got, want = CheckpointState.load(a), CheckpointState.load(b)
    assert got.step == want.step and sorted(got.tensors) == sorted(want.tensors)
    for name, value in want.tensors.items():
        np.testing.assert_allclose(got.tensors[name], value, rtol=0, atol=TOLERANCE, err_msg=name)


def test_two_members_train_and_resume_as_one_process(folder):
    cfg = config(folder)
    two = runs.launch(folder, cfg, folder / "two", "--steps", str(STEPS))
    assert "tensor-parallel on 2 processes (gloo)" in two.stdout
    assert "each process holds 1/2 of 9 carried tensors" in two.stdout
    # what rank 0 prints is what it runs: the user's pipeline, its member's split spelled out
    loss, rest = th.PIPELINE.split("), ", 1)
    assert f'"{loss}), tensor_parallel(size=2, rank=0, vocab=true), {rest}"' in two.stdout
    names = sorted(p.name for p in (folder / "two" / "checkpoints").iterdir())
    assert names == [
        f"checkpoint-{s:08d}{part}.safetensors" for s in (4, 8) for part in ("", ".tensor0-of-2", ".tensor1-of-2")
    ]
    one = graphforge.train.run(cfg, steps=STEPS, out=folder / "one", quiet=True)
    _assert_close(runs.checkpoint_path(folder / "two", STEPS), one.checkpoint)
    assert CheckpointState.load(runs.checkpoint_path(folder / "two", STEPS)).tensors["fc1.weight"].shape == (
        th.HIDDEN,
        th.N_IN,
    )

    # the members' checkpoint of step 4 goes on in one process, and one process's on two members
    shutil.copytree(folder / "two", folder / "two-on-one")
    for path in (folder / "two-on-one" / "checkpoints").glob("checkpoint-00000008*"):
        path.unlink()
    resumed = graphforge.train.run(cfg, steps=STEPS, out=folder / "two-on-one", quiet=True)
    assert resumed.resumed_from.name == "checkpoint-00000004.safetensors"
    _assert_close(resumed.checkpoint, one.checkpoint)
    shutil.copytree(folder / "one", folder / "one-on-two")
    for path in (folder / "one-on-two" / "checkpoints").glob("checkpoint-00000008*"):
        path.unlink()
    runs.launch(folder, cfg, folder / "one-on-two", "--steps", str(STEPS))
    _assert_close(runs.checkpoint_path(folder / "one-on-two", STEPS), one.checkpoint)


@pytest.mark.parametrize("zero", [0, 2])
def test_four_processes_are_two_replicas_of_a_tensor_group_and_train_as_one(folder, zero):
    """T × D = 2 × 2: ranks 0, 1 one replica's group, 2, 3 the other's, each replica taking
    data.batch_size samples a step as a data-parallel process does (4 here: the global batch
    is one process's 8); the replicas' gradients are averaged (with distributed.zero = 2,
    reduce-scattered and each replica's shard of the states updated, gathered for each
    checkpoint), the first group writes the checkpoints; the state equals one process's."""
    cfg = config(folder, f"mesh{zero}.toml", data={"batch_size": 4}, distributed={"zero": zero})
    four = runs.launch(folder, cfg, folder / f"four{zero}", "--steps", str(STEPS), ranks=4)
    zeroed = f", ZeRO stage {zero} over the replicas" if zero else ""
    assert f"tensor-parallel groups of 2 × 2 data-parallel replicas{zeroed}" in four.stdout
    if not (folder / "one" / "checkpoints").is_dir():
        graphforge.train.run(config(folder), steps=STEPS, out=folder / "one", quiet=True)
    _assert_close(runs.checkpoint_path(folder / f"four{zero}", STEPS), runs.checkpoint_path(folder / "one", STEPS))
    names = sorted(p.name for p in (folder / f"four{zero}" / "checkpoints").iterdir())
    assert names == [
        f"checkpoint-{s:08d}{part}.safetensors" for s in (4, 8) for part in ("", ".tensor0-of-2", ".tensor1-of-2")
    ]


LORA = f"lora(r=2, alpha=4, targets=[fc1, fc2]), {th.PIPELINE}"


@pytest.mark.parametrize("ranks", [2, 4])
def test_lora_adapters_split_with_their_base_weights_and_train_as_one_process(folder, ranks):
    """Low-rank adapters under tensor = 2: fc1's B split along its rows as fc1 (column), fc2's A
    along its columns as fc2 (row), fc1's A and fc2's B whole on every member; two members
    train as one process does; four (two replicas of the group, ZeRO stage 2 over them, each
    taking half of each batch) as one process with the doubled batch. The checkpoint holds the
    adapters and their moments alone (the frozen base stays in the program), joined whole."""
    mesh = {"data": {"batch_size": 4}, "distributed": {"zero": 2}} if ranks == 4 else {}
    cfg = config(folder, f"lora{ranks}.toml", model={"pipeline": LORA}, **mesh)
    launched = runs.launch(folder, cfg, folder / f"lora{ranks}", "--steps", str(STEPS), ranks=ranks)
    assert "tensor-parallel" in launched.stdout
    split = ProgramRoles.read(folder / f"lora{ranks}" / "program.onnx").tensor_parallel.split
    assert {n: a for n, a in split.items() if ".lora_" in n} == {"fc1.lora_B.weight": 0, "fc2.lora_A.weight": 1}
    one = folder / "lora-one"
    if not (one / "checkpoints").is_dir():
        graphforge.train.run(
            config(folder, "lora-one.toml", model={"pipeline": LORA}), steps=STEPS, out=one, quiet=True
        )
    got = runs.checkpoint_path(folder / f"lora{ranks}", STEPS)
    _assert_close(got, runs.checkpoint_path(one, STEPS))
    adapters = {f"fc{i}.lora_{x}.weight" for i in (1, 2) for x in "AB"}
    tensors = CheckpointState.load(got).tensors
    assert set(tensors) == adapters | {f"{n}.{m}" for n in adapters for m in ("exp_avg", "exp_avg_sq")}
    assert tensors["fc1.lora_B.weight"].shape == (th.HIDDEN, 2) and tensors["fc2.lora_A.weight"].shape == (2, th.HIDDEN)
    assert np.abs(tensors["fc1.lora_B.weight"]).max() > 0.01  # B started at zero: trained


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"model": {"program": "program.onnx", "path": None, "pipeline": None}}, "needs model.path and model.pipeline"),
        (
            {"model": {"pipeline": f"tensor_parallel(size=2), {th.PIPELINE}"}},
            r"model.pipeline has tensor_parallel\(...\) and distributed.tensor = 2 adds it",
        ),
        ({}, r"distributed.tensor = 2, but 1 process\(es\) were started: start a multiple of 2"),
    ],
)
def test_what_a_tensor_parallel_run_cannot_do_is_refused_by_key(folder, world_of_one, sections, message):
    cfg = load_config(config(folder, "refused.toml", **sections))
    with pytest.raises(ConfigError, match=message):
        prepare(cfg, world_of_one)


STAGED = f"{th.PIPELINE.replace('lr=0.05', 'lr=0.05, accumulate=true')}, pipeline(stages=2, microbatches=2)"


def test_tensor_groups_as_pipeline_stages_train_as_one_process(folder):
    """T × S = 2 × 2 (World.mesh(tensor=2, stages=2): ranks 0, 1 stage 0's tensor group,
    2, 3 stage 1's): each process runs its stage of its member's program on every
    micro-batch; the checkpoint is every process's pieces of its stage (its slices, member 0
    the whole tensors too) listed by rank 0's file, and loads as the whole program's state,
    equal to one process running the same pipeline program (its micro-batches in turn)."""
    cfg = config(folder, "staged.toml", model={"pipeline": STAGED}, data={"batch_size": 4})
    four = runs.launch(folder, cfg, folder / "staged", "--steps", str(STEPS), ranks=4)
    assert "tensor-parallel groups of 2 as the 2 stages of a pipeline" in four.stdout
    one = graphforge.train.run(cfg, steps=STEPS, out=folder / "staged-one", quiet=True)
    _assert_close(runs.checkpoint_path(folder / "staged", STEPS), one.checkpoint)
    names = sorted(p.name for p in (folder / "staged" / "checkpoints").glob("checkpoint-00000008*"))
    assert names == [
        "checkpoint-00000008.safetensors",
        *(f"checkpoint-00000008.stage{s}-of-2.tensor{t}-of-2.safetensors" for s in range(2) for t in range(2)),
    ]


def test_data_parallel_pipelines_of_tensor_groups_train_as_one_process_with_the_doubled_batch(folder):
    """T × S × D = 2 × 2 × 2 on 8 processes (ranks ordered data, pipeline, tensor): two
    replicas of the T × S pipeline, each taking every other sample of each micro-batch, each
    stage averaging its accumulated gradients with its replica's before its tensor group's
    update; the checkpoint is the first pipeline's pieces. Equal to one process running the
    pipeline program on the doubled batch; a process count that is no multiple of T × S is
    refused, naming the count it runs on."""
    cfg = config(folder, "staged-dp.toml", model={"pipeline": STAGED}, data={"batch_size": 4})
    eight = runs.launch(folder, cfg, folder / "staged-dp", "--steps", str(STEPS), ranks=8)
    assert "the 2 stages of a pipeline × 2 data-parallel replicas of it" in eight.stdout
    doubled = config(folder, "staged-dp-one.toml", model={"pipeline": STAGED}, data={"batch_size": 8})
    one = graphforge.train.run(doubled, steps=STEPS, out=folder / "staged-dp-one", quiet=True)
    got, want = (CheckpointState.load(p) for p in (runs.checkpoint_path(folder / "staged-dp", STEPS), one.checkpoint))
    assert got.step == want.step and sorted(got.tensors) == sorted(want.tensors)
    # (a replica's gradient accumulators hold its own samples' sums: the average is taken at the update)
    scratch = {
        c.input for c in ProgramRoles.read(folder / "staged-dp-one" / "program.onnx").carried_with_role("accumulator")
    }
    assert scratch
    for name, value in want.tensors.items():  # norm-wise: AdamW amplifies the averaging's rounding
        if name not in scratch:
            assert np.linalg.norm(got.tensors[name] - value) <= 1e-5 * max(np.linalg.norm(value), 1e-12), name
    loaded = load_config(cfg)
    program = graphforge.compile(
        loaded.model.path, with_tensor_parallel(parse_pipeline(STAGED), TensorParallel())
    ).model
    with pytest.raises(ConfigError, match=r"runs on a multiple of 4 processes .* but 6 were started"):
        _tensor_stages(loaded, ProgramRoles.of_proto(program).stages, SimpleNamespace(size=6, rank=0))
