"""Sharded data parallelism (ZeRO stages 1 and 2) against its oracle, plain data parallelism
on the same global batch: N real processes (gloo on loopback) end with every parameter and
optimizer state within 1e-6 relative of DataParallel's after 30 steps, for SGD with
momentum, AdamW and LAMB, with accumulation and global-norm clipping, on the digits MLP and
a small transformer, and AdamW in float16 with loss scaling (the same updates skipped, the
same scale, within 1e-5); each holds 1/N of the optimizer states. One launch per world size
runs every case (the DataParallel references among them)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from _batches import write_batches
from _launch import REPO, run_ranks

import graphforge
import graphforge.placement.buckets
from graphforge.distributed import DataParallel, ZeroDataParallel
from graphforge.program import ProgramRoles
from graphforge.runtime import Module, Optimizer

pytest.importorskip("torch")

STEPS = 30
PER_RANK = 4
SEQ = 8
LAUNCH_TIMEOUT_S = 240
#: ||zero - dp|| <= RELATIVE * ||dp|| per tensor: the update is the same arithmetic in torch's
#: kernels (over shards) that the ONNX update does (over tensors), in another rounding order
RELATIVE = 1e-6
#: the same for a float16 program: a weight one float32 rounding apart can round a float16
#: activation the other way (2^-11 of it), so the two runs drift apart faster (one process,
#: digits MLP, AdamW, 30 steps: the parameters 3.4e-6 apart in float16, 1.1e-7 in float32; on
#: 2 processes the first moments 2.1e-5). A wrong skip, scale or step count is 1e-2 or more.
RELATIVE_FLOAT16 = 1e-4
LOSS = {
    "digits": "loss(kind=cross_entropy, output=logits), autodiff",
    "gpt": "loss(kind=mse, output=logits), autodiff",
}
#: name: (model, optimizer, micro-batches per step, stage, bucket_mb); 4 ranks run the first ones
CASES = {
    "mlp-adamw-clip-2": ("digits", "adamw(lr=1e-2, weight_decay=0.01, clip_grad_norm=0.5)", 1, 2, 0.004),
    "mlp-sgd-accumulate-1": ("digits", "sgd(lr=0.05, momentum=0.9, accumulate=true)", 2, 1, 0.004),
    "gpt-lamb-clip-2": ("gpt", "lamb(lr=3e-3, weight_decay=0.01, clip_grad_norm=0.5)", 1, 2, 0.002),
    "mlp-lamb-accumulate-1": ("digits", "lamb(lr=1e-2, accumulate=true, clip_grad_norm=1.0)", 2, 1, 0.004),
    "gpt-adamw-accumulate-2": ("gpt", "adamw(lr=3e-3, accumulate=true)", 2, 2, 0.002),
    "gpt-sgd-clip-1": ("gpt", "sgd(lr=0.1, momentum=0.9, nesterov=true, clip_grad_norm=0.5)", 1, 1, 1000),
    # float16 with loss scaling, from a scale so large that the first steps overflow and are
    # skipped (the scale backs off), and grown again every 4 finite steps
    "mlp-adamw-float16-1": (
        "digits",
        f"adamw(lr=1e-2, clip_grad_norm=1.0), mixed_precision(dtype=float16, provider=cpu, init_scale={2.0**24}, "
        "growth_interval=4)",
        1,
        1,
        0.004,
    ),
}
SCALED = [name for name, case in CASES.items() if "mixed_precision" in case[1]]
ON_FOUR = ["mlp-adamw-clip-2", "mlp-sgd-accumulate-1", "gpt-lamb-clip-2"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, transformer_path) -> Path:
    folder = tmp_path_factory.mktemp("zero")
    forward = {"digits": REPO / "examples" / "digits" / "model.onnx", "gpt": transformer_path}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (model, optimizer, _, stage, bucket_mb) in CASES.items():
            base = f"{LOSS[model]}, {optimizer}"
            zero = graphforge.compile(str(forward[model]), f"{base}, zero(stage={stage}, bucket_mb={bucket_mb})")
            graphforge.save(zero.model, folder / f"{name}.onnx")
            # the CPU computes float16 between casts within a segment and rounds what crosses a
            # cut to float16: a scaled program is cut alike on both sides, or overflows apart
            dp_mb = bucket_mb if name in SCALED else 1000
            dp = graphforge.compile(str(forward[model]), f"{base}, allreduce(bucket_mb={dp_mb})")
            graphforge.save(dp.model, folder / f"{name}-dp.onnx")
    write_batches(folder, STEPS, 4 * PER_RANK, seq=SEQ, seed=1)
    return folder


def _launch(folder: Path, ranks: int, names: list[str]) -> None:
    cases = []
    for name in names:
        model, _, accumulate, stage, _ = CASES[name]
        batches = folder / f"{model}-{accumulate}-{ranks}.npz"
        arrays = np.load(folder / f"{model}-{accumulate}.npz")
        np.savez(batches, **{k: v[:, : ranks * PER_RANK] for k, v in arrays.items()})
        common = {"batches": str(batches), "steps": STEPS, "accumulate": accumulate}
        cases.append(
            {**common, "program": str(folder / f"{name}.onnx"), "zero": stage, "out": f"{folder}/{name}-{ranks}"}
        )
        cases.append({**common, "program": str(folder / f"{name}-dp.onnx"), "out": f"{folder}/{name}-dp-{ranks}"})
    spec = folder / f"spec-{ranks}.json"
    spec.write_text(json.dumps({"cases": cases, "timeout_s": 60}))
    finished = run_ranks(ranks, [str(Path(__file__).parent / "_worker.py"), str(spec)], timeout=LAUNCH_TIMEOUT_S)
    for f in finished:
        assert f.returncode == 0, f"rank {f.rank} exited with {f.returncode}:\n{f.output[-4000:]}"


@pytest.fixture(scope="module")
def two_ranks(workspace) -> Path:
    _launch(workspace, 2, list(CASES))
    return workspace


@pytest.fixture(scope="module")
def four_ranks(workspace) -> Path:
    _launch(workspace, 4, ON_FOUR)
    return workspace


def _ranks(folder: Path, name: str, ranks: int) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(folder / f"{name}-{ranks}-rank{r}.npz")) for r in range(ranks)]


def _tracked(name: str, value: np.ndarray) -> np.ndarray:
    """What of a tensor follows its gradient: all of it but the attention's key bias (the
    middle third of c_attn's bias) and its optimizer states. Adding one vector to every key adds
    q·b to all of a row's scores, which softmax takes away: its gradient is zero but for
    rounding, which Adam and LAMB normalise into full-size steps of any sign (here it moved
    5.7e-6 of the bias's norm apart, every other tensor within 1e-6)."""
    if "attn.c_attn.bias" not in name:
        return value
    third = value.shape[0] // 3
    return np.concatenate([value[:third], value[2 * third :]])


def _optimizer_bytes(folder: Path, name: str) -> int:
    roles = ProgramRoles.of_proto(graphforge.load(folder / f"{name}-dp.onnx"))
    scaling = set(roles.loss_scale_states)  # the loss scale's scalars: every process holds them
    return sum(
        int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize
        for c in roles.carried_with_role("optimizer")
        if c.input not in scaling
    )


@pytest.mark.parametrize(("name", "ranks"), [(n, 2) for n in CASES] + [(n, 4) for n in ON_FOUR], ids=lambda v: str(v))
def test_zero_equals_data_parallelism_on_the_same_global_batch(name, ranks, request):
    folder = request.getfixturevalue("two_ranks" if ranks == 2 else "four_ranks")
    zero, dp = _ranks(folder, name, ranks), _ranks(folder, f"{name}-dp", ranks)
    accumulators = {
        c.input
        for c in ProgramRoles.of_proto(graphforge.load(folder / f"{name}.onnx")).carried_with_role("accumulator")
    }
    reference = {k: v for k, v in dp[0].items() if not k.startswith("__") and k not in accumulators}
    relative = RELATIVE_FLOAT16 if name in SCALED else RELATIVE
    np.testing.assert_allclose(zero[0]["__losses__"], dp[0]["__losses__"], rtol=relative)
    for rank, replica in enumerate(zero):
        for tensor, want in reference.items():  # the parameters, and the optimizer states gathered
            got, want = _tracked(tensor, replica[tensor].astype(np.float64)), _tracked(tensor, want)
            error = float(np.linalg.norm(got - want))
            assert error <= relative * float(np.linalg.norm(want)), f"rank {rank}: {tensor} off by {error:.3g}"
            assert np.array_equal(replica[tensor], zero[0][tensor]), f"rank {rank}'s {tensor} differs from rank 0's"
    initial = graphforge.CheckpointState.from_program(folder / f"{name}.onnx").tensors
    assert sum(not np.array_equal(initial[t], reference[t]) for t in reference) > len(reference) // 2  # it trained
    if name in SCALED:  # the same updates skipped, the same scale (compared above): some were
        assert int(reference["loss_scale.skipped"]) > 0 and float(reference["loss_scale"]) != 2.0**24
    # each process holds 1/N of the optimizer states, give or take each bucket's padding
    states, buckets = (
        _optimizer_bytes(folder, name),
        len(ProgramRoles.of_proto(graphforge.load(folder / f"{name}.onnx")).allreduce.buckets),
    )
    for replica in zero:
        held = int(replica["__state_bytes__"])
        assert states / ranks <= held <= states / ranks + buckets * 2 * 4 * ranks, (held, states)


# --------------------------------------------------------------------------- one process: the pass and the API


def _mlp_program(tail: str) -> onnx.ModelProto:
    return graphforge.compile(models.tanh_mlp(), f"loss(kind=mse, output=y), autodiff, {tail}").model


def test_the_zero_pass_marks_the_collectives_and_the_program_runs_as_before_on_one_process():
    plain = _mlp_program("adamw(lr=0.05, clip_grad_norm=0.5)")
    zero = graphforge.compile(plain, "zero(stage=2, bucket_mb=0.0001)").model
    roles = ProgramRoles.of_proto(zero)
    assert roles.allreduce.zero == 2 and len(roles.allreduce.buckets) == 4
    ops = [(n.domain, n.op_type) for n in zero.graph.node if n.domain == "graphforge"]
    assert ops.count(("graphforge", "ReduceScatter")) == 4 and ops.count(("graphforge", "AllGather")) == 4
    assert {f.name for f in zero.functions} == {"ReduceScatter", "AllGather"}
    a, b = Module(plain, device="cpu", update="onnx"), Module(zero, device="cpu", update="onnx")
    for batch in models.tanh_mlp_batches(4):
        assert float(a.train_step(**batch)) == float(b.train_step(**batch))
    for name, value in a.runner.read_tensors().items():
        assert np.array_equal(b.runner.read_tensors([name])[name], value), name
    pruned = graphforge.compile(zero, "prune(outputs=y)").model
    assert not [n for n in pruned.graph.node if n.domain == "graphforge"] and not pruned.functions


@pytest.mark.parametrize("tail", ["adamw(lr=0.05, clip_grad_norm=0.5)", "sgd(lr=0.05, momentum=0.9, accumulate=true)"])
def test_one_replica_of_zero_equals_the_plain_module(world_of_one, tail):
    """World size 1 takes the whole path (cut, reduce-scatter, shard update, gather): the same
    training as the program's own update, within 1e-6."""
    program = graphforge.compile(_mlp_program(tail), "zero(stage=2, bucket_mb=0.0001)").model
    plain, replica = Module(program, device="cpu"), Module(program, device="cpu", shard_optimizer_states=True)
    zero = ZeroDataParallel(replica, world_of_one)
    assert not [c for c in replica.runner.carried.values() if c.spec.role == "optimizer"]
    optimizers = [Optimizer(plain), Optimizer(replica)]
    for batch in models.tanh_mlp_batches(8):
        if plain.accumulates:
            for m in (plain, replica):
                m(**batch)
            for o in optimizers:
                o.step()
        else:
            np.testing.assert_allclose(float(replica.train_step(**batch)), float(plain.train_step(**batch)), rtol=1e-6)
        np.testing.assert_allclose(replica.last_grad_norm, plain.last_grad_norm, rtol=1e-5)
    want = plain.runner.read_tensors()
    got = {**replica.runner.read_tensors(), **zero.gathered_states()}
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    owned = zero.layout()[0]
    assert sum(stop - start for _, _, start, stop in owned) == sum(
        v.size for n, v in want.items() if n in plain.roles.parameters
    )


def test_a_step_whose_loss_is_not_finite_is_skipped_and_undone(world_of_one):
    program = graphforge.compile(_mlp_program("adamw(lr=0.05)"), "zero(stage=1)").model
    module = Module(program, device="cpu", shard_optimizer_states=True)
    zero = ZeroDataParallel(module, world_of_one)
    batches = models.tanh_mlp_batches(2)
    module.train_step(**batches[0])
    before, states = module.runner.read_tensors(), zero.gathered_states()
    poisoned = {k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in batches[1].items()}
    assert not np.isfinite(float(module.train_step(**poisoned)))
    assert module.last_update_skipped and module.state.step == 1
    module.undo_last_run()
    for name, value in before.items():
        assert np.array_equal(module.runner.read_tensors([name])[name], value), name
    for name, value in zero.gathered_states().items():
        assert np.array_equal(value, states[name]), name


def test_the_wrong_wrapper_and_unsupported_programs_are_refused(world_of_one):
    zero = graphforge.compile(_mlp_program("sgd(lr=0.1)"), "zero(stage=1)").model
    with pytest.raises(graphforge.GraphforgeError, match=r"run it with graphforge\.distributed\.ZeroDataParallel"):
        DataParallel(Module(zero, device="cpu"), world_of_one)
    allreduce = graphforge.compile(_mlp_program("sgd(lr=0.1)"), "allreduce").model
    with pytest.raises(graphforge.GraphforgeError, match="compile it with the zero pass"):
        ZeroDataParallel(Module(allreduce, device="cpu"), world_of_one)
    with pytest.raises(graphforge.PipelineSpecError, match=r"stage.*expected 1 \| 2"):
        graphforge.compile(_mlp_program("sgd(lr=0.1)"), "zero(stage=3)")


def test_inspect_says_which_elements_each_process_owns(tmp_path):
    program = graphforge.compile(_mlp_program("adamw(lr=0.05)"), "zero(stage=1, bucket_mb=0.0001)").model
    path = graphforge.save(program, tmp_path / "program.onnx")
    run = [sys.executable, "-m", "graphforge", "inspect", str(path), "--processes", "3"]
    done = subprocess.run(run, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "zero stage 1: shards on 3 processes (4 buckets)" in done.stdout
    roles = ProgramRoles.of_proto(program)
    sizes = {p: int(np.prod(roles.carried_spec(p).shape)) for b in roles.allreduce.buckets for p in b}
    owned = graphforge.placement.buckets.shard_layout(roles.allreduce.buckets, sizes, 3)
    for name, size in sizes.items():  # every element owned once, and the processes' shares within a bucket of equal
        pieces = sorted((start, stop) for rank in owned for _, p, start, stop in rank if p == name)
        assert pieces[0][0] == 0 and pieces[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    plain = graphforge.save(_mlp_program("sgd(lr=0.1)"), tmp_path / "plain.onnx")
    refused = subprocess.run([*run[:4], str(plain), "--processes", "2"], capture_output=True, text=True)
    assert refused.returncode != 0 and "--processes needs a program compiled with the zero pass" in refused.stderr
