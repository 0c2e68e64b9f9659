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
import helpers  # noqa: E402  (what the benchmarks share)
import train_bench as tb  # noqa: E402

TITLE = "Fusion"
CACHE = helpers.cache("fusion")
THREADS = 2
RESNET = replace(tb.RESNET18, steps=6)
FULL = [tb.FULL[1], RESNET, tb.FULL[2]]
QUICK = [tb.QUICK[1], tb.Spec("resnet18", "ResNet-18 3×16×16", 2, {"image": 16, "classes": 10}, steps=2)]
ROUNDS, QUICK_ROUNDS = 8, 2
PROFILE_STEPS = 3
#: the side that runs the fused program with Module's default update (torch's fused AdamW kernel
#: over the runner's buffers; the other graphforge sides run the program's ONNX update)
FUSED_UPDATE = "fuse, fused update"


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
        label: Module(str(path), device="cpu", intra_op_threads=THREADS, inter_op_threads=1, update="onnx")
        for label, (path, _) in programs.items()
    }
    steppers = {label: m.train_step for label, m in modules.items()}
    # what Module does by default: the same fused program, its AdamW run by torch's fused kernel
    default = Module(str(programs["fuse"][0]), device="cpu", intra_op_threads=THREADS, inter_op_threads=1)
    steppers[FUSED_UPDATE] = default.train_step
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
        f"{median['torch eager'] / median[label]:.2f}× | {_note(label, programs)} |"
        for label in steppers
    ]
    first = ", ".join(f"{label} {' '.join(f'{v:.5f}' for v in ls)}" for label, ls in losses.items())
    return rows, [
        f"- {spec.label}: first losses: {first}",
        f"- {spec.label}: {_where_time_goes(modules['fuse'], batches)}",
    ]


def _note(label: str, programs: dict[str, tuple[Path, str]]) -> str:
    if label == FUSED_UPDATE:
        return "the fuse row's program; Module's default update: torch's fused AdamW kernel"
    return programs[label][1] if label in programs else "—"


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
  Training step section), each memory-bound on the CPU, and stock onnxruntime has no kernel that
  fuses an elementwise chain (onnxruntime-training's fused AdamW is a kernel of the training
  build). The issue's multi-tensor layout, measured against the program's own optimizer segment
  (`.venv/bin/python benchmarks/fusion_kernels.py optimizer`, 2026-11-26 14:46 UTC, this
  2-core Xeon; median ms of 30 runs, inputs and outputs bound as the runtime binds them):

  | parameters | threads | per parameter (today) | one flat buffer | flat, with its Concat and Split |
  | --- | ---: | ---: | ---: | ---: |
  | MLP 784-1024-1024-10: 6 tensors, 1.9 M values | 1 | 19.59 | 25.01 | 29.27 |
  | MLP 784-1024-1024-10 | 2 | 9.99 | 11.27 | 12.93 |
  | one GPT-2 small block: 12 tensors, 7.1 M values | 1 | 74.66 | 81.40 | 94.57 |
  | one GPT-2 small block | 2 | 44.12 | 52.30 | 60.18 |
  | 96 vectors of 768: 74 k values | 1 | 1.16 | 0.25 | 0.42 |
  | 96 vectors of 768 | 2 | 1.28 | 0.34 | 0.63 |

  One flat buffer is slower on the MLP and on a GPT-2 block even before the Concat and Split that
  gather the separate parameters and gradients into it and hand the parameters back (the likely
  reason, not measured: each per-parameter chain works on a few MB, which can stay in the CPU's
  caches from one pass to the next, and one chain over 7-28 MB cannot). It is faster only on many
  small tensors, where the whole update costs about a millisecond (and such times move a lot on
  this machine: the 96-vector case's per-parameter update took 1.3-2.9 ms at 2 threads over three
  runs). So the layout does not ship.
  What changed instead: the step's scalars (bias corrections, step size, AdamW's decay factor)
  are made once for all parameters rather than once per parameter. onnxruntime had been folding
  and sharing them already, so the step times did not move measurably, but GPT-2 small's program
  has 2,357 fewer nodes (10,067 → 7,710), which shortens its compile (Autodiff section).
- **GPT-2.** No rule fires: most of its step is GEMMs (the Training step section's profile), the
  largest the vocabulary projection's three (forward, weight gradient, input gradient), which no
  rewrite into other standard ops makes cheaper; the loss gradient is already softmax minus one-hot.
  The rest, by module (GPT-2 small, batch 8 × 64, 2 threads; onnxruntime's profile of 3 steps
  grouped by the nodes' module paths, a scratch script, 2026-11-26 22:20 UTC, 3,883 ms a step in
  a slow hour of this machine): AdamW 823 ms (21%), the tanh-GELU 177 ms (forward 68, backward
  109: 4.5%), attention outside its GEMMs 148 ms (3.8%), the LayerNorms' backward 69 ms (1.8%),
  their forward 9 ms. The issue's forward fusions into onnxruntime's contrib ops (FastGelu,
  BiasGelu, SkipLayerNormalization, FusedMatMul) are not built: onnxruntime's own session
  optimizer makes them where a pattern's intermediates have no other reader (FusedMatMul is in
  every profile above), and in a training program the backward reads those intermediates (the
  GELU's tanh, the attention's softmax), so a rule would have to fuse before autodiff and give
  the fused op a compact standard-op backward. At most the GELU's 4.5% is there to win, and the
  backward half of it stays.
- **ResNet-18.** conv_nchwc puts the forward convolutions over 16×16 and 8×8 outputs (the first
  two stages, 3×3 kernels) onto onnxruntime's NCHWc kernels, conv_input_grad_nchwc the input
  gradients of the first stage; conv_stacked and conv_transpose_stacked take the convolutions of
  the last two stages (4×4 and 2×2 images) off onnxruntime's per-image GEMMs; autodiff itself
  writes the weight gradients of the small stages as one GEMM (benchmarks/fusion_kernels.py
  conv_forward, conv and small_conv have each formulation's A/B by layer). The issue's other
  candidates, measured by layer on this machine (a scratch A/B, onnxruntime 1.31, 2 threads,
  the fastest of 60 interleaved runs, load average 3-13): a whole-batch im2col as one GEMM for
  the forward ties the stacked Conv (2×2: 4.7 vs 5.1 ms; 4×4 → 2×2 stride 2: 2.4 vs 3.3 ms;
  4×4: 5.7 vs 3.2 ms, slower) and is slower at 8×8 and 16×16, where its channels-first slices
  copy rows of 8 and 16 values; the input gradient as one GEMM and a col2im of nine Pads and a
  Sum loses to ConvTranspose at 8×8 and 16×16 (10.9 vs 3.7 ms, 11.0 vs 4.6 ms) and beats the
  per-image ConvTranspose only at 2×2 (10.5 vs 24.2 ms), which conv_transpose_stacked already
  replaces; the input gradient as a plain Conv with flipped, transposed weights runs a Conv of
  the forward's cost, which ties ConvTranspose at 8×8 and 16×16 (3.6 vs 3.7 ms, 4.7 vs 4.6 ms),
  and on NCHWc kernels at 8×8 it was 1.1× faster by the fastest run and no faster by the
  median, so conv_input_grad_nchwc keeps its 16×16 floor; the weight gradient from
  channels-first columns in one GEMM (no transpose of the result) ties autodiff's channels-last
  GEMM (2×2: 8.0 vs 7.5 ms; 4×4: 5.4 vs 4.3 ms). None of them is kept.
  Left: AdamW over 11.2 M parameters (a quarter to a third of the kernel time: Mul, Sub, Add,
  Div, Sqrt), the input gradients over 8×8 (ConvTranspose, image by image), the stacked
  convolutions of the last stages, whose GEMMs run at about half the machine's GEMM rate with
  their gap rows (a quarter to a half more columns), the transposes of the small stages' weight
  gradients to the weights' layout (Transpose, 5-7% of the kernel time), and BatchNorm's
  training-mode backward (Mul, Sub, ReduceMean). torch runs oneDNN's convolution kernels,
  blocked and direct, for the forward and both gradients, and AdamW in place. The stacked and
  NCHWc convolutions sum in another order: the third step's loss moves in the fifth digit, for
  the reason the Training step section gives for ResNet-18's losses."""


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
            "one process. × no fuse, × torch eager: that side's time over this row's (above 1: the row is faster). "
            "The graphforge sides run the program's ONNX update, as the Training step section does, but "
            f"'{FUSED_UPDATE}', which runs it as Module does by default.",
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
