"""Training on a CUDA GPU: graphforge's step (``Module`` on onnxruntime's CUDA provider: its
sessions captured as CUDA graphs, the update in torch's fused kernel, as a Module picks by
default) beside PyTorch eager and torch.compile on the same GPU, with AdamW: GPT-2 small at
8 × 64 in float32, at 16 × 256 in float16 and bfloat16 (graphforge's ``mixed_precision`` beside
torch's AMP, eager and compiled), and ResNet-18 at 16 × 3 × 64 × 64 with BatchNorm in training
mode. graphforge without capture is a row of its own on the float32 models. Each side runs in
a fresh process.

Step time: the median over the timed steps after the warm-up; a step ends when its loss is a
Python float, which waits for the GPU on both sides. The batch starts on the host for both.

Device memory: what the GPU has in use (NVML, for the whole device: the measured process is its
only user) at its highest during setup and the steps, above what it had once the process's CUDA
context was made (torch: a one-element tensor; graphforge: a one-node session on the CUDA
provider). Both allocators keep what they take (torch's caching allocator, onnxruntime's BFC
arena), so this is what each side holds, slack included, as ``nvidia-smi`` shows it; torch's
``max_memory_allocated`` (its live tensors alone) is given beside it.

TF32: graphforge asks onnxruntime's CUDA provider for full float32 (``use_tf32=0``, its default
there; see graphforge.runtime.sessions.cuda_defaults), as torch's matmuls are by default (torch's
cuDNN convolutions may use TF32); the row "TF32" is graphforge with ``GRAPHFORGE_TF32=1``. The
first losses of every side are printed, so the difference shows.

    python benchmarks/run.py cuda     # where onnxruntime's CUDA provider works; elsewhere it is skipped
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import helpers  # noqa: E402  (what the benchmarks share)
import train_bench as tb  # noqa: E402  (the models, their export and the optimizer settings)

TITLE = "CUDA"
CACHE = helpers.cache("cuda")
TIMEOUT_S = 600
MIB = 2**20
#: $GRAPHFORGE_BENCH_DEVICE=cpu runs the same measurement on the CPU (to try the script out)
DEVICE = os.environ.get("GRAPHFORGE_BENCH_DEVICE", "cuda")

GPT2_SMALL = tb.Spec("gpt2", "GPT-2 small 12×768, 8 × 64", 8, tb.GPT2_SMALL, steps=30, warmup=tb.CHECK_STEPS + 1)
GPT2_SMALL_LONG = tb.Spec(
    "gpt2", "GPT-2 small 12×768, 16 × 256", 16, {**tb.GPT2_SMALL, "seq": 256}, steps=20, warmup=tb.CHECK_STEPS + 1
)
#: (model, precision: None for float32, else mixed_precision's and torch autocast's dtype), the
#: issue's rows in the order they matter, so that a GPU lease cut short still has the first
FULL = [
    (GPT2_SMALL, None),
    (GPT2_SMALL_LONG, "float16"),
    (GPT2_SMALL_LONG, "bfloat16"),
    (replace(tb.RESNET18, label="ResNet-18 16 × 3×64×64", steps=30), None),
]
#: the GPU check's (make cuda-check, within its 8 minutes): the row the goal is set on; a CPU
#: trial (GRAPHFORGE_BENCH_DEVICE=cpu) runs a tiny GPT-2 in both precisions instead
QUICK = [(GPT2_SMALL, None)] if DEVICE == "cuda" else [(tb.QUICK[2], None), (tb.QUICK[2], "float16")]
#: $GRAPHFORGE_BENCH_ROWS="2,3": only those rows of FULL (from 1), for a GPU lease too short for all
ROWS = os.environ.get("GRAPHFORGE_BENCH_ROWS", "")


def chosen(quick: bool) -> list[tuple[tb.Spec, str | None]]:
    """The rows this run measures."""
    if quick:
        return QUICK
    if not ROWS.strip():
        return FULL
    try:
        return [FULL[int(i) - 1] for i in ROWS.split(",") if i.strip()]
    except (ValueError, IndexError):
        raise SystemExit(f"$GRAPHFORGE_BENCH_ROWS={ROWS!r}: name rows 1 to {len(FULL)}, e.g. 2,3") from None


def unavailable() -> str | None:
    """Why this benchmark cannot run here (None when it can)."""
    if DEVICE != "cuda":
        return None
    from graphforge.runtime.sessions import CUDA, provider_works

    return None if provider_works(CUDA) else "onnxruntime's CUDA provider does not work on this machine"


class DeviceMemory:
    """The GPU's memory in use (NVML, else ``nvidia-smi``), and its highest value while ``watch`` runs."""

    def __init__(self):
        try:
            import pynvml  # nvidia-ml-py: present where a CUDA torch is

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.used = lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:  # no NVML binding: the allocators keep what they take, so a slower poll sees the peak
            self.used = _smi_used
        self.base = self.highest = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, every_s: float = 0.002) -> None:
        def poll():
            while not self._stop.is_set():
                self.highest = max(self.highest, self.used())
                time.sleep(every_s)

        self.base = self.highest = self.used()
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.highest = max(self.highest, self.used())
        return self.highest


def _watch(device: str) -> DeviceMemory | None:
    """The device's memory, marked now (the CUDA context made) and watched from here on."""
    if device != "cuda":
        return None
    memory = DeviceMemory()
    memory.watch()
    return memory


def _rss() -> int:
    """The process's resident memory now, in bytes (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _smi_used() -> int:
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.strip()) * MIB


def _relu_model() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "context",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def child(job: dict) -> dict:
    """In the child: make the CUDA context, mark the device's memory, set up, train, report."""
    device = job["device"]
    data = np.load(job["batches"])
    batches = [(data[f"x{i}"], data[f"y{i}"]) for i in range(len(data.files) // 2)]
    spec = tb.Spec(**job["spec"])
    extra = {}
    if job["side"] == "torch":
        import torch

        torch.zeros(1, device=device)
        rss_before = _rss()
        memory = _watch(device)
        module = tb.build_torch(spec).to(device).train()
        extra["state_mib"] = (memory.used() - memory.base) / MIB if memory else None
        if job.get("checkpoint"):  # torch.utils.checkpoint around each block, as transformers does it
            module.inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # torch.compile's default mode (inductor; Triton kernels on CUDA), compiled in the warm-up;
        # a backend named instead (the CPU smoke test's "aot_eager": dynamo and AOT autograd
        # without inductor's C++ build, which takes 20 s on 2 cores)
        backend = job.get("compile")
        forward = (
            torch.compile(module, backend=backend if isinstance(backend, str) else "inductor") if backend else None
        )
        step = tb.torch_adamw_step(module, device, forward=forward, autocast=job.get("autocast"))

        def finish():
            if device == "cuda":
                extra["torch_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
    else:
        import graphforge.runtime as runtime
        from graphforge.runtime import sessions
        from graphforge.runtime.sessions import CPU, CUDA, create_session

        sessions.CUDA_DEFAULT_OPTIONS.update(job.get("cuda_options", {}))

        context = create_session(_relu_model(), providers=[CUDA, CPU] if device == "cuda" else [CPU])
        context.run(None, {"x": np.ones(4, np.float32)})
        rss_before = _rss()
        memory = _watch(device)
        module = runtime.Module(job["program"], device=device, in_place=True, capture=job.get("capture"))
        extra["state_mib"] = (memory.used() - memory.base) / MIB if memory else None

        def step(x, y):
            return float(module.train_step(x, y))

        def finish():
            extra["providers"] = module.runner.device.providers[0]
            extra["update"] = module.update_note.removeprefix("update: ")
            extra["uncaptured"] = dict(module.runner.capture_refused)

    losses, times = [], []
    start = time.perf_counter()
    for i in range(spec.warmup):
        x, y = batches[i % len(batches)]
        losses.append(step(x, y))
    extra["setup_s"] = time.perf_counter() - start
    for i in range(spec.steps):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    finish()
    q1, _, q3 = statistics.quantiles(times, n=4)
    peak = (memory.stop() - memory.base) / MIB if memory else None
    if memory is None:  # the CPU: the process's peak resident memory above what it held before setup
        extra["peak_rss_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before) / MIB
    return {"peak_mib": peak, "step_s": statistics.median(times), "iqr_s": q3 - q1, "losses": losses, **extra}


def measure(job: dict, timeout: float = TIMEOUT_S) -> dict:
    """Run ``job`` (see ``child``) in a fresh process and return what it reports."""
    env = {k: v for k, v in os.environ.items() if k not in ("GRAPHFORGE_PROVIDERS", "GRAPHFORGE_TF32")}
    if job.get("tf32"):
        env["GRAPHFORGE_TF32"] = "1"
    try:
        return tb.run_child(__file__, job, timeout=timeout, env=env)
    except RuntimeError as exc:
        return {"error": str(exc)}


def sides(precision: str | None) -> list[tuple[str, dict]]:
    """(label, job settings) of each side of a row; the first torch side is the row's "torch
    eager" reference, the last its torch.compile one."""
    if precision is None:
        return [
            (
                "graphforge",
                {"side": "graphforge", "capture": True},
            ),  # (the CUDA default; a CPU trial runs the mode too)
            ("graphforge, capture off", {"side": "graphforge", "capture": False}),
            ("torch eager", {"side": "torch"}),
            ("torch.compile", {"side": "torch", "compile": True}),
        ]
    amp = "autocast + GradScaler" if precision == "float16" else "autocast"
    return [
        (f"graphforge, mixed_precision({precision})", {"side": "graphforge", "precision": precision, "capture": True}),
        (f"torch eager, {amp}({precision})", {"side": "torch", "autocast": precision}),
        (f"torch.compile, {amp}({precision})", {"side": "torch", "compile": True, "autocast": precision}),
    ]


def _program(folder: Path, model: Path, program: Path, precision: str | None) -> Path:
    if precision is None:
        return program
    import graphforge

    provider = "cuda" if DEVICE == "cuda" else "cpu"
    pipeline = f"{tb.PIPELINE}, mixed_precision(dtype={precision}, provider={provider})"
    return graphforge.save(graphforge.compile(str(model), pipeline).model, folder / f"program-{precision}.onnx")


def run(quick: bool = False) -> str:
    import graphforge

    # the compiles here verify their passes on the CPU: the GPU is left to the measured processes
    os.environ["GRAPHFORGE_PROVIDERS"] = "cpu"
    rows, notes = [], []
    for spec, precision in chosen(quick):
        folder = CACHE / f"{re.sub(r'[^0-9A-Za-z]+', '_', spec.label)}-b{spec.batch}"
        print(f"  {spec.label} {precision or 'float32'}: export and compile", flush=True)
        model, program, batches, _ = tb.prepare(spec, folder)
        results = {}
        for label, side in sides(precision):
            job = {**side, "spec": asdict(spec), "batches": str(batches), "device": DEVICE}
            if side["side"] == "graphforge":
                job["program"] = str(_program(folder, model, program, precision))
            results[label] = measure(job)
            print(f"  {spec.label}: {label}: {json.dumps(results[label])[:300]}", flush=True)
        labels = [label for label, _ in sides(precision)]
        ours, torch_side, compiled = results[labels[0]], results[labels[-2]], results[labels[-1]]
        spec = replace(spec, label=f"{spec.label}, {precision or 'float32'}")
        for label, r in results.items():
            if "error" in r:
                rows.append(f"| {spec.label} | {label} | failed: {' '.join(r['error'].split())[-200:]} | | | | | |")
                continue
            speed = f"{torch_side['step_s'] / r['step_s']:.2f}×" if "step_s" in torch_side else "—"
            vs_compiled = f"{compiled['step_s'] / r['step_s']:.2f}×" if "step_s" in compiled else "—"
            peak = "—" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
            vs = (
                f"{r['peak_mib'] / torch_side['peak_mib']:.2f}×"
                if r["peak_mib"] is not None and torch_side.get("peak_mib")
                else "—"
            )
            allocated = f"{r['torch_allocated_mib']:.0f}" if "torch_allocated_mib" in r else "—"
            rows.append(
                f"| {spec.label} | {label} | {r['step_s'] * 1000:.2f} ± {r['iqr_s'] * 1000 / 2:.2f} | {speed} | "
                f"{vs_compiled} | "
                f"{peak} | {vs} | {allocated} |"
            )
        notes.append(tb.first_losses(spec.label, results))
        if "setup_s" in ours:
            uncaptured = "; ".join(f"{k}: {v}" for k, v in ours.get("uncaptured", {}).items()) or "none"
            notes.append(
                f"- {spec.label}: setup and {spec.warmup} warm-up steps took {ours['setup_s']:.1f} s (graphforge, "
                f"{ours.get('providers')}), {torch_side.get('setup_s', float('nan')):.1f} s (torch); graphforge's "
                f"update: {ours.get('update')}; sessions not captured: {uncaptured}"
            )
    body = [
        f"Training steps on {_device_name()}: graphforge's `Module.train_step` on onnxruntime's CUDA provider "
        "(its sessions captured as CUDA graphs, the update in torch's fused kernel: the Module's defaults; "
        "“capture off”: `Module(capture=False)`) beside PyTorch eager and torch.compile (its default mode, "
        "compiled during the warm-up) on the same GPU, AdamW; the float16 and bfloat16 rows: graphforge's "
        "`mixed_precision` program beside torch's AMP recipe, eager and compiled, whose ratio columns they "
        "are read against. Device memory: the GPU's memory in use (NVML) at its highest, above its use once "
        "the process's CUDA context was made; torch's `max_memory_allocated` beside it. Each side in a fresh "
        "process. Goal (issue 39): ≥ 1.2× torch.compile on GPT-2 small 8 × 64 float32, ≥ 1.0× on every "
        "other row, device memory ≤ torch eager's.",
        "",
        "| model | side | step ms (median ± IQR/2) | × torch eager speed | × torch.compile speed | device MiB | "
        "× torch eager | torch allocated MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        *notes,
        "",
        f"graphforge {graphforge.__version__}, onnxruntime {helpers.version('onnxruntime')}, torch {helpers.version('torch')}.",
    ]
    return "\n".join(body)


def _device_name() -> str:
    if DEVICE != "cuda":
        return "the CPU (a trial run: GRAPHFORGE_BENCH_DEVICE=cpu)"
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        name, driver = done.stdout.strip().splitlines()[0].rsplit(", ", 1)
        return f"one {name} (driver {driver})"
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return "one CUDA GPU"


if __name__ == "__main__":
    tb.child_main(child, run)
