"""Mixed precision on a CUDA GPU: graphforge's float16 program (``mixed_precision(dtype=float16,
provider=cuda)``) beside its float32 program, PyTorch eager in float32, and PyTorch's AMP recipe
(torch.autocast(float16) + torch.amp.GradScaler), on GPT-2 2×256 and GPT-2 small (batch 8 ×
sequence 64, and batch 16 × sequence 256; AdamW). Each side in a fresh process; step time and device memory as the CUDA
section measures them (cuda_bench.py).

    python benchmarks/run.py mixed_precision_cuda   # where onnxruntime's CUDA provider works
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cuda_bench  # noqa: E402
import helpers  # noqa: E402  (what the benchmarks share)
import mixed_precision_bench as mp  # noqa: E402
import train_bench as tb  # noqa: E402

TITLE = "Mixed precision (CUDA)"
CACHE = helpers.cache("mixed-precision-cuda")
FULL = [
    replace(tb.FULL[2], steps=50),
    tb.Spec("gpt2", "GPT-2 small 12×768, vocab 50257", 8, tb.GPT2_SMALL, steps=30, warmup=tb.CHECK_STEPS + 1),
    # a shape whose GEMMs fill the GPU (4096 tokens a step), where float16's arithmetic can tell
    tb.Spec(
        "gpt2",
        "GPT-2 small, batch 16 × sequence 256",
        16,
        {**tb.GPT2_SMALL, "seq": 256},
        steps=20,
        warmup=tb.CHECK_STEPS + 1,
    ),
]
QUICK = [tb.QUICK[2]]


def unavailable() -> str | None:
    return cuda_bench.unavailable()


def run(quick: bool = False) -> str:
    return mp.section(
        f"Training steps on {cuda_bench._device_name()}: graphforge's float16 program against its float32 one, "
        "torch eager in float32 and torch's AMP recipe. The goal (issue 16): graphforge float16 ≥ 1.3× torch AMP "
        "on GPT-2 small. Ratios above 1 mean the row is faster.",
        mp.table(cuda_bench.DEVICE, QUICK if quick else FULL, CACHE),
    )


if __name__ == "__main__":
    os.environ.setdefault("GRAPHFORGE_BENCH_DEVICE", "cuda")
    tb.child_main(cuda_bench.child, run)
