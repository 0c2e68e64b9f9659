"""The distributed paths on ``GRAPHFORGE_TEST_DEVICE`` (the CPU here and in CI; ``cuda`` in
``make cuda-check``), each against one process's Module on the same device:

1. data parallelism at world size 1 under a real torchrun (gloo on the CPU, NCCL on CUDA):
   the all-reduce path (cut at the buckets, the buckets shared with torch through DLPack) on
   one replica equals the plain Module;
2. a 2-stage pipeline whose stages run in one process, as two threads exchanging their
   messages through queues: every stage's segments on the device, and the result equal to
   one process running the micro-batches in turn."""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

pytest.importorskip("torch")

import _launch

import graphforge as gf
from graphforge.distributed.stages import Stage
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointState, Module, Optimizer

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")
DEVICE = os.environ.get("GRAPHFORGE_TEST_DEVICE", "cpu")
DIGITS = REPO / "examples" / "digits" / "model.onnx"
STEPS = 12
#: float32 sums in another order (a reduction over one replica, a cut program); the digits MLP
#: agrees to a few ulps over these steps, on either device
RTOL, ATOL = 1e-5, 1e-6


def _batches(rng, count: int, batch: int = 16) -> dict[str, np.ndarray]:
    return {
        "images": rng.integers(0, 17, (count, batch, 8, 8)).astype(np.uint8),
        "labels": rng.integers(0, 10, (count, batch)),
    }


def test_data_parallel_at_world_size_one_equals_the_module(tmp_path):
    """Both as the runner runs by default on the device and in its capture-ready mode (each
    segment of the cut step specialized to the batch's dims, against fixed buffers; on CUDA
    captured), whose sessions must all have run so."""
    program = gf.compile(DIGITS, "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2), allreduce")
    gf.save(program.model, tmp_path / "program.onnx")
    batches = _batches(np.random.default_rng(0), STEPS)
    np.savez(tmp_path / "batches.npz", **batches)
    common = {"program": str(tmp_path / "program.onnx"), "batches": str(tmp_path / "batches.npz"), "steps": STEPS,
              "report_static": True}  # fmt: skip
    spec = {"device": DEVICE, "cases": [{**common, "out": str(tmp_path / "dp")},
                                        {**common, "out": str(tmp_path / "ready"), "capture": True}]}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = _launch.torchrun(
        ["--standalone", "--nproc-per-node=1", str(WORKER), str(tmp_path / "spec.json")], timeout=240
    )
    assert done.returncode == 0, done.stdout

    module = Module(tmp_path / "program.onnx", device=DEVICE)
    losses = [float(module.train_step(**{n: batches[n][step] for n in batches})) for step in range(STEPS)]
    for out in ("dp", "ready"):
        got = np.load(tmp_path / f"{out}-rank0.npz")
        np.testing.assert_allclose(got["__losses__"], losses, rtol=RTOL, atol=ATOL)
        assert set(got.files) == {"__losses__", "__static_sessions__", *module.runner.carried}
        for name, value in module.runner.read_tensors().items():
            np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=f"{out}: {name}")
    assert int(np.load(tmp_path / "ready-rank0.npz")["__static_sessions__"]) >= 2  # the cut step's segments
    if DEVICE == "cpu":  # (on CUDA the Module's default is the capture-ready mode)
        assert int(np.load(tmp_path / "dp-rank0.npz")["__static_sessions__"]) == 0


class _Queues:
    """The stages of one pipeline as threads of this process: a queue per direction between
    neighbours, and a barrier for the two collectives of a step. What is sent is copied to
    the host and back onto the device, as a transfer between two processes would copy it."""

    def __init__(self, stages: int, device: str):
        self.stages, self.device = stages, device
        self.lanes = {(a, b): queue.Queue() for a in range(stages) for b in range(stages) if abs(a - b) == 1}
        self.barrier = threading.Barrier(stages, timeout=120)
        self.slots: list = [None] * stages

    def member(self, stage: int) -> _Member:
        return _Member(self, stage)


class _Member:
    """One stage's end of ``_Queues``: the graphforge.distributed.stages.Transport protocol."""

    def __init__(self, queues: _Queues, stage: int):
        self.queues, self.stage, self.stages = queues, stage, queues.stages

    def send(self, peer: int, values: Sequence[ort.OrtValue], what: str) -> None:
        self.queues.lanes[(self.stage, peer)].put([np.array(v.numpy(), copy=True) for v in values])

    def receive(self, peer: int, dtypes: Sequence[np.dtype], what: str) -> list[ort.OrtValue]:
        arrays = self.queues.lanes[(peer, self.stage)].get(timeout=120)
        assert [a.dtype for a in arrays] == [np.dtype(d) for d in dtypes], what
        return [ort.OrtValue.ortvalue_from_numpy(a, self.queues.device, 0) for a in arrays]

    def _exchange(self, value) -> list:
        self.queues.slots[self.stage] = value
        self.queues.barrier.wait()
        every = list(self.queues.slots)
        self.queues.barrier.wait()  # all have read before the next exchange writes
        return every

    def gather(self, value: float, what: str) -> list[float]:
        return [float(np.float32(v)) for v in self._exchange(value)]

    def broadcast(self, values: Sequence[float], source: int, what: str) -> list[float]:
        return [float(v) for v in self._exchange(list(values))[source]]

    def flush(self) -> None:
        pass


def test_two_stages_in_one_process_equal_the_microbatches_in_turn(tmp_path):
    pipeline = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, clip_grad_norm=0.5, accumulate=true)"
    program = gf.compile(DIGITS, f"{pipeline}, pipeline(stages=2, microbatches=3)").model
    gf.save(program, tmp_path / "program.onnx")
    micro = ProgramRoles.read(program).stages.microbatches
    batches = _batches(np.random.default_rng(1), STEPS * micro, batch=8)
    step_batches = [[{n: batches[n][step * micro + i] for n in batches} for i in range(micro)] for step in range(STEPS)]

    queues = _Queues(2, DEVICE)
    results: dict[int, tuple[list[float], dict]] = {}
    failures: list[BaseException] = []

    def run_stage(s: int) -> None:
        try:
            stage = Stage(tmp_path / "program.onnx", CheckpointState.from_program(program), queues.member(s),
                                  device=DEVICE)  # fmt: skip
            assert stage.runner.device.type == DEVICE
            losses = [stage.train_step(b).loss for b in step_batches]
            results[s] = (losses, stage.tensors())
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)
            queues.barrier.abort()

    threads = [threading.Thread(target=run_stage, args=(s,), daemon=True) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures, failures
    assert set(results) == {0, 1}

    module = Module(tmp_path / "program.onnx", device=DEVICE)
    optimizer = Optimizer(module)
    losses = []
    for step in step_batches:
        losses.append(sum(float(module(**feeds)) for feeds in step) / micro)
        optimizer.step()
        module.lazy_reset_grad()
    state = module.runner.read_tensors()
    held = {}
    for s, (stage_losses, tensors) in results.items():
        np.testing.assert_allclose(stage_losses, losses, rtol=RTOL, atol=ATOL, err_msg=f"stage {s}")
        assert not set(held) & set(tensors), "a tensor held by two stages"
        held.update(tensors)
    assert set(held) == set(state)
    for name, value in state.items():
        np.testing.assert_allclose(held[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
