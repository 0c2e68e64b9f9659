"""Peak memory of a training step: graphforge (parameters and optimizer states in place, with
two buffers each, and in place with each RECOMPUTE setting) beside PyTorch eager (plain and
with a checkpoint per block), each measured in a process of its own, and graphforge's
prediction (graphforge.placement.step_memory.step_memory) beside its measurement.

What is measured: the peak resident memory (VmHWM) of a fresh child process during model
setup and training steps, above its resident memory after its imports (the peak is reset
there through /proc/self/clear_refs). onnxruntime's Python API exposes no allocator
statistics, and its CPU arena reserves address space in doubling regions of which only the
touched pages are resident, so resident memory is what the step uses, and what a user
sees. The same window for torch: its module, AdamW, the steps.

    python benchmarks/run.py memory
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import helpers  # noqa: E402  (what the benchmarks share)
import train_bench as tb  # noqa: E402  (the models, their export and the optimizer settings)

TITLE = "Memory"
CACHE = helpers.cache("memory")
STEPS = 6  # the first step makes the sessions and fills the arena; the peak is over all
TIMEOUT_S = 1200
MIB = 2**20

FULL = [
    tb.Spec("gpt2", "GPT-2 2×256, vocab 50257", 8, tb.FULL[2].config, steps=STEPS),
    tb.Spec("gpt2", "GPT-2 small 12×768, vocab 50257", 8, tb.GPT2_SMALL, steps=STEPS),
    # the case recomputation is for: at 8 × 64 the logits and the optimizer's temporaries are
    # most of what is not held for good; at 512 positions the saved activations are
    tb.Spec(
        "gpt2", "GPT-2 small 12×768, vocab 50257, batch 2 × seq 512", 2, {**tb.GPT2_SMALL, "seq": 512}, steps=STEPS
    ),
]
QUICK = [tb.QUICK[2]]


def _resident_mib(key: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(job: dict) -> dict:
    """In the child: set up, train ``steps`` steps, and report the peak above the mark."""
    import torch  # imported before the mark on both sides: its libraries are not the step's

    import graphforge.runtime as runtime

    threads = job["threads"]
    torch.set_num_threads(threads)
    data = np.load(job["batches"])
    batches = [(data[f"x{i}"], data[f"y{i}"]) for i in range(len(data.files) // 2)]
    Path("/proc/self/clear_refs").write_text("5")
    mark = _resident_mib()
    if job["side"] == "torch":
        spec = tb.Spec(**job["spec"])
        module = tb.build_torch(spec).train()
        if job.get("checkpoint"):  # torch.utils.checkpoint around each block, as transformers does it
            module.inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        step = tb.torch_adamw_step(module)
    else:
        module = runtime.Module(
            job["program"],
            device="cpu",
            intra_op_threads=threads,
            inter_op_threads=1,
            in_place=job["in_place"],
            update="onnx",  # the program's update in both layouts: the rows compare the buffers alone
        )

        def step(x, y):
            return float(module.train_step(x, y))

    times, cpu_times, losses = [], [], []
    for i in range(job["steps"]):
        x, y = batches[i % len(batches)]
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step(x, y))
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return {
        "peak_mib": _resident_mib("VmHWM") - mark,
        "step_s": statistics.median(times[1:]),
        "step_cpu_s": statistics.median(cpu_times[1:]),
        "losses": losses,
    }


def measure(job: dict, timeout: float = TIMEOUT_S) -> dict:
    """Run ``job`` (see ``child``) in a fresh process and return what it reports."""
    return tb.run_child(__file__, job, timeout=timeout)


def graphforge_job(program: Path, batches: Path, *, in_place: bool, threads: int = 2, steps: int = STEPS) -> dict:
    return {
        "side": "graphforge",
        "program": str(program),
        "batches": str(batches),
        "in_place": in_place,
        "threads": threads,
        "steps": steps,
    }


#: the recompute settings measured, beside no recomputation (budget 1.0): on GPT-2 small at
#: 512 positions, 0.5 recomputes no GEMM, 0.25 attention's two MatMuls, 0.15 half the layers'
#: Gemms too, 0 all of them
RECOMPUTE = ("budget=0.5", "budget=0.25", "budget=0.15", "budget=0", "level=1")
#: the issue's goal for recomputation: this share of the activation memory saved ...
GOAL_SAVED = 0.5
#: ... for at most this much more step time
GOAL_SLOWER = 0.2


#: the ops whose FLOPs the recomputation's cost is counted in (a step's time is mostly theirs)
GEMM_OPS = frozenset({"MatMul", "Gemm", "FusedMatMul", "Conv", "ConvTranspose"})


def recomputed_share(program, dims: dict[str, int]) -> float:
    """The GEMM FLOPs of the nodes ``recompute`` added, as a share of the step's: the work it
    adds, counted, where the step's time is measured on a machine others share."""
    from graphforge.analysis.cost import model_flops
    from graphforge.graph import Model
    from graphforge.roles import node_origin

    model = Model.from_proto(program)
    flops = model_flops(model, dims)
    gemm = [n for n in model.graph.nodes if n.op in GEMM_OPS]
    total = sum(flops[id(n)] for n in gemm)
    again = sum(flops[id(n)] for n in gemm if (node_origin(n.name or "") or ("",))[0] == "recompute")
    return again / total if total else 0.0


def run(quick: bool = False) -> str:
    """Each model: graphforge in place (no recomputation), with two buffers, and in place with
    each RECOMPUTE setting, beside torch eager and torch with a checkpoint per block. The
    activation memory of a row is its peak less the memory every side holds for good (the
    parameters, AdamW's two states and the gradients, as graphforge's model counts them)."""
    from dataclasses import asdict

    import onnx

    import graphforge
    from graphforge.analysis.memory import dims_of
    from graphforge.placement.step_memory import step_memory

    started = time.time()
    rows, notes, pareto = [], [], []
    for spec in QUICK if quick else FULL:
        folder = CACHE / f"{spec.label.split(',')[0].replace(' ', '_').replace('×', 'x')}-b{spec.batch}"
        _, program, batches, _ = tb.prepare(spec, folder)
        data = np.load(batches)
        dims = dims_of(
            onnx.load(str(program), load_external_data=False), {"input_ids": data["x0"], "labels": data["y0"]}
        )
        results = {}  # label -> (measured, predicted MiB or None)
        shares = {"graphforge, in place": 0.0}  # label -> recomputed_share
        predictions = {in_place: step_memory(program, dims=dims, in_place=in_place) for in_place in (True, False)}
        for label, in_place in (("graphforge, in place", True), ("graphforge, two buffers", False)):
            measured = measure(graphforge_job(program, batches, in_place=in_place))
            results[label] = (measured, predictions[in_place].peak / MIB)
        persistent = predictions[True].persistent  # one copy of each tensor, as torch holds them
        held_mib = sum(persistent.get(k, 0) for k in ("parameters", "optimizer states", "gradients")) / MIB
        sized = ", ".join(f'"{k}={v}"' for k, v in dims.items())
        for setting in RECOMPUTE:
            compiled = graphforge.compile(
                str(folder / "model.onnx"), f"{tb.PIPELINE}, recompute({setting}, dims=[{sized}])"
            ).model
            path = graphforge.save(compiled, folder / f"program-recompute-{setting.replace('=', '')}.onnx")
            predicted = step_memory(compiled, dims=dims)
            results[f"in place, recompute({setting})"] = (
                measure(graphforge_job(path, batches, in_place=True)),
                predicted.peak / MIB,
            )
            shares[f"in place, recompute({setting})"] = recomputed_share(compiled, dims)
        for label, checkpoint in (("torch eager", False), ("torch eager, checkpoint per block", True)):
            torch_job = {
                "side": "torch",
                "spec": asdict(spec),
                "batches": str(batches),
                "threads": 2,
                "steps": STEPS,
                "checkpoint": checkpoint,
            }
            results[label] = (measure(torch_job), None)
        torch_peak = results["torch eager"][0]["peak_mib"]
        base = results["graphforge, in place"][0]
        base_activations = base["peak_mib"] - held_mib
        for label, (measured, predicted) in results.items():
            error = "—" if predicted is None else f"{predicted:.0f} ({predicted / measured['peak_mib'] - 1:+.0%})"
            activations = measured["peak_mib"] - held_mib
            rows.append(
                f"| {spec.label} | {label} | {measured['peak_mib']:.0f} | {error} | "
                f"{measured['peak_mib'] / torch_peak:.2f}× | {activations:.0f} | "
                f"{measured['step_s'] * 1000:.0f} | {measured['step_cpu_s'] * 1000:.0f} |"
            )
            if label.startswith("in place, recompute") or label == "graphforge, in place":
                saved = 1 - activations / base_activations
                slower = measured["step_s"] / base["step_s"] - 1
                more_cpu = measured["step_cpu_s"] / base["step_cpu_s"] - 1
                met = saved >= GOAL_SAVED and max(slower, more_cpu, shares[label]) <= GOAL_SLOWER
                pareto.append(
                    f"| {spec.label} | {label.removeprefix('in place, ').removeprefix('graphforge, ')} | "
                    f"{saved:.0%} | {slower:+.0%} | {more_cpu:+.0%} | +{shares[label]:.0%} | "
                    f"{'**yes**' if met else 'no'} |"
                )
        eager, checkpointed = results["torch eager"][0], results["torch eager, checkpoint per block"][0]
        notes.append(
            f"- {spec.label}: torch's checkpoint per block saves "
            f"{1 - (checkpointed['peak_mib'] - held_mib) / (eager['peak_mib'] - held_mib):.0%} of torch's activation "
            f"memory for {checkpointed['step_s'] / eager['step_s'] - 1:+.0%} step time"
        )
        first = {label: r[0]["losses"][0] for label, r in results.items()}
        notes.append(f"- {spec.label}: first losses " + ", ".join(f"{k} {v:.4f}" for k, v in first.items()))
        notes.append(f"- {spec.label}: held for good by every side: {held_mib:.0f} MiB")
        least, predicted_base = results["in place, recompute(budget=0)"], results["graphforge, in place"][1]
        notes.append(
            f"- {spec.label}: recompute(budget=0) by the memory model saves "
            f"{1 - (least[1] - held_mib) / (predicted_base - held_mib):.0%} of the activation memory, measured "
            f"{1 - (least[0]['peak_mib'] - held_mib) / base_activations:.0%}"
        )
    body = [
        "Peak resident memory of a process setting up and training "
        f"{STEPS} steps (AdamW, 2 threads; batch 8 × sequence 64 in the full run unless the row says otherwise), "
        "above the process's memory "
        "after its imports; graphforge's prediction (`graphforge inspect --memory`) beside it. Each side in a "
        "fresh process. Activations: the peak less what every side holds for good (parameters, AdamW's two "
        "states, gradients). Step time: the median of the steps after the first, in a process that also "
        "measures memory: it moves by up to 2× between runs on a shared 2-core machine (the Training step "
        "section times steps properly). Step CPU: the median of the process's CPU time per step, the work "
        "done (an in-place Module's threads do not spin between runs, so waiting is not in it); other work "
        "on the machine moves it too, through the caches and cores it shares.",
        "",
        "| model | side | peak MiB | predicted MiB (error) | × torch eager | activations MiB | step ms (median) "
        "| step CPU ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"Recomputation's trade (the issue's goal: ≥ {GOAL_SAVED:.0%} of the activation memory saved for "
        f"≤ {GOAL_SLOWER:.0%} more step time), against graphforge in place without it. The step's wall and "
        "CPU time are measured on a machine others share and move by tens of percent between runs, so the "
        "work recomputation adds is also counted: the GEMM FLOPs of the recomputed nodes as a share of the "
        "step's. A setting meets the goal only if all three are within it:",
        "",
        "| model | setting | activation memory saved | step time | step CPU time | GEMM FLOPs recomputed "
        "| meets the goal |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
        *pareto,
        "",
        *notes,
        "",
        f"Machine: {tb.platform.processor() or tb.platform.machine()}, graphforge {graphforge.__version__}; "
        f"this benchmark took {time.time() - started:.0f} s.",
    ]
    return "\n".join(body)


if __name__ == "__main__":
    tb.child_main(child, run)
