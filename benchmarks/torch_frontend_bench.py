"""The PyTorch front end: a torch training loop (forward, cross-entropy, backward,
torch.optim.AdamW) on the plain module beside the same loop on ``GraphforgeModule(module)``,
and graphforge's full program (``Module.train_step``: loss and AdamW inside the program) on the
Training step section's models and batches, at 2 threads.

Each side runs in a fresh process: its first step (for the wrapped module: export, compile,
sessions) is reported apart, then the median and interquartile range of the steps after a
warm-up. The sides run one after another, so load from outside the benchmark can fall on one
side more than another; the Training step section's interleaved method is the careful one.

    python benchmarks/run.py torch_frontend

``torch_frontend_cuda_bench.py`` runs the same sides on a CUDA GPU (``table(device="cuda")``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import helpers  # noqa: E402  (what the benchmarks share)
import train_bench as tb  # noqa: E402  (the models, their export and the optimizer settings)

TITLE = "PyTorch front end"
CACHE = helpers.cache("torch_frontend")
THREADS = 2
WARMUP = 3
STEPS = {"mlp": 100, "cnn": 60, "gpt2": 15}
SIDES = ("torch eager", "GraphforgeModule", "graphforge program")
TIMEOUT_S = 900


def child(job: dict) -> dict:
    import torch

    device = job.get("device", "cpu")
    torch.set_num_threads(THREADS)
    torch.set_num_interop_threads(1)
    spec = tb.Spec(**job["spec"])
    data = np.load(job["batches"])
    batches = [(data[f"x{i}"], data[f"y{i}"]) for i in range(len(data.files) // 2)]
    side = job["side"]
    if side == "graphforge program":
        from graphforge.runtime import Module

        module = Module(job["program"], device=device, intra_op_threads=THREADS, inter_op_threads=1, update="onnx")

        def step(x, y):  # the batch crosses from the host, as torch's step takes it
            return float(module.train_step(x, y))
    else:
        from graphforge.torch import GraphforgeModule

        model = tb.build_torch(spec).to(device).train()
        if side == "GraphforgeModule":
            model = GraphforgeModule(model, fallback="error")
        phases = {} if device == "cpu" else None  # timing the parts of a CUDA step would need syncs
        step = tb.torch_adamw_step(model, device, phases=phases)

    times, losses = [], []
    for i in range(WARMUP + job["steps"]):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        losses.append(step(x, y))
        times.append(time.perf_counter() - start)
    timed = times[WARMUP:]
    q1, _, q3 = statistics.quantiles(timed, n=4)
    result = {"first_s": times[0], "step_s": statistics.median(timed), "iqr_s": q3 - q1, "losses": losses[:3]}
    if side == "GraphforgeModule":
        result.update(_crossing(model))
    if side != "graphforge program" and phases:
        result["phases_s"] = {name: statistics.median(times[WARMUP:]) for name, times in phases.items()}
        result["loss_backward_s"] = _loss_backward(model, batches[0])
    return result


def _loss_backward(model, batch) -> float:
    """The part of the backward phase that is torch's own on both sides: the cross-entropy's
    gradient with respect to the logits (the median of 5)."""
    import torch

    with torch.no_grad():
        shape = model(torch.from_numpy(batch[0])).shape
    logits, labels = torch.randn(shape, requires_grad=True), torch.from_numpy(batch[1])
    times = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(logits, labels)
        start = time.perf_counter()
        torch.autograd.grad(loss, logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _crossing(model) -> dict:
    """What handing the module's parameters and buffers to the sessions costs a step: each one
    made what a session binds (``_feed``: a NumPy view, or a DLPack OrtValue on CUDA)."""
    from graphforge.torch.module import _feed

    tensors = list(model.module.state_dict(keep_vars=True).values())
    start = time.perf_counter()
    for _ in range(20):
        [_feed(t) for t in tensors]
    return {"feed_s": (time.perf_counter() - start) / 20, "fed": len(tensors)}


def measure(job: dict) -> dict:
    try:
        return tb.run_child(__file__, job, timeout=TIMEOUT_S)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)[-300:]}


def run(quick: bool = False) -> str:
    return table(tb.QUICK if quick else tb.FULL, {s.key: 10 for s in tb.QUICK} if quick else STEPS)


def table(specs, steps: dict[str, int], device: str = "cpu") -> str:
    """The section's body: each of ``specs`` trained by every side on ``device`` (timed
    ``steps[spec.key]`` steps, or ``spec.steps`` where it has no entry)."""
    from dataclasses import asdict

    import graphforge

    rows, notes = [], []
    for spec in specs:
        folder = CACHE / f"{spec.key}-{spec.batch}-{spec.config.get('n_layer', '')}"
        _, program, batches, _ = tb.prepare(spec, folder)
        results = {}
        for side in SIDES:
            job = {"side": side, "spec": asdict(spec), "batches": str(batches), "program": str(program)}
            job.update(steps=steps.get(spec.key, spec.steps), device=device)
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
        split = [(side, r) for side, r in results.items() if "phases_s" in r]
        if split:
            notes.append(
                f"- {spec.label}: step parts, ms (median): "
                + "; ".join(
                    f"{side} " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["phases_s"].items()) for side, r in split
                )
                + f"; of the backward, the cross-entropy's own (torch's on both sides) "
                f"{split[0][1]['loss_backward_s'] * 1e3:.1f}"
            )
        wrapped = results["GraphforgeModule"]
        if "feed_s" in wrapped:
            notes.append(
                f"- {spec.label}: handing the {wrapped['fed']} parameters and buffers to the sessions takes "
                f"{wrapped['feed_s'] * 1e3:.2f} ms a step ({wrapped['feed_s'] / wrapped['step_s']:.1%} of the wrapped step)"
            )
    return "\n".join(
        [
            "A torch training loop (forward, cross-entropy, backward, torch.optim.AdamW) on the plain module and "
            "on `GraphforgeModule(module)`, beside graphforge's full program (loss and AdamW inside it, "
            "`Module.train_step`), "
            + (f"{THREADS} threads" if device == "cpu" else f"on {device}, the batch coming from the host")
            + ", each side in a fresh process, one after another. "
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
