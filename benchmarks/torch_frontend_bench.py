"""The PyTorch front end: a torch training loop (forward, cross-entropy, backward,
torch.optim.AdamW) on the plain module beside the same loop on ``GraphforgeModule(module)``,
and graphforge's full program (``Module.train_step``: loss and AdamW inside the program) on the
Training step section's models and batches, at 2 threads.

Each side runs in a fresh process: its first step (for the wrapped module: export, compile,
sessions) is reported apart, then the median and interquartile range of the steps after a
warm-up. The sides run one after another, so load from outside the benchmark can fall on one
side more than another; the Training step section's interleaved method is the careful one.

    python benchmarks/run.py torch_frontend
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_bench as tb  # noqa: E402  (the models, their export and the optimizer settings)

TITLE = "PyTorch front end"
CACHE = tb.CACHE.parent / "torch_frontend"
THREADS = 2
WARMUP = 3
STEPS = {"mlp": 100, "cnn": 60, "gpt2": 15}
SIDES = ("torch eager", "GraphforgeModule", "graphforge program")
TIMEOUT_S = 900


def child(job: dict) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    torch.set_num_interop_threads(1)
    spec = tb.Spec(**job["spec"])
    data = np.load(job["batches"])
    batches = [(data[f"x{i}"], data[f"y{i}"]) for i in range(len(data.files) // 2)]
    side = job["side"]
    if side == "graphforge program":
        from graphforge.runtime import Module

        module = Module(job["program"], device="cpu", intra_op_threads=THREADS, inter_op_threads=1)

        def step(x, y):
            return float(module.train_step(x, y))
    else:
        from graphforge.torch import GraphforgeModule

        model = tb.build_torch(spec).train()
        if side == "GraphforgeModule":
            model = GraphforgeModule(model, fallback="error")
        step = tb.torch_adamw_step(model)

    times, losses = [], []
    for i in range(WARMUP + job["steps"]):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        losses.append(step(x, y))
        times.append(time.perf_counter() - start)
    timed = times[WARMUP:]
    q1, _, q3 = statistics.quantiles(timed, n=4)
    return {"first_s": times[0], "step_s": statistics.median(timed), "iqr_s": q3 - q1, "losses": losses[:3]}


def measure(job: dict) -> dict:
    try:
        return tb.run_child(__file__, job, timeout=TIMEOUT_S)
    except RuntimeError as exc:
        return {"error": str(exc)[-300:]}


def run(quick: bool = False) -> str:
    from dataclasses import asdict

    import graphforge

    rows, notes = [], []
    for spec in tb.QUICK if quick else tb.FULL:
        folder = CACHE / f"{spec.key}-{spec.batch}"
        _, program, batches, _ = tb.prepare(spec, folder)
        results = {}
        for side in SIDES:
            job = {"side": side, "spec": asdict(spec), "batches": str(batches), "program": str(program)}
            job["steps"] = 10 if quick else STEPS[spec.key]
            results[side] = measure(job)
            print(f"  {spec.label}: {side}: {json.dumps(results[side])[:200]}", flush=True)
        eager = results["torch eager"]
        for side, r in results.items():
            if "error" in r:
                rows.append(f"| {spec.label} | {side} | failed: {r['error']} | | |")
                continue
            ratio = f"{eager['step_s'] / r['step_s']:.2f}×" if "step_s" in eager else "—"
            rows.append(
                f"| {spec.label} | {side} | {r['step_s'] * 1000:.1f} ± {r['iqr_s'] * 500:.1f} | {ratio} | "
                f"{r['first_s']:.2f} |"
            )
        notes.append(tb.first_losses(spec.label, results))
    return "\n".join(
        [
            f"A torch training loop (forward, cross-entropy, backward, torch.optim.AdamW) on the plain module and "
            f"on `GraphforgeModule(module)`, beside graphforge's full program (loss and AdamW inside it, "
            f"`Module.train_step`), {THREADS} threads, each side in a fresh process, one after another. "
            "Step: the median (± half the interquartile range) after a warm-up; first: the first step "
            "(for the wrapped module: export, compile and sessions).",
            "",
            "| model | side | step ms | torch eager / side | first step s |",
            "| --- | --- | ---: | ---: | ---: |",
            *rows,
            "",
            *notes,
            "",
            f"Machine: {tb.platform.processor() or tb.platform.machine()}; graphforge {graphforge.__version__}.",
        ]
    )


if __name__ == "__main__":
    tb.child_main(child, run)
