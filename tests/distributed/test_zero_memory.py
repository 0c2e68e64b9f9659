"""What ZeRO is for, measured: on GPT-2 2×256 (vocabulary 50,257: 14.5 M parameters, 116 MiB of
AdamW moments) with 2 processes, each process's optimizer state, read from the buffers that
hold it, is at most half of plain data parallelism's, and its peak resident memory falls by
at least a third of the moments' size. Each run is its own processes (a peak is per process)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import models
import numpy as np
import pytest
from _launch import run_ranks

import graphforge

pytest.importorskip("torch")
pytest.importorskip("transformers")
if not Path("/proc/self/status").is_file():
    pytest.skip("the peak memory is read as VmHWM from /proc (Linux)", allow_module_level=True)

GPT2 = {"n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 50257, "n_positions": 64}
PIPELINE = "loss(kind=mse, output=logits), autodiff, adamw(lr=1e-3)"  # logits [batch, seq, vocab]
STEPS, PER_RANK, SEQ = 3, 2, 8


def _run(folder: Path, name: str, program: Path, zero: int) -> list[dict]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, GPT2["vocab_size"], (STEPS, 2 * PER_RANK, SEQ))
    targets = rng.standard_normal((*ids.shape, GPT2["vocab_size"]), dtype=np.float32)
    np.savez(folder / "batches.npz", input_ids=ids, labels=targets)
    case = {"program": str(program), "batches": str(folder / "batches.npz"), "steps": STEPS, "memory_only": True}
    case.update(out=str(folder / name), **({"zero": zero} if zero else {}))
    spec = folder / f"{name}.json"
    spec.write_text(json.dumps({"cases": [case], "timeout_s": 120}))
    finished = run_ranks(2, [str(Path(__file__).parent / "_worker.py"), str(spec)], timeout=300)
    for f in finished:
        assert f.returncode == 0, f"rank {f.rank}: {f.output[-3000:]}"
    return [dict(np.load(folder / f"{name}-rank{r}.npz")) for r in range(2)]


def test_zero_halves_the_optimizer_state_and_lowers_the_peak_memory_of_each_process(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = models.export_transformer(tmp_path / "gpt2.onnx", **GPT2)
        dp = graphforge.save(graphforge.compile(str(model), f"{PIPELINE}, allreduce").model, tmp_path / "dp.onnx")
        zero = graphforge.save(graphforge.compile(str(model), f"{PIPELINE}, zero(stage=1)").model, tmp_path / "z.onnx")
    roles = graphforge.ProgramRoles.of_proto(graphforge.load(dp))
    moments = sum(int(np.prod(c.shape)) * 4 for c in roles.carried_with_role("optimizer"))
    assert moments > 100 * 2**20
    plain, sharded = _run(tmp_path, "dp", dp, 0), _run(tmp_path, "zero", zero, 1)
    for rank in range(2):
        held, full = int(sharded[rank]["__state_bytes__"]), int(plain[rank]["__state_bytes__"])
        assert full >= moments and held <= full / 2, (held, full)
        assert held <= moments / 2 + 64, (held, moments)
        fall = int(plain[rank]["__peak_rss__"]) - int(sharded[rank]["__peak_rss__"])
        assert fall >= moments / 3, (
            f"rank {rank}: the peak fell by {fall / 2**20:.0f} MiB, moments {moments / 2**20:.0f} MiB"
        )
