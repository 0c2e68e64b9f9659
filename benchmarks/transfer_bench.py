"""Transfer learning with a frozen backbone: a MobileNetV2 whose backbone is frozen and whose last
blocks and classifier train (as onnxruntime-training's MobileNetV2 on-device example does), one
training step in torch eager, graphforge in Python, and graphforge's JavaScript runtime on
onnxruntime-node and onnxruntime-web (wasm), from the same weights on the same batches, in one run.

The model: torchvision's ``mobilenet_v2`` layout written here in torch (torchvision is not a
dependency): a 3×3 stem, 17 inverted residual blocks (1×1 expansion, 3×3 depthwise, 1×1 linear
projection, each with BatchNorm; ReLU6), a 1×1 convolution to 1280 channels, global average
pooling and a linear classifier of 10 classes; BatchNorm's statistics seeded away from their
defaults, as a pretrained backbone's are, and every BatchNorm in inference mode (a frozen
backbone's statistics stay; fine-tuning's small batches leave them as they are). Images 3×96×96,
batch 16, cross-entropy, AdamW (lr 1e-3, weight decay 0).

Frozen: ``features.0`` to ``features.15`` (the stem and the first 15 blocks); trained: the last two
blocks (``features.16``, ``features.17``), the 1×1 convolution (``features.18``) and the classifier.

* torch eager: those parameters ``requires_grad=False`` (autograd records nothing below the first
  trained layer), ``torch.optim.AdamW`` over the rest; ``model.eval()``;
* graphforge Python: ``freeze(names=[features.0.*, …, features.15.*]), loss, autodiff, adamw`` run by
  ``Module.train_step``: the frozen weights are constants of the session (onnxruntime folds each
  BatchNorm into its convolution, prepacks the weights and runs those convolutions in its NCHWc
  blocks), and the backward stops at ``features.16``; its update the Module's default (torch's
  fused AdamW kernel over the same buffers), and the program's ONNX one (as the JavaScript
  runtime runs it);
* graphforge JS (``TrainingSession.runStep``) on onnxruntime-node and on onnxruntime-web's wasm
  backend in Node, from ``graphforge artifacts --frozen-constants``'s artifacts (the frozen weights
  constants of the models), and on onnxruntime-node from the artifacts whose models read the frozen
  weights as inputs from the checkpoint (the default, onnxruntime-training's layout).

Each side in its own process at the same threads (one intra-op thread: the machine is shared), every
step's loss awaited; the batches made before timing. Time: warm-up steps (3, and 1.5 s at least),
then 3 blocks of about 1 s; the median block's time a step. Each side is measured in 3 rounds taken
in turn (the machine's load moves), the fastest kept. The profile: onnxruntime's of graphforge
Python's step after its timing, kernel time by part and op type.

    .venv/bin/python benchmarks/transfer_bench.py            # prints the markdown section
    .venv/bin/python benchmarks/run.py transfer              # writes it into docs/benchmarks.md
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import helpers  # noqa: E402
import ondevice_bench as od  # noqa: E402
import steps_bench  # noqa: E402
import train_bench  # noqa: E402

TITLE = "Transfer learning (frozen backbone)"
CACHE = helpers.cache("transfer")
LR = 1e-3
THREADS = 1
ROUNDS = 3
#: graphforge Python's steps profiled after the timing
PROFILE_STEPS = 3
#: the inverted residual blocks (expansion t, channels c, repeats n, first stride s): MobileNetV2's
BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


@dataclass(frozen=True)
class Config:
    width: float = 1.0
    size: int = 96
    batch: int = 16
    classes: int = 10
    #: the trained features (the last ones) besides the classifier
    trained: int = 3
    batches: int = 2

    @property
    def label(self) -> str:
        return f"MobileNetV2 (width {self.width:g}) 3×{self.size}×{self.size}, batch {self.batch}"


FULL = Config()
QUICK = Config(width=0.25, size=32, batch=2, batches=2)


# --------------------------------------------------------------------------- the model


def build(config: Config):
    """MobileNetV2 (torchvision's layout) in torch, BatchNorm's affine and statistics seeded."""
    import torch
    from torch import nn

    def conv_bn(c_in: int, c_out: int, kernel: int, stride: int, groups: int = 1, relu: bool = True):
        layers = [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out)]
        return nn.Sequential(*layers, *([nn.ReLU6()] if relu else []))

    class Inverted(nn.Module):
        def __init__(self, c_in: int, c_out: int, stride: int, t: int):
            super().__init__()
            hidden, self.residual = c_in * t, stride == 1 and c_in == c_out
            expand = [] if t == 1 else [conv_bn(c_in, hidden, 1, 1)]
            self.conv = nn.Sequential(
                *expand, conv_bn(hidden, hidden, 3, stride, groups=hidden), conv_bn(hidden, c_out, 1, 1, relu=False)
            )

        def forward(self, x):
            return x + self.conv(x) if self.residual else self.conv(x)

    def channels(c: float) -> int:  # torchvision's _make_divisible by 8
        return max(8, int(c * config.width + 4) // 8 * 8)

    torch.manual_seed(0)
    c_in = channels(32)
    features = [conv_bn(3, c_in, 3, 2)]
    for t, c, n, s in BLOCKS:
        for i in range(n):
            features.append(Inverted(c_in, channels(c), s if i == 0 else 1, t))
            c_in = channels(c)
    last = max(1280, channels(1280))
    features.append(conv_bn(c_in, last, 1, 1))
    model = nn.Sequential()
    model.features = nn.Sequential(*features)
    model.pool, model.flatten = nn.AdaptiveAvgPool2d(1), nn.Flatten()
    model.classifier = nn.Linear(last, config.classes)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.1, 0.1), m.running_var.uniform_(0.5, 1.5)
    return model.eval()


def frozen_globs(config: Config) -> list[str]:
    """The backbone's parameters, as freeze's ``names``: every feature but the last ``trained``."""
    count = 1 + sum(n for _, _, n, _ in BLOCKS) + 1
    return [f"features.{i}.*" for i in range(count - config.trained)]


def pipeline(config: Config) -> str:
    return (
        f"freeze(names={json.dumps(frozen_globs(config))}), loss(kind=cross_entropy, output=logits), autodiff, "
        f"adamw(lr={LR}, weight_decay=0)"
    )


def prepare(config: Config, folder: Path) -> dict:
    """The export, its program, both artifact folders, torch's weights and the batches, in ``folder``."""
    import torch

    import graphforge
    from graphforge.ondevice.artifacts import write_artifacts
    from graphforge.program import ProgramRoles

    folder.mkdir(parents=True, exist_ok=True)
    model = build(config)
    rng = np.random.default_rng(0)
    shape = (config.batch, 3, config.size, config.size)
    batches = [
        [("x", rng.standard_normal(shape).astype(np.float32)),
         ("labels", rng.integers(0, config.classes, config.batch).astype(np.int64))]
        for _ in range(config.batches)
    ]  # fmt: skip
    onnx_path = train_bench.export(model, batches[0][0][1][:2], folder / "model.onnx", "x")
    program = graphforge.compile(str(onnx_path), pipeline(config)).model
    graphforge.save(program, folder / "program.onnx")
    write_artifacts(program, folder / "artifacts", frozen=[])  # --frozen-constants
    write_artifacts(program, folder / "artifacts-inputs")  # the frozen weights read from the checkpoint
    torch.save(model.state_dict(), folder / "torch.pt")
    roles = ProgramRoles.read(program)
    sizes = {t.name: int(np.prod(t.dims)) for t in program.graph.initializer}
    return {
        "config": asdict(config),
        "values": {"trained": sum(sizes[p] for p in roles.parameters), "frozen": sum(sizes[f] for f in roles.frozen)},
        "program": str(folder / "program.onnx"),
        "state": str(folder / "torch.pt"),
        "batches": {"file": str(folder / "batches.bin"), "steps": od.write_tensors(folder / "batches.bin", batches)},
    }


# --------------------------------------------------------------------------- sides


def _torch_child(job: dict) -> dict:
    """torch eager in this (fresh) process, the frozen part ``requires_grad=False``."""
    import fnmatch

    import torch

    torch.set_num_threads(job["threads"])
    config = Config(**job["config"])
    model = build(config)
    model.load_state_dict(torch.load(job["state"]))
    frozen = frozen_globs(config)
    for name, p in model.named_parameters():
        p.requires_grad_(not any(fnmatch.fnmatchcase(name, g) for g in frozen))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, weight_decay=0.0)
    batches = [[torch.from_numpy(a.copy()) for a in step] for step in od.read_batches(job["batches"])]
    count = [0]

    def once() -> list[float]:
        x, labels = batches[count[0] % len(batches)]
        count[0] += 1
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        return [float(loss)]

    return steps_bench.timed(once, job, losses_kept=3)


def _graphforge_child(job: dict) -> dict:
    """graphforge's Module in this (fresh) process, its update the program's ONNX one (as the
    JavaScript runtime runs it) or the Module's default (torch's fused kernel where exact)."""
    import graphforge

    batches = od.read_batches(job["batches"])
    module = graphforge.Module(
        job["program"], device="cpu", intra_op_threads=job["threads"], inter_op_threads=1, update=job["update"]
    )
    count = [0]

    def once() -> list[float]:
        count[0] += 1
        return [float(module.train_step(*batches[(count[0] - 1) % len(batches)]))]

    return steps_bench.timed(once, job, losses_kept=3)


def _child(flag: str, job: dict) -> dict:
    """This file with ``flag`` JOB in a fresh process: its reply."""
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, __file__, flag, json.dumps(job)], capture_output=True, text=True, timeout=900, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-600:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _torch(job: dict) -> dict:
    return _child("--torch", job)


def _python(job: dict) -> dict:
    return _child("--graphforge", {**job, "update": "onnx"})


def _python_fused(job: dict) -> dict:
    return _child("--graphforge", {**job, "update": "auto"})


def _profile(job: dict) -> dict:
    """Where graphforge Python's step goes: onnxruntime's profile of a few steps, by part and op type."""
    return _child("--profile", job)


def _profile_child(job: dict) -> dict:
    import graphforge
    from graphforge.train.profiling import summarize_traces

    batches = od.read_batches(job["batches"])
    module = graphforge.Module(
        job["program"], device="cpu", intra_op_threads=job["threads"], inter_op_threads=1, update="onnx"
    )
    for batch in batches:
        module.train_step(*batch)
    with tempfile.TemporaryDirectory(prefix="transfer-bench-profile-") as tmp:
        module.start_profiling(Path(tmp) / "step")
        for i in range(PROFILE_STEPS + 1):  # each profiled session's first run is left out
            module.train_step(*batches[i % len(batches)])
        summary = summarize_traces([path for path, _ in module.end_profiling()])
    return {"by_part": dict(summary.by_part), "by_op": dict(summary.by_op)}


#: issue 59's goals: Python's step against torch eager's, onnxruntime-node's against Python's
GOAL_SPEEDUP, GOAL_NODE = 1.5, 1.1
PYTHON, NODE = "graphforge Python", "graphforge JS onnxruntime-node"
PYTHON_ONNX = "graphforge Python, the program's ONNX update (as the JS runtime runs it)"
#: (label, how it runs, its JS backend, its artifact folder)
SIDES = (
    ("torch eager", _torch, None, None),
    (PYTHON, _python_fused, None, None),
    (PYTHON_ONNX, _python, None, None),
    (NODE, steps_bench._node, "node", "artifacts"),
    ("graphforge JS onnxruntime-node, frozen weights as inputs", steps_bench._node, "node", "artifacts-inputs"),
    ("graphforge JS onnxruntime-web wasm (Node)", steps_bench._node, "web", "artifacts"),
)


def measure(quick: bool, cache: Path = CACHE) -> dict:
    """Each side's fastest run of ``ROUNDS`` (taken in turn), the load before and after, the profile."""
    config = QUICK if quick else FULL
    common = prepare(config, cache / ("quick" if quick else "full"))
    timing = {"warmupSeconds": 0.2 if quick else 1.5, "blockSeconds": 0.1 if quick else 1.0, "blocks": 3}
    js = steps_bench.unavailable()
    load = [os.getloadavg()]
    rows: dict[str, dict] = {}
    for _ in range(1 if quick else ROUNDS):
        for label, run, backend, folder in SIDES:
            if backend is not None and js is not None:
                rows[label] = {"error": js}
                continue
            job = {**common, **timing, "threads": THREADS, "k": 1, "backend": backend}
            if folder is not None:
                job["artifacts"] = str(Path(common["program"]).parent / folder)
            try:
                done = run(job)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                done = {"error": str(exc)[:300]}
            kept = rows.get(label)
            if kept is None or "error" in kept or ("blocks" in done and _ms(done) < _ms(kept)):
                rows[label] = done
    load.append(os.getloadavg())
    profile = _profile({**common, "threads": THREADS})
    return {"config": asdict(config), "values": common["values"], "rows": rows, "load": load, "profile": profile}


def _ms(result: dict | None) -> float | None:
    return statistics.median(result["blocks"]) if result and "blocks" in result else None


def report(results: dict) -> str:
    config = Config(**results["config"])
    rows = results["rows"]
    torch_ms, python_ms = _ms(rows.get("torch eager")), _ms(rows.get(PYTHON))
    (before, *_), (after, *_) = results["load"]
    lines = [
        f"{config.label}; features.0–{len(frozen_globs(config)) - 1} frozen, the last {config.trained} features and "
        f"the classifier trained; AdamW; {THREADS} intra-op thread a side, each side the fastest of {ROUNDS} rounds "
        f"taken in turn; load average {before:.1f} before, {after:.1f} after ({helpers.usable_cores()} cores, "
        f"{helpers.cpu_name()}); onnxruntime {helpers.version('onnxruntime')}, torch {helpers.version('torch')}.",
        "",
        "| side | ms a step | samples/s | × torch eager | step / Python's |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, result in rows.items():
        ms = _ms(result)
        if ms is None:
            lines.append(f"| {label} | failed | | | |")
            continue
        speed = f"{torch_ms / ms:.2f}×" if torch_ms else "-"
        versus = f"{ms / python_ms:.2f}×" if python_ms and label != "torch eager" else "-"
        lines.append(f"| {label} | {ms:.1f} | {config.batch / ms * 1e3:,.1f} | {speed} | {versus} |")
    lines += ["", _goals(torch_ms, python_ms, _ms(rows.get(PYTHON_ONNX)), _ms(rows.get(NODE))), ""]
    firsts = "; ".join(
        f"{label} {', '.join(f'{x:.5f}' for x in r['losses'][:3])}" for label, r in rows.items() if "losses" in r
    )
    lines.append(f"First losses: {firsts}.")
    lines += ["", *_profile_lines(results["profile"], results["values"])]
    errors = [f"{label}: {r['error']}" for label, r in rows.items() if "error" in r]
    return "\n".join([*lines, *(["", *errors] if errors else [])]) + "\n"


def _goals(torch_ms: float | None, python_ms: float | None, onnx_ms: float | None, node_ms: float | None) -> str:
    """Issue 59's two goals, each with its measured ratio and whether it is met."""
    if not (torch_ms and python_ms and onnx_ms and node_ms):
        return "Goals: not measured (a side failed)."
    met = {True: "met", False: "missed"}
    speed, node, same = torch_ms / python_ms, node_ms / python_ms, node_ms / onnx_ms
    return (
        f"Goals: graphforge Python ≥ {GOAL_SPEEDUP}× torch eager: {speed:.2f}× ({met[speed >= GOAL_SPEEDUP]}; "
        f"{torch_ms / onnx_ms:.2f}× with the program's ONNX update); graphforge JS on onnxruntime-node within "
        f"{GOAL_NODE}× of Python's step: {node:.2f}× ({met[node <= GOAL_NODE]}), {same:.2f}× of Python's step with "
        "the same ONNX update."
    )


def _profile_lines(profile: dict, values: dict, top: int = 6) -> list[str]:
    """The profile of Python's step with the ONNX update (shares of its kernel time: the
    profiler's own cost and the machine's load inflate its milliseconds), and what it says."""
    total = sum(profile["by_part"].values()) or 1.0
    share = {part: value / total for part, value in profile["by_part"].items()}
    parts = ", ".join(f"{p} {v:.0%}" for p, v in sorted(share.items(), key=lambda kv: -kv[1]))
    ops = sorted(profile["by_op"].items(), key=lambda kv: -kv[1])[:top]
    return [
        f"Where graphforge Python's step with the ONNX update goes (onnxruntime's profile of {PROFILE_STEPS} "
        f"steps, shares of the kernel time): {parts}; by op type: {', '.join(f'{op} {v / total:.0%}' for op, v in ops)}.",
        "",
        f"The optimizer's share is AdamW's elementwise ops over the {values['trained']:,} trained values (frozen: "
        f"{values['frozen']:,}), each a pass over memory; the Module's default update runs torch's fused AdamW "
        "kernel over the same buffers instead (the difference between the two Python rows), which the JavaScript "
        "runtime has no counterpart of: that is its step's distance from Python's. The forward is mostly the "
        "frozen backbone's convolutions (constants: BatchNorm folded, NCHWc blocks); the backward's ConvTranspose "
        "and Conv are the trained convolutions' input and weight gradients, in the formulation issue 59's item 1 "
        "is changing.",
    ]


def run(quick: bool) -> str:
    return report(measure(quick))


if __name__ == "__main__":
    children = {"--torch": _torch_child, "--graphforge": _graphforge_child, "--profile": _profile_child}
    if len(sys.argv) > 2 and sys.argv[1] in children:
        print(json.dumps(children[sys.argv[1]](json.loads(sys.argv[2]))))
    else:
        print(run("--quick" in sys.argv))
