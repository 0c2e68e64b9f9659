"""Mixed precision with data parallelism, on 2 real processes (gloo on loopback): the replicas
stay bit-identical (each unscales and checks the reduced gradients, so they skip the same
steps and keep one scale), an overflowing first step is skipped on both, and the result
equals one process training on the doubled batch within float16's precision, whichever of
allreduce and mixed_precision comes first in the pipeline. The 1-layer GPT-2 of
tests/models.py: its backward keeps float16 tensors between its float16 nodes on the CPU too
(reshapes), where an overflow shows."""

from __future__ import annotations

import json
from pathlib import Path

import models
import numpy as np
import pytest
from _launch import run_ranks

import graphforge
from graphforge.runtime import CheckpointState, Module

pytest.importorskip("torch")

STEPS = 20
PER_RANK = 4
SEQ = 8
LAUNCH_TIMEOUT_S = 180
#: the first step's scale, 2^60, overflows float16; backing off by 2^-44 gives 2^16
AMP = f"mixed_precision(dtype=float16, provider=cpu, init_scale={2.0**60}, backoff_factor={2.0**-44})"
BASE = "loss(kind=mse, output=logits), autodiff, adamw(lr=3e-3)"
ORDERS = {
    "allreduce-first": f"{BASE}, allreduce(bucket_mb=1000), {AMP}",
    "mixed-precision-first": f"{BASE}, {AMP}, allreduce(bucket_mb=1000)",
}
#: the data-parallel parameters' distance from one process's, against how far training moved
#: them: float16 GEMMs over 8 rows then a sum round differently from GEMMs over 16 rows
RELATIVE_TO_MOVEMENT = 2e-2


@pytest.fixture(scope="module")
def finished(tmp_path_factory, transformer_path) -> Path:
    folder = tmp_path_factory.mktemp("dp-amp")
    vocab = models.GPT2_CONFIG["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, (STEPS, 2 * PER_RANK, SEQ))
    np.savez(folder / "batches.npz", input_ids=ids, labels=np.eye(vocab, dtype=np.float32)[ids] * 4.0)
    cases = []
    for name, pipeline in ORDERS.items():
        program = graphforge.compile(str(transformer_path), pipeline).model
        graphforge.save(program, folder / f"{name}.onnx")
        cases.append(
            {
                "program": str(folder / f"{name}.onnx"),
                "batches": str(folder / "batches.npz"),
                "steps": STEPS,
                "out": str(folder / name),
            }
        )
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"cases": cases, "timeout_s": 60}))
    done = run_ranks(2, [str(Path(__file__).parent / "_worker.py"), str(spec)], timeout=LAUNCH_TIMEOUT_S)
    for f in done:
        assert f.returncode == 0, f"rank {f.rank} exited with {f.returncode}:\n{f.output[-4000:]}"
    return folder


@pytest.mark.parametrize("order", list(ORDERS))
def test_two_ranks_skip_together_and_equal_one_rank_of_the_doubled_batch(order, finished):
    ranks = [dict(np.load(finished / f"{order}-rank{r}.npz")) for r in range(2)]
    for name, value in ranks[0].items():
        assert np.array_equal(value, ranks[1][name]), f"rank 1's {name} differs from rank 0's"
    state = ranks[0]
    assert int(state["loss_scale.skipped"]) == 1 and float(state["loss_scale"]) == 2.0**16
    assert float(state["__losses__"][-1]) < 0.8 * float(state["__losses__"][0])  # it trained

    program = str(finished / f"{order}.onnx")
    batches = np.load(finished / "batches.npz")
    single = Module(program, device="cpu")
    for step in range(STEPS):
        single.train_step(**{n: batches[n][step] for n in batches.files})
    want = single.runner.read_tensors()
    assert int(want["loss_scale.skipped"]) == 1
    initial = CheckpointState.from_program(program).tensors
    for name in graphforge.ProgramRoles.of_proto(graphforge.load(program)).parameters:
        start, ours, theirs = (models.without_key_bias(name, t[name]) for t in (initial, state, want))
        moved, error = np.linalg.norm(theirs - start), np.linalg.norm(ours - theirs)
        assert moved > 0 and error <= RELATIVE_TO_MOVEMENT * moved, f"{name}: {error / moved:.3g} of its movement"
