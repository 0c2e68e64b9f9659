"""Gradient accumulation against big batches, and onnxruntime profiling of chosen steps."""

from __future__ import annotations

import itertools
import json

import _train_helpers as th
import numpy as np
import pytest

import graphforge.train
from graphforge import CheckpointState
from graphforge.train.logs import read_jsonl


def _parameters(result) -> dict[str, np.ndarray]:
    state = CheckpointState.load(result.checkpoint)
    kept = {s.name for s in state.specs if s.role == "parameter"}
    return {name: value for name, value in state.tensors.items() if name in kept}


def test_four_micro_batches_of_two_equal_batches_of_eight(tmp_path):
    """Accumulation sums the micro-batch gradients (as torch's repeated backward() does): with
    SGD at lr/4 an accumulated step equals a big-batch step. The shuffled order depends only on
    the seed and the sample count, so batches of 8 are 4 micro-batches of 2 in the same order."""
    folder = th.workspace(tmp_path)
    big = th.base_config(
        model={"pipeline": "loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.2, momentum=0.9)"},
        data={"batch_size": 8, "eval": None},
        train={"steps": 9},
    )
    small = th.base_config(
        model={
            "pipeline": "loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.05, momentum=0.9, accumulate=true)"
        },
        data={"batch_size": 2, "eval": None},
        train={"steps": 9, "accumulate": 4},
    )
    a = graphforge.train.run(th.write_config(folder, big, "big.toml"), out=folder / "big", quiet=True)
    b = graphforge.train.run(th.write_config(folder, small, "small.toml"), out=folder / "small", quiet=True)
    big_parameters, accumulated = _parameters(a), _parameters(b)
    assert sorted(big_parameters) == sorted(accumulated) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    for name, value in big_parameters.items():
        np.testing.assert_allclose(accumulated[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    big_log, small_log = read_jsonl(a.log), read_jsonl(b.log)
    assert [r["step"] for r in small_log] == [r["step"] for r in big_log]
    for x, y in zip(big_log, small_log, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)  # the mean of 4 equal-sized micro-batch means
        assert y["samples"] == x["samples"]


def test_profile_traces_exactly_the_chosen_steps_and_leaves_training_alone(tmp_path):
    folder = th.workspace(tmp_path)
    plain = th.base_config(train={"steps": 6, "update": "onnx"}, data={"eval": None})  # a profile's update
    profiled = {**plain, "profile": {"start": 3, "steps": 2}}
    a = graphforge.train.run(th.write_config(folder, plain, "plain.toml"), out=folder / "plain", quiet=True)
    b = graphforge.train.run(th.write_config(folder, profiled, "profiled.toml"), out=folder / "profiled", quiet=True)
    assert a.profile is None and b.profile == folder / "profiled/profile/steps-3-4.json"
    assert sorted(p.name for p in b.profile.parent.iterdir()) == ["steps-3-4.json"]
    trace = json.loads(b.profile.read_text())
    runs = [e for e in trace if e.get("cat") == "Session" and e["name"] == "model_run"]
    assert len(runs) == 2 * 2  # each step: the forward/backward segment, then the update (in place)
    kernels = {e["args"]["op_name"] for e in trace if e.get("cat") == "Node" and "op_name" in e.get("args", {})}
    assert "Softmax" in kernels or "LogSoftmax" in kernels  # the loss
    assert any("Gemm" in kernel for kernel in kernels)  # the forward (onnxruntime may fuse Gemm + Tanh)
    for name, value in _parameters(a).items():
        assert np.array_equal(value, _parameters(b)[name]), name


def test_profile_with_accumulation_traces_the_runs_that_train(tmp_path):
    """Two micro-batches and the update per step: three runs a step, one clock, training untouched."""
    folder = th.workspace(tmp_path)
    pipeline = th.PIPELINE.replace("adamw(lr=0.05)", "adamw(lr=0.05, accumulate=true)")
    plain = th.base_config(
        model={"pipeline": pipeline}, train={"steps": 5, "accumulate": 2, "update": "onnx"}, data={"eval": None}
    )
    profiled = {**plain, "profile": {"start": 2, "steps": 2}}
    a = graphforge.train.run(th.write_config(folder, plain, "plain.toml"), out=folder / "plain", quiet=True)
    b = graphforge.train.run(th.write_config(folder, profiled, "profiled.toml"), out=folder / "profiled", quiet=True)
    assert sorted(p.name for p in b.profile.parent.iterdir()) == ["steps-2-3.json"]
    trace = json.loads(b.profile.read_text())
    runs = sorted((e["ts"], e["dur"]) for e in trace if e.get("cat") == "Session" and e["name"] == "model_run")
    assert len(runs) == 2 * (2 + 1)
    for (start, duration), (next_start, _) in itertools.pairwise(runs):
        assert start + duration <= next_start + 1  # one after another on the merged clock
    for name, value in _parameters(a).items():
        assert np.array_equal(value, _parameters(b)[name]), name


def test_profile_summary_splits_kernel_time_by_part_and_op(tmp_path):
    """The summary of a profiled run: every graphforge part shows, and the parts and the op
    types account for the same kernel time, the first run of each session left out."""
    from graphforge.train.profiling import part_of, summarize_traces

    folder = th.workspace(tmp_path)
    config = {**th.base_config(train={"steps": 5}, data={"eval": None}), "profile": {"start": 2, "steps": 3}}
    result = graphforge.train.run(th.write_config(folder, config, "profiled.toml"), out=folder / "out", quiet=True)
    summary = summarize_traces([result.profile])
    assert set(summary.by_part) == {"forward", "loss", "backward", "optimizer"}
    # three steps of two segments each (forward/backward, then the update in place) in the
    # merged trace, its first run left out
    assert summary.runs == 3 * 2 - 1
    assert sum(summary.by_op.values()) == summary.total > 0
    everything = summarize_traces([result.profile], skip_first_run=False)
    assert everything.runs == 3 * 2 and everything.total > summary.total
    assert part_of("fused grad::/fc/Gemm") == "backward" and part_of("fused /fc/Gemm") == "forward"
    assert part_of("optim::w/Mul_3") == "optimizer" and part_of("loss::cross_entropy/LogSoftmax") == "loss"
    assert summary.line(top=2).startswith(tuple(f"{p} " for p in summary.by_part))
