"""LoRA fine-tuning benchmark: graphforge's ``lora`` pass on onnxruntime beside torch eager with
PEFT, on a Qwen2-style decoder at Qwen2-0.5B's shapes (random weights), on the CPU.

The model: transformers' Qwen2ForCausalLM with Qwen2-0.5B's sizes (24 layers, 896 wide, 14 heads,
2 key-value heads, MLP 4,864, vocabulary 151,936, tied embedding; 494 M parameters), seeded,
eager attention, logits flattened to [batch · seq, vocab]; batch 4 × 256 tokens of fixed random
ids and labels. LoRA r = 16, alpha 32, on all linear layers but the output head (PEFT's
``target_modules="all-linear"``), no dropout; AdamW (train_bench's lr, betas, eps, weight decay)
on the adapters alone. B starts at zero on both sides, so the first losses must agree.

Sides, each in a fresh process of its own, one after the other:

* torch eager + PEFT: ``get_peft_model(model, LoraConfig(...))``, cross-entropy, backward, AdamW;
* graphforge: the model exported once by TorchScript (opset 17), compiled with ``lora(r=16,
  alpha=32), loss(...), autodiff, adamw(...)`` (the base frozen: constants of the session), run
  with ``Module.train_step``; where the ``quantize_frozen`` pass exists, also with the frozen base
  stored as int8 and as int4 (blocks of 32) — PEFT keeps its float32 base on every row (its 8- and
  4-bit bases need bitsandbytes, whose CPU kernels this machine's wheel lacks).

Per side: tokens a second (median of the timed steps), the process's peak resident memory
(``ru_maxrss``: the model, its state, the steps and the imports), the seconds from the process's
start to the end of its first step (imports, loading, session or module building, the step), and
the bytes of a resumable checkpoint (graphforge: ``state.save``; PEFT: ``save_pretrained`` plus
``torch.save`` of the optimizer's state). The export and compile, done once before, are timed apart.

    python benchmarks/lora_bench.py            # prints the markdown section
    python benchmarks/run.py lora              # writes it into docs/benchmarks.md
"""

from __future__ import annotations

import time

START = time.perf_counter()  # a side's clock starts before its imports

import os  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers  # noqa: E402
import train_bench  # noqa: E402

TITLE = "LoRA fine-tuning"
CACHE = helpers.cache("lora")
R, ALPHA = 16, 32
#: the issue's goals: tokens a second against PEFT's, and peak memory with the int4 base
SPEED_GOAL, MEMORY_GOAL = 1.3, 0.5
QWEN2_05B = {**helpers.QWEN2_05B, "seq": 256}
FULL = train_bench.Spec("qwen2", "Qwen2-0.5B shapes, batch 4 × 256", 4, QWEN2_05B, steps=3, warmup=1)
QUICK = train_bench.Spec(
    "qwen2",
    "Qwen2 2×64, vocab 256, batch 2 × 32",
    2,
    {**QWEN2_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    | {"vocab_size": 256, "seq": 32},
    steps=5,
    warmup=1,
)
#: graphforge's rows: (label, the passes between lora and the loss, the passes after the optimizer)
ROWS = [
    ("float32 base", "", ""),
    ("int8 base", "quantize_frozen(bits=8, block=32), ", ""),
    ("int4 base", "quantize_frozen(bits=4, block=32), ", ""),
    ("int4 base, recompute(level=1)", "quantize_frozen(bits=4, block=32), ", ", recompute(level=1)"),
]
TIMEOUT_S = 3600


def pipeline(between: str, after: str) -> str:
    lr, (b1, b2), eps, wd = train_bench.LR, train_bench.BETAS, train_bench.EPS, train_bench.WEIGHT_DECAY
    return (
        f"lora(r={R}, alpha={ALPHA}), {between}loss(kind=cross_entropy, output=logits), autodiff, "
        f"adamw(lr={lr}, beta1={b1}, beta2={b2}, eps={eps}, weight_decay={wd}){after}"
    )


def quantization_available() -> bool:
    from graphforge.passes import REGISTRY

    return "quantize_frozen" in REGISTRY


def prepare(spec: train_bench.Spec, folder: Path) -> dict:
    """The batches file, and per row its compiled program with the seconds its export and
    compile took (run in a process of its own: the parent stays small while the sides run)."""
    import torch

    import graphforge

    folder.mkdir(parents=True, exist_ok=True)
    batches = folder / "batches.npz"
    pairs = train_bench.make_batches(spec, count=2)
    np.savez(
        batches, **{f"x{i}": x for i, (x, _) in enumerate(pairs)}, **{f"y{i}": y for i, (_, y) in enumerate(pairs)}
    )
    model = folder / "model.onnx"
    started = time.perf_counter()
    if not model.exists():
        module = train_bench.build_torch(spec).eval()
        partial = folder / "partial" / "model.onnx"
        partial.parent.mkdir(exist_ok=True)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                (torch.from_numpy(pairs[0][0]),),
                str(partial),
                dynamo=False,
                do_constant_folding=False,
                opset_version=17,
                input_names=["input_ids"],
                output_names=["logits"],
            )
        graphforge.save(graphforge.load(str(partial)), model)  # (the loader lowers onnx's IR for onnxruntime)
    exported = time.perf_counter() - started
    programs = {}
    for label, between, after in ROWS:
        if between and not quantization_available():
            continue
        path = folder / f"program-{re.sub(r'[^a-z0-9]+', '-', label)}.onnx"
        started = time.perf_counter()
        if not path.exists():
            graphforge.save(graphforge.compile(str(model), pipeline(between, after)).model, path)
        programs[label] = (str(path), exported + time.perf_counter() - started)
    return {"batches": str(batches), "programs": programs}


# --------------------------------------------------------------------------- the sides (child processes)


def _batches(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    data = np.load(path)
    return [(data[f"x{i}"], data[f"y{i}"]) for i in range(len(data.files) // 2)]


def _graphforge_side(job: dict, folder: Path):
    from graphforge.runtime import Module

    module = Module(job["program"], device="cpu", intra_op_threads=job["threads"], inter_op_threads=1)
    trainable = sum(int(np.prod(module.state.tensors[n].shape)) for n in module.roles.parameters)

    def checkpoint() -> int:
        return module.state.save(folder / "checkpoint.safetensors").stat().st_size

    return module.train_step, trainable, checkpoint


def _peft_side(job: dict, folder: Path):
    import peft
    import torch

    torch.set_num_threads(job["threads"])
    torch.set_num_interop_threads(1)
    flat = train_bench.build_torch(train_bench.Spec(**job["spec"])).train()
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0)
    flat.inner = peft.get_peft_model(flat.inner, config)
    trainable = flat.inner.get_nb_trainable_parameters()[0]
    params = [p for p in flat.parameters() if p.requires_grad]
    lr, betas, eps, wd = train_bench.LR, train_bench.BETAS, train_bench.EPS, train_bench.WEIGHT_DECAY
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(flat(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        return loss.item()

    def checkpoint() -> int:
        flat.inner.save_pretrained(folder / "adapter")
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    return step, trainable, checkpoint


def child(job: dict) -> dict:
    if job["side"] == "prepare":
        return prepare(train_bench.Spec(**job["spec"]), Path(job["folder"]))
    os.environ["OMP_NUM_THREADS"] = str(job["threads"])
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        side = _peft_side if job["side"] == "peft" else _graphforge_side
        step, trainable, checkpoint = side(job, Path(tmp))
        built_mib = train_bench._proc_status_mib("VmRSS")  # the model (and session) before any step
        batches = _batches(job["batches"])
        losses = [float(step(*batches[0]))]
        first_step_s = time.perf_counter() - START
        losses += [float(step(*batches[i % len(batches)])) for i in range(1, job["check"])]
        times = helpers.timed_steps(step, batches, job["steps"])
        return {
            "losses": losses,
            "first_step_s": first_step_s,
            "step_s": statistics.median(times),
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "built_mib": built_mib,
            "load": (load, os.getloadavg()[0]),
            "checkpoint_bytes": checkpoint(),
            "trainable": int(trainable),
        }


# --------------------------------------------------------------------------- the report


def run(quick: bool = False) -> str:
    spec = QUICK if quick else FULL
    threads = helpers.usable_cores()
    folder = CACHE / ("quick" if quick else "full")
    print(f"  {spec.label}: export and compile", flush=True)
    prepared = train_bench.run_child(
        __file__, {"side": "prepare", "spec": spec.__dict__, "folder": str(folder)}, timeout=TIMEOUT_S
    )
    programs = prepared["programs"]
    common = {"spec": spec.__dict__, "batches": prepared["batches"], "threads": threads, "steps": spec.steps}
    common["check"] = 1 + spec.warmup
    results: dict[str, dict] = {}
    for label, job in [("torch eager + PEFT", {"side": "peft"})] + [
        (f"graphforge, {row}", {"side": "graphforge", "program": path}) for row, (path, _) in programs.items()
    ]:
        print(f"  {label}", flush=True)
        try:
            results[label] = train_bench.run_child(__file__, {**common, **job}, timeout=TIMEOUT_S)
        except (RuntimeError, OSError) as exc:  # a side that fails is reported, the others still run
            results[label] = {"error": " ".join(str(exc).split())[-300:]}
    return report(spec, threads, results, {k: s for k, (_, s) in programs.items()})


def report(spec: train_bench.Spec, threads: int, results: dict[str, dict], prepare_s: dict[str, float]) -> str:
    tokens = spec.batch * spec.config["seq"]
    peft = results["torch eager + PEFT"]
    lines = [
        f"{spec.label}; LoRA r = {R}, alpha {ALPHA}, all linear layers but the head; AdamW; {threads} threads; "
        f"{helpers.cpu_name()}; torch {helpers.version('torch')}, peft {helpers.version('peft')}, "
        f"onnxruntime {helpers.version('onnxruntime')}. Median of {spec.steps} timed steps after "
        f"{1 + spec.warmup} untimed ones.",
        "",
        "| side | trainable | tokens/s | × PEFT | peak memory | × PEFT | before the first step "
        "| first step after start | checkpoint | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | | | | | | | | |")
            continue
        speed, peak = tokens / r["step_s"], r["peak_mib"]
        ratio = "" if "error" in peft else f"{speed * peft['step_s'] / tokens:.2f}×"
        memory = "" if "error" in peft else f"{peak / peft['peak_mib']:.2f}×"
        lines.append(
            f"| {label} | {r['trainable']:,} | {speed:,.1f} | {ratio} | {peak / 1024:.2f} GiB | {memory} "
            f"| {r['built_mib'] / 1024:.2f} GiB | {r['first_step_s']:.1f} s | {r['checkpoint_bytes'] / 2**20:.1f} MiB "
            f"| {r['load'][0]:.1f}–{r['load'][1]:.1f} |"
        )
    lines += ["", train_bench.first_losses("first steps", results)]
    lines += [
        "- graphforge's export and compile, once before its runs: "
        + ", ".join(f"{k} {s:.0f} s" for k, s in prepare_s.items()),
        "- before the first step: resident memory with the model loaded (graphforge makes its session in the first step); load: the "
        "machine's 1-minute load average as the side started and ended (2 means both cores busy elsewhere too)",
        f"- goals: ≥ {SPEED_GOAL}× PEFT's tokens a second; peak memory ≤ {MEMORY_GOAL}× PEFT's with the int4 base",
    ]
    if len(prepare_s) == 1:
        lines.append("- no int8/int4 rows: this tree has no quantize_frozen pass")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    train_bench.child_main(child, run)
