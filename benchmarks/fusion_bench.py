"""Fusion: each model's training step with and without the ``fuse`` pass, and with each rule
alone (where it fires), beside torch eager, in one process at 2 threads (graphforge's variants and torch take
turns, block by block, so a slower stretch of the machine hits every side alike).

    python benchmarks/run.py fusion

Models: the Training step section's CNN and GPT-2 2×256, and a ResNet-18-shaped CNN built
from code (BasicBlocks [2, 2, 2, 2], BatchNorm in training mode, 3×64×64, batch 16, 10
classes). Every variant starts from the same weights and trains on the same batches; the
first losses are printed beside the table as a check.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_bench as tb  # noqa: E402

TITLE = "Fusion"
CACHE = Path(tempfile.gettempdir()) / "graphforge-bench" / "fusion"
THREADS = 2
RESNET = replace(tb.RESNET18, steps=6)
FULL = [tb.FULL[1], RESNET, tb.FULL[2]]
QUICK = [tb.QUICK[1], tb.Spec("resnet18", "ResNet-18 3×16×16", 2, {"image": 16, "classes": 10}, steps=2)]
ROUNDS, QUICK_ROUNDS = 8, 2
PROFILE_STEPS = 3


def prepare(spec: tb.Spec, folder: Path):
    """(torch module, forward model path, batches) for ``spec``."""
    if spec.key != "resnet18":
        module = tb.build_torch(spec)
        model, _, _, _ = tb.prepare(spec, folder)
        return module, model, tb.make_batches(spec)

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    c = spec.config
    batches = [
        (
            rng.standard_normal((spec.batch, 3, c["image"], c["image"])).astype(np.float32),
            rng.integers(0, c["classes"], spec.batch).astype(np.int64),
        )
        for _ in range(tb.BATCHES)
    ]
    module = tb.resnet18(c["classes"])
    path = tb.export(module, batches[0][0], folder / "model.onnx", "x", training=True)
    return module, path, batches


def variants(model: Path, folder: Path) -> dict[str, tuple[Path, str]]:
    """label -> (program, fuse's note): without fuse, with every rule, with each rule alone."""
    from graphforge.passes.fusion import RULES

    import graphforge

    out = {}
    for label, extra in [
        ("no fuse", ""),
        ("fuse", ", fuse(provider=cpu)"),
        *[(r.name, f", fuse(provider=cpu, rules=[{r.name}])") for r in RULES],
    ]:
        result = graphforge.compile(str(model), tb.PIPELINE + extra)
        fuse = next((r for r in result.records if r.name == "fuse"), None)
        if fuse is not None and not fuse.changed and label != "fuse":
            continue  # the rule alone did not fire: the same program as without fuse
        note = "" if fuse is None else fuse.note
        out[label] = (graphforge.save(result.model, folder / f"program-{label.replace(' ', '_')}.onnx"), note)
    return out


def engines(model: Path) -> str:
    """Why fuse matches with networkx over onnx-graphsurgeon rather than onnxscript's rewriter:
    one ReLU-mask rule applied to the same graph both ways (it fires nowhere here, so the
    times are the matching and, for onnxscript, the conversions its IR needs)."""
    import onnx_graphsurgeon as gs
    import onnx_ir as ir
    from graphforge.passes.fusion.engine import Context, apply
    from graphforge.passes.fusion.rules import RELU_MASK
    from onnxscript.rewriter import pattern as orp

    import graphforge
    from graphforge.graph import Model

    program = graphforge.compile(str(model), "loss(kind=cross_entropy, output=logits), autodiff").model
    graph = Model.from_proto(program).graph
    start = time.perf_counter()
    apply(graph, [RELU_MASK], Context("CPUExecutionProvider", graph.opset))
    ours = time.perf_counter() - start

    def where(op, y, zero, dy, other):
        return op.Where(op.Greater(y, zero), dy, other)

    def product(op, y, zero, dy, other):
        return op.Mul(dy, op.Cast(op.Greater(y, zero), to=1))

    start = time.perf_counter()
    converted = ir.from_proto(gs.export_onnx(graph))
    orp.RewriteRule(where, product).apply_to_model(converted)
    gs.import_onnx(ir.to_proto(converted))
    theirs = time.perf_counter() - start
    return (
        f"{len(graph.nodes)} nodes; graphforge's engine (networkx VF2) {ours * 1000:.0f} ms; onnxscript's rewriter "
        f"{theirs * 1000:.0f} ms with the conversions to its IR and back that an onnx-graphsurgeon pipeline needs"
    )


def measure(spec: tb.Spec, quick: bool) -> tuple[list[str], list[str]]:
    import torch

    from graphforge.runtime import Module

    torch.set_num_threads(THREADS)
    folder = CACHE / f"{spec.key}-b{spec.batch}-{spec.config.get('image', '')}"
    module, model, batches = prepare(spec, folder)
    programs = variants(model, folder)
    if spec.key == "gpt2":
        notes = {label: note for label, (_, note) in programs.items() if label != "no fuse"}
        return [], [
            f"- {spec.label}: {notes['fuse'] or 'no rule fired'} (not timed: the program is unchanged)",
            f"- Rewrite engine, on this GPT-2's program (no optimizer pass): {engines(model)}",
        ]
    modules = {
        label: Module(str(path), device="cpu", intra_op_threads=THREADS, inter_op_threads=1)
        for label, (path, _) in programs.items()
    }
    steppers = {label: m.train_step for label, m in modules.items()}
    steppers["torch eager"] = tb.torch_adamw_step(module.train())
    losses = {label: [float(step(*batches[i % len(batches)])) for i in range(3)] for label, step in steppers.items()}
    times: dict[str, list[float]] = {label: [] for label in steppers}
    for _ in range(QUICK_ROUNDS if quick else ROUNDS):
        for label, step in steppers.items():
            start = time.perf_counter()
            for i in range(spec.steps):
                step(*batches[i % len(batches)])
            times[label].append((time.perf_counter() - start) / spec.steps)
    median = {label: float(np.median(t)) for label, t in times.items()}
    rows = [
        f"| {spec.label} | {label} | {median[label] * 1000:.1f} | {median['no fuse'] / median[label]:.2f}× | "
        f"{median['torch eager'] / median[label]:.2f}× | {programs[label][1] if label in programs else '—'} |"
        for label in steppers
    ]
    first = ", ".join(f"{label} {' '.join(f'{v:.5f}' for v in ls)}" for label, ls in losses.items())
    return rows, [
        f"- {spec.label}: first losses: {first}",
        f"- {spec.label}: {_where_time_goes(modules['fuse'], batches)}",
    ]


def _where_time_goes(module, batches) -> str:
    """onnxruntime's profile of the fused program: kernel time by part and largest op types."""
    from graphforge.train.profiling import summarize_traces

    with tempfile.TemporaryDirectory(prefix="fusion-bench-profile-") as tmp:
        module.start_profiling(Path(tmp) / "step")
        for i in range(PROFILE_STEPS + 1):  # the profiled session's first run is left out
            module.train_step(*batches[i % len(batches)])
        summary = summarize_traces([path for path, _ in module.end_profiling()])
    return f"with fuse, onnxruntime's kernel time by part: {summary.line(top=8)}"


#: what the rules do not reach yet, read from the profiles (here and in the Training step section)
LEFT = """What fusion does not reach yet (the profiles say where the rest goes):

- **The optimizer.** AdamW is 14 elementwise passes per parameter (the MLP's largest part in the
  Training step section). On the CPU they are memory-bound: one flat buffer would save dispatches,
  not passes, and stock onnxruntime has no kernel that fuses elementwise chains, so it stays.
- **GPT-2.** No rule fires: most of its step is GEMMs (the Training step section's profile), the
  largest the vocabulary projection's three (forward, weight gradient, input gradient), which no
  rewrite into other standard ops makes cheaper; the loss gradient is already softmax minus one-hot.
- **ResNet-18.** Most of its step is convolutions whose weights change every step, which
  onnxruntime's CPU provider runs as im2col + GEMM (NCHW), against torch's oneDNN kernels.
  conv_input_grad_nchwc moves the input gradients of the large layers onto the blocked kernels;
  the forward convolutions and the weight gradients are not yet (a forward rule must also be
  undone by `prune`, so that an exported model does not depend on the CPU's vector width)."""


def run(quick: bool = False) -> str:
    import onnxruntime
    import torch

    import graphforge

    rows, notes = [], []
    for spec in QUICK if quick else FULL:
        print(f"  {spec.label}", flush=True)
        r, n = measure(spec, quick)
        rows += r
        notes += n
    return "\n".join(
        [
            f"Training step (loss, backward, AdamW) at {THREADS} threads, median ms over "
            f"{QUICK_ROUNDS if quick else ROUNDS} rounds of a block of steps per side, the sides taking turns in "
            "one process. × no fuse, × torch eager: that side's time over this row's (above 1: the row is faster).",
            "",
            "| model | side | step ms | × no fuse | × torch eager | fuse's note |",
            "| --- | --- | ---: | ---: | ---: | --- |",
            *rows,
            "",
            *notes,
            "",
            LEFT,
            "",
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; graphforge {graphforge.__version__}, "
            f"onnxruntime {onnxruntime.__version__}, torch {torch.__version__}.",
        ]
    )
