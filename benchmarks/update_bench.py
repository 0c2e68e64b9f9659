"""Optimizer-update benchmark: a Module's update as the program's ONNX segment runs it, beside
torch's fused kernels over the same buffers (graphforge/runtime/fused_update.py), and
beside ``torch.optim`` on torch's own tensors, for AdamW, SGD with momentum and LAMB.

Each row: one model's parameters (the GPT-2 programs of the Training step section, AdamW with
the same hyperparameters; SGD lr 0.01 momentum 0.9; LAMB lr 1e-3), gradients from one real
forward/backward (the same on every side), and the time of the update alone: ``optimizer.step()``
of a graphforge Module whose update is the ONNX segment, the same with ``use_fused_update``,
and ``torch.optim``'s step (``fused=True`` where it has one, else its default) on copies of the
parameters with the same gradients. Median of the timed steps after warm-up, one process, the
usable cores as threads on every side; the full step (``train_step``) with each update too.

    python benchmarks/update_bench.py          # prints the markdown section
    python benchmarks/run.py update            # writes it into docs/benchmarks.md
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers
import train_bench as tb

TITLE = "Optimizer update"
CACHE = helpers.cache("update")
UPDATES = {
    "adamw": "adamw(lr=1e-3, weight_decay=0.01)",
    "sgd": "sgd(lr=1e-2, momentum=0.9)",
    "lamb": "lamb(lr=1e-3)",
    # float16 compute with dynamic loss scaling: the update also moves the scale and skips
    # non-finite steps (torch's side: GradScaler around the same fused AdamW)
    "adamw, float16": "adamw(lr=1e-3, weight_decay=0.01), mixed_precision(dtype=float16, provider=cpu)",
}


def _median_ms(step, count: int) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _torch_step(kind: str, params):
    """torch.optim's step for ``kind`` over ``params`` (their .grad set), or None (no LAMB)."""
    import torch

    if kind.startswith("adamw"):
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    elif kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)
    else:
        return None
    if "float16" not in kind:
        return optimizer.step
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # the scale is made by the first loss it scales

    def scaled_step():
        scaler.step(optimizer)
        scaler.update()

    return scaled_step


def measure(spec, kind: str, folder: Path, steps: int) -> dict:
    """The update's time on each side, and the whole step's with each graphforge update."""
    import torch

    import graphforge
    from graphforge.torch import use_fused_update

    threads = helpers.usable_cores()
    torch.set_num_threads(threads)
    model, _, batches, _ = tb.prepare(spec, folder)
    program = graphforge.compile(
        str(model), f"loss(kind=cross_entropy, output=logits), autodiff, {UPDATES[kind]}"
    ).model
    data = np.load(batches)
    x, y = data["x0"], data["y0"]
    result = {"parameters": 0}
    for side in ("onnx", "fused"):
        module = graphforge.Module(program, device="cpu", intra_op_threads=threads, update="onnx")
        optimizer = graphforge.Optimizer(module)
        if side == "fused":
            result["kernel"] = use_fused_update(module, foreach=True).removeprefix("update: ")
        module(x, y)  # the gradients every update applies
        optimizer.step()  # warm-up: sessions made
        result[f"{side} update ms"] = _median_ms(optimizer.step, steps)
        module.train_step(x, y)
        result[f"{side} step ms"] = _median_ms(lambda m=module: m.train_step(x, y), steps)
        result["parameters"] = sum(v.size for v in module.parameters.values())
    params = [torch.from_numpy(v.copy()) for v in module.parameters.values()]
    for p in params:
        p.grad = torch.randn_like(p)
    reference = _torch_step(kind, params)
    if reference is not None:
        reference()
        result["torch.optim update ms"] = _median_ms(reference, steps)
    return result


def benchmark(quick: bool = False, *, cache: Path = CACHE) -> list[tuple[str, str, dict]]:
    specs = [s for s in (tb.QUICK if quick else tb.FULL + tb.LARGE) if s.key == "gpt2"]
    steps = 3 if quick else 10
    rows = []
    for spec in specs:
        for kind in UPDATES:
            rows.append((spec.label, kind, measure(spec, kind, cache / spec.key / str(spec.config["n_layer"]), steps)))
    return rows


def report(rows: list[tuple[str, str, dict]]) -> str:
    lines = [
        f"{helpers.usable_cores()} CPU threads on every side; the update alone (its gradients from one real step), then the "
        "whole train_step with each graphforge update. Medians.",
        "",
        "| model | optimizer | parameters | ONNX update ms | fused update ms | ONNX / fused | torch.optim ms "
        "| step ms, ONNX update | step ms, fused | step ONNX / fused |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, kind, r in rows:
        reference = f"{r['torch.optim update ms']:.1f}" if "torch.optim update ms" in r else "— (none)"
        lines.append(
            f"| {label} | {kind} | {r['parameters'] / 1e6:.1f} M | {r['onnx update ms']:.1f} | "
            f"{r['fused update ms']:.1f} | {r['onnx update ms'] / r['fused update ms']:.2f}× | {reference} | "
            f"{r['onnx step ms']:.1f} | {r['fused step ms']:.1f} | {r['onnx step ms'] / r['fused step ms']:.2f}× |"
        )
    kernels = sorted({(kind, r["kernel"].split(" over ")[0]) for _, kind, r in rows})
    lines += [
        "",
        "Kernels: " + "; ".join(f"{kind}: {kernel}" for kind, kernel in kernels) + ".",
        "",
        "Reading it: the ONNX update is a handful of elementwise kernels per parameter, each a pass "
        "over memory (AdamW's reads and writes each parameter-sized tensor about eleven times); "
        "torch's fused kernels make one pass per tensor. torch has no fused LAMB: in its foreach "
        "kernels (one pass per operation, and per-tensor norms) it is no faster than the ONNX "
        'update, so `use_fused_update` and `train.update = "auto"` keep LAMB\'s ONNX update '
        '(`foreach=True`, `"torch"` run it). On a GPU the same choice has yet to be measured. '
        "The fused side's time beside `torch.optim`'s is what it adds: DLPack views of the "
        "runner's buffers and the clipping factor. The float16 rows scale their loss: the update "
        "reads the gradients segment 0 unscaled, skips a step whose gradients are not finite and "
        "moves the scale (torch's side: `GradScaler.step` and `update` around the same fused "
        "AdamW): in ONNX that is a guard on every write besides the update, in the kernel one "
        "more scalar check.",
    ]
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    return report(benchmark(quick))


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
