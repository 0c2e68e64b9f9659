"""The PyTorch front end on a CUDA GPU: the PyTorch front end section's sides (torch eager,
``GraphforgeModule`` on onnxruntime's CUDA provider with the module's tensors crossing through
DLPack, graphforge's full program) on the CUDA section's models, GPT-2 small included (issue 15's
GPU goal is graphforge's step against torch eager CUDA there). A step ends when its loss is a
Python float, which waits for the GPU on every side.

    python benchmarks/run.py torch_frontend_cuda   # where onnxruntime's CUDA provider works; elsewhere skipped
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cuda_bench  # noqa: E402  (its models and its test of whether CUDA works here)
import torch_frontend_bench as fb  # noqa: E402  (the sides and the table)

TITLE = "PyTorch front end (CUDA)"
#: fewer timed steps than the CUDA section: three sides a model, in one GPU lease
SPECS = [replace(spec, steps=max(20, spec.steps // 2)) for spec, _ in cuda_bench.FULL]
QUICK = [spec for spec, _ in cuda_bench.QUICK]


def unavailable() -> str | None:
    return cuda_bench.unavailable()


def run(quick: bool = False) -> str:
    import onnxruntime
    import torch

    body = fb.table(QUICK if quick else SPECS, {}, device=cuda_bench.DEVICE)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{body}\n{gpu}; onnxruntime {onnxruntime.__version__}, torch {torch.__version__}."
