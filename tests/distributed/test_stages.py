"""Pipeline parallelism with real processes (gloo on loopback): S stage processes following
GPipe or 1F1B give the losses and parameters of one process running the same program on
the same micro-batches one after another (module(...) per micro-batch, then the update)."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import _launch
import models

import graphforge as gf
from graphforge.program import ProgramRoles
from graphforge.runtime import Module, Optimizer

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")
STEPS = 20
#: the tolerance the issue states (the digits runs agree bit for bit)
RTOL = 1e-5

DIGITS = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, clip_grad_norm=0.5, accumulate=true)"
#: SGD on the transformer: its key bias has a zero gradient in exact arithmetic, and AdamW turns
#: the rounding noise there into full-size steps, so two segmentations that round differently
#: drift apart on that one tensor (2e-5 after 20 steps) while everything else agrees to 1e-8
GPT = "loss(kind=mse, output=logits), autodiff, sgd(lr=0.05, momentum=0.9, clip_grad_norm=0.5, accumulate=true)"
CASES = {
    # name: (model, pipeline, stages, microbatches, schedule)
    "digits-2-1f1b": ("digits", DIGITS, 2, 4, "1f1b"),
    "digits-2-gpipe": ("digits", DIGITS, 2, 3, "gpipe"),
    "digits-4-1f1b": ("digits", DIGITS, 4, 4, "1f1b"),
    "gpt-2-1f1b": ("gpt", GPT, 2, 4, "1f1b"),
    "gpt-4-1f1b": ("gpt", GPT, 4, 4, "1f1b"),
    "gpt-4-gpipe": ("gpt", GPT, 4, 2, "gpipe"),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("pipeline")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = models.export_transformer(root / "gpt2x2.onnx", n_layer=2, tie_word_embeddings=False)
    forward = {"digits": REPO / "examples" / "digits" / "model.onnx", "gpt": gpt}
    rng = np.random.default_rng(0)
    for name, (model, pipeline, stages, micro, schedule) in CASES.items():
        text = f'{pipeline}, pipeline(stages={stages}, microbatches={micro}, schedule="{schedule}")'
        gf.save(gf.compile(forward[model], text).model, root / f"{name}.onnx")
        count = STEPS * micro
        if model == "digits":
            batches = {"images": rng.integers(0, 17, (count, 8, 8, 8)).astype(np.uint8)}
            batches["labels"] = rng.integers(0, 10, (count, 8))
        else:
            batches = {"input_ids": rng.integers(0, 64, (count, 2, 8))}
            batches["labels"] = rng.standard_normal((count, 2, 8, 64)).astype(np.float32)
        np.savez(root / f"{name}-batches.npz", **batches)
    return root


def _reference(program: Path, batches: Path) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process, the micro-batches one after another: the oracle."""
    module = Module(program, device="cpu")
    optimizer = Optimizer(module)
    micro = ProgramRoles.read(program).stages.microbatches
    data = np.load(batches)
    losses = []
    for step in range(STEPS):
        step_losses = [float(module(**{n: data[n][step * micro + i] for n in data.files})) for i in range(micro)]
        optimizer.step()
        module.lazy_reset_grad()
        losses.append(sum(step_losses) / micro)
    return losses, module.runner.read_tensors()


def _run(
    workspace: Path, names: list[str], *, timeout: float = 240, replicas: int = 1, **extra
) -> list[_launch.Finished]:
    stages = {CASES[n][2] for n in names}
    assert len(stages) == 1
    count = stages.pop()
    cases = [
        {
            "pipeline": True,
            "stages": count,
            "program": str(workspace / f"{n}.onnx"),
            "batches": str(workspace / f"{n}-batches.npz"),
            "steps": STEPS,
            "out": str(workspace / (n if replicas == 1 else f"{n}-dp{replicas}")),
            **extra,
        }
        for n in names
    ]
    spec = workspace / f"spec-{'-'.join(names)}-{replicas}.json"
    spec.write_text(json.dumps({"cases": cases, "timeout_s": extra.pop("timeout_s", 60)}))
    return _launch.run_ranks(count * replicas, [str(WORKER), str(spec)], timeout=timeout)


def _close(ours: np.ndarray, theirs: np.ndarray) -> bool:
    scale = max(float(np.max(np.abs(theirs))), 1e-12)
    return float(np.max(np.abs(ours - theirs))) <= RTOL * scale


@pytest.mark.parametrize(
    "group", [["digits-2-1f1b", "digits-2-gpipe", "gpt-2-1f1b"], ["digits-4-1f1b", "gpt-4-1f1b", "gpt-4-gpipe"]]
)
def test_stages_equal_one_process_running_the_microbatches_in_turn(workspace, group):
    finished = _run(workspace, group)
    for f in finished:
        assert f.returncode == 0, f.output
    for name in group:
        stages = CASES[name][2]
        losses, state = _reference(workspace / f"{name}.onnx", workspace / f"{name}-batches.npz")
        seen: set[str] = set()
        for rank in range(stages):
            got = np.load(workspace / f"{name}-rank{rank}.npz")
            np.testing.assert_allclose(got["__losses__"], losses, rtol=RTOL)  # every stage reports the loss
            for key in got.files:
                if key == "__losses__":
                    continue
                assert key not in seen, f"{key} is held by two stages"
                seen.add(key)
                assert _close(got[key], state[key]), f"{name}: {key} on stage {rank}"
        assert seen == set(state), f"{name}: stages hold {sorted(seen)}, the program carries {sorted(state)}"
        gathered = np.load(workspace / f"{name}-gathered.npz")
        assert set(gathered.files) == set(state)
        for key in state:
            assert _close(gathered[key], state[key]), key


def test_a_dead_stage_ends_the_run_with_an_error_not_a_hang(workspace):
    started = time.monotonic()
    finished = _run(workspace, ["gpt-2-1f1b"], die_at_step=2, timeout_s=8, timeout=120)
    took = time.monotonic() - started
    by_rank = {f.rank: f for f in finished}
    assert by_rank[1].returncode == 17
    assert by_rank[0].returncode != 0
    assert "stage 1" in by_rank[0].output and "rank 0" in by_rank[0].output, by_rank[0].output
    assert took < 90


@pytest.mark.parametrize("name", ["gpt-2-1f1b", "digits-2-gpipe"])
def test_two_data_parallel_pipelines_equal_one_process_with_the_doubled_microbatches(workspace, name):
    """2 × 2 on 4 processes: two pipelines of two stages, each taking every other row of each
    micro-batch, their accumulated gradients averaged per stage: one process running the whole
    micro-batches in turn computes the same."""
    finished = _run(workspace, [name], replicas=2)
    for f in finished:
        assert f.returncode == 0, f.output
    losses, state = _reference(workspace / f"{name}.onnx", workspace / f"{name}-batches.npz")
    # each replica's accumulators hold its own sums (the averaging is applied at the update)
    scratch = {c.input for c in ProgramRoles.read(workspace / f"{name}.onnx").carried_with_role("accumulator")}
    for rank in range(4):
        got = np.load(workspace / f"{name}-dp2-rank{rank}.npz")
        np.testing.assert_allclose(got["__losses__"], losses, rtol=RTOL)
        for key in got.files:
            if key != "__losses__" and key not in scratch:
                # norm-wise: averaging over replicas sums in another order, and AdamW divides by
                # the square root of tiny second moments (data_parallel's tests measure the same)
                error = np.linalg.norm(got[key] - state[key]) / max(np.linalg.norm(state[key]), 1e-12)
                assert error <= RTOL, f"{name}: {key} on rank {rank}: {error:.2e}"
