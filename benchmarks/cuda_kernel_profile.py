"""Where a training step's GPU time goes, by CUDA kernel: graphforge's float16 and float32
programs and torch's AMP recipe on GPT-2 small (batch 16 × sequence 256, AdamW), each traced
with torch.profiler (CUPTI records every kernel of the process, onnxruntime's included).

    python benchmarks/cuda_kernel_profile.py      # where onnxruntime's CUDA provider and a CUDA torch work

Prints, per side, the GPU's busy time per step by kernel family (GEMM, cast, reduction, ...)
and the largest kernels. Not a ``*_bench.py`` section: a tool for finding what to fuse.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_bench as tb  # noqa: E402

SPEC = tb.Spec("gpt2", "GPT-2 small 16×256", 16, {**tb.GPT2_SMALL, "seq": 256}, steps=1)
FAMILIES = (  # (family, what its kernels' names contain), first match wins
    ("gemm", ("gemm", "sm90", "cutlass", "xmma", "cublas", "nvjet")),
    ("cast", ("cast",)),
    ("reduce", ("reduce", "reduction")),
    ("softmax", ("softmax",)),
    ("layernorm", ("layernorm", "layer_norm")),
    ("copy", ("copy", "memcpy", "memset")),
)


def family(kernel: str) -> str:
    name = kernel.lower()
    return next((f for f, marks in FAMILIES if any(m in name for m in marks)), "elementwise/other")


def report(name: str, step, runs: int = 3) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(runs):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy = sum(e.device_time_total for e in events) / runs / 1000
    families = Counter()
    for e in events:
        families[family(e.key)] += e.device_time_total / runs / 1000
    print(f"== {name}: GPU busy {busy:.1f} ms/step; " + ", ".join(f"{f} {v:.1f}" for f, v in families.most_common()))
    for e in sorted(events, key=lambda e: -e.device_time_total)[:18]:
        print(f"  {e.device_time_total / runs / 1000:7.2f} ms  ×{e.count // runs:<5} {e.key[:110]}")


def main() -> None:
    import graphforge
    from graphforge.runtime import Module

    model, fp32, batches, _ = tb.prepare(SPEC, Path("/tmp/graphforge-bench/kernel-profile"))
    fp16 = graphforge.compile(str(model), f"{tb.PIPELINE}, mixed_precision(dtype=float16, provider=cuda)").model
    data = np.load(batches)
    x, y = data["x0"], data["y0"]
    for name, program in (("graphforge float16", fp16), ("graphforge float32", str(fp32))):
        module = Module(program, device="cuda")
        report(name, lambda module=module: module.train_step(x, y))
        del module
    torch_model = tb.build_torch(SPEC).to("cuda").train()
    step = tb.torch_adamw_step(torch_model, "cuda", autocast="float16")
    report("torch AMP", lambda: step(x, y))


if __name__ == "__main__":
    main()
