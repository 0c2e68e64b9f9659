"""Data-parallel benchmark: graphforge's DataParallel beside PyTorch's DistributedDataParallel,
on this machine's cores, the same model, batches, optimizer and threads.

The model is the training benchmark's GPT-2 (train_bench.py: 2 layers, 256 wide, the GPT-2
vocabulary, sequence 64, its tied embedding the largest gradient), trained with cross-entropy
and AdamW; batch 8 per process. Five runs, each its own processes:

* graphforge, 1 process x 2 threads (``Module.train_step``: the whole step in one run);
* graphforge DP, 2 processes x 1 thread (torch.distributed, gloo on loopback; the program
  compiled with ``allreduce`` (25 MiB buckets), its step cut after each bucket and each bucket
  reduced while backward computes the next), and the same without overlap (each bucket
  reduced as it completes, computation waiting);
* torch eager, 1 process x 2 threads, and torch DDP, 2 processes x 1 thread (gloo, its
  default 25 MiB buckets, the same AdamW).

Every process warms up, meets the others at a barrier, then times its steps; a run's step
time is rank 0's median, its throughput the samples of all processes per step over it. The
runs go twice, the second time in reverse order, and each keeps its faster pass (this machine
has other tenants). Exposed communication: the time graphforge's step spends waiting for a
reduction (the runtime counts it), and for DDP the step time minus that of the same step in
``no_sync()`` (no reduction). Before timing, graphforge DP and torch DDP take the same
first steps from the same initial weights: their losses must agree.

    python benchmarks/dp_bench.py            # prints the markdown section
    python benchmarks/run.py dp              # writes it into docs/benchmarks.md
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import helpers  # noqa: E402  (what the benchmarks share)
import train_bench as tb  # noqa: E402  (the model, its export and the optimizer settings)

TITLE = "Data-parallel training"
CACHE = helpers.cache("dp")
GOAL = 1.2  # the issue's: graphforge DP samples/s at least this many times torch DDP's
PER_RANK = 8
#: (label, side, processes, threads per process, overlap)
RUNS = [
    ("graphforge", "graphforge", 1, 2, True),
    ("graphforge DP", "graphforge", 2, 1, True),
    ("graphforge DP, no overlap", "graphforge", 2, 1, False),
    ("torch", "torch", 1, 2, True),
    ("torch DDP", "torch", 2, 1, True),
]
CHECK_STEPS = 3
RUN_TIMEOUT_S = 900


# --------------------------------------------------------------------------- one process of a run


def worker_main(job: dict) -> int:
    """Train ``job["steps"]`` timed steps after the warm-up; rank 0 writes the results."""
    import torch

    threads, ranks = job["threads"], job["processes"]
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    world = rank = None
    if ranks > 1:
        from graphforge.distributed import World

        world = World.join(timeout_s=300)
        rank = world.rank
    data = np.load(job["batches"])
    share = slice(rank or 0, None, 2)  # every process takes its 8 of each global batch of 16
    batches = [(data["x"][i][share], data["y"][i].reshape(16, -1)[share].reshape(-1)) for i in range(len(data["x"]))]
    step, extra = (_graphforge if job["side"] == "graphforge" else _torch)(job, world)
    losses = helpers.checked_then_warm(step, batches, CHECK_STEPS, job["warmup"])
    result = {"losses": losses, **_timed(step, batches, job["steps"], world, extra)}
    if world is not None:
        world.barrier("the end of the benchmark")
        world.leave()
    if not rank:
        Path(job["out"]).write_text(json.dumps(result))
    return 0


def _timed(step, batches, steps: int, world, extra) -> dict:
    if world is not None:
        world.barrier("the start of the timed steps")
    before = extra["exposed"]() if "exposed" in extra else 0.0
    result = {"step_s": helpers.timed_steps(step, batches, steps)}
    if "exposed" in extra:
        result["exposed_s"] = (extra["exposed"]() - before) / steps
    if "unsynced" in extra:  # DDP: the same steps without the reduction
        if world is not None:
            world.barrier("the start of the no_sync steps")
        unsynced = []
        for i in range(steps):
            started = time.perf_counter()
            extra["unsynced"](*batches[i % len(batches)])
            unsynced.append(time.perf_counter() - started)
        result["unsynced_step_s"] = unsynced
    if "copy" in extra:
        result["copy_s"] = extra["copy"]()
    return result


def _graphforge(job: dict, world):
    from graphforge.distributed import DataParallel
    from graphforge.runtime import Module

    module = Module(job["program"], device="cpu", intra_op_threads=job["threads"], inter_op_threads=1)
    extra = {}
    if world is not None:
        parallel = DataParallel(module, world, overlap=job["overlap"])
        extra["exposed"] = lambda: parallel.stats.exposed_s

        def copy() -> float:
            """What one copy of every gradient would cost (DLPack binding makes none)."""
            times = []
            for _ in range(5):
                started = time.perf_counter()
                for bucket in parallel.buckets:
                    bucket.flat.clone()
                times.append(time.perf_counter() - started)
            return min(times)

        extra["copy"] = copy
    return (lambda x, y: module.train_step(x, y)), extra


def _torch(job: dict, world):
    import contextlib

    import torch

    spec = tb.Spec(**job["spec"])
    module = tb.build_torch(spec).train()
    model = module
    if world is not None:
        model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=25)
    optimizer = torch.optim.AdamW(
        module.parameters(), lr=tb.LR, betas=tb.BETAS, eps=tb.EPS, weight_decay=tb.WEIGHT_DECAY
    )

    def step(x, y, sync: bool = True):
        optimizer.zero_grad(set_to_none=True)
        context = contextlib.nullcontext() if sync or world is None else model.no_sync()
        with context:
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
        optimizer.step()
        if world is not None:  # the loss every rank reports: the mean, as graphforge's
            loss = loss.detach()
            torch.distributed.all_reduce(loss)
            loss /= world.size
        return loss.detach()

    extra = {"unsynced": lambda x, y: step(x, y, sync=False)} if world is not None else {}
    return step, extra


# --------------------------------------------------------------------------- the runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script: str, job: dict, folder: Path, count: int, threads: int, timeout: float) -> None:
    """Start ``python script --worker JOB`` ``count`` times as ranks of one group on loopback
    (``threads`` each); wait for all, or kill them all past ``timeout`` seconds."""
    path = folder / "job.json"
    path.write_text(json.dumps(job))
    port = _free_port()
    procs = []
    for rank in range(count):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        if count > 1:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(count),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, script, "--worker", str(path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{job['label']}: still running after {timeout} s") from None
    for proc, output in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"{job['label']} failed:\n{output[-3000:]}")


def _launch(job: dict, folder: Path) -> dict:
    """Run one configuration (its processes) and return rank 0's results."""
    run_workers(__file__, job, folder, job["processes"], job["threads"], RUN_TIMEOUT_S)
    return json.loads(Path(job["out"]).read_text())


def prepare(spec: tb.Spec, folder: Path) -> tuple[Path, Path, float, float]:
    """The exported model compiled with allreduce, the global batches, and the MiB of all
    gradients and of the largest."""
    import graphforge

    module = tb.build_torch(spec)
    batches = tb.make_batches(tb.Spec(**{**asdict(spec), "batch": 2 * PER_RANK}))
    model = tb.export(module, batches[0][0], folder / "model.onnx", "input_ids")
    program = graphforge.compile(str(model), f"{tb.PIPELINE}, allreduce(bucket_mb=25)").model
    path = graphforge.save(program, folder / "program.onnx")
    np.savez(folder / "batches.npz", x=np.stack([b[0] for b in batches]), y=np.stack([b[1] for b in batches]))
    sizes = [p.numel() * 4 / 2**20 for p in module.parameters()]
    return path, folder / "batches.npz", sum(sizes), max(sizes)


def benchmark(quick: bool = False, *, passes: int = 2, cache: Path = CACHE, only: tuple[str, ...] = ()) -> dict:
    """Every run (``only``: those of these labels), ``passes`` times (alternating the order),
    each keeping its fastest."""
    spec = next(s for s in (tb.QUICK if quick else tb.FULL) if s.key == "gpt2")
    spec = tb.Spec(**{**asdict(spec), "batch": PER_RANK})
    folder = cache / ("quick" if quick else "full")
    folder.mkdir(parents=True, exist_ok=True)
    program, batches, gradient_mib, largest_mib = prepare(spec, folder)
    steps, warmup = (5, 2) if quick else (12, 3)
    chosen = [run for run in RUNS if not only or run[0] in only]
    results: dict[str, list[dict]] = {label: [] for label, *_ in chosen}
    for order in ([chosen, chosen[::-1]] * passes)[:passes]:
        for label, side, processes, threads, overlap in order:
            job = {
                "label": label,
                "side": side,
                "processes": processes,
                "threads": threads,
                "overlap": overlap,
                "program": str(program),
                "batches": str(batches),
                "spec": asdict(spec),
                "steps": steps,
                "warmup": warmup,
                "out": str(folder / "result.json"),
            }
            results[label].append(_launch(job, folder))
    best = {label: min(runs, key=lambda r: statistics.median(r["step_s"])) for label, runs in results.items()}
    return {"spec": spec, "best": best, "gradient_mib": gradient_mib, "largest_mib": largest_mib, "steps": steps}


# --------------------------------------------------------------------------- the report


def run(quick: bool = False) -> str:
    return report(benchmark(quick))


def report(measured: dict) -> str:
    spec, best = measured["spec"], measured["best"]
    rows, throughput = [], {}
    for label, _, processes, threads, _ in RUNS:
        result = best.get(label)
        if result is None:  # (not run: benchmark(only=...))
            continue
        step = statistics.median(result["step_s"])
        throughput[label] = processes * PER_RANK / step
        exposed = "—"
        if "exposed_s" in result:
            exposed = f"{result['exposed_s'] * 1e3:.1f} ms"
        elif "unsynced_step_s" in result:
            exposed = f"{(step - statistics.median(result['unsynced_step_s'])) * 1e3:.1f} ms"
        q1, q3 = np.percentile(result["step_s"], [25, 75])
        rows.append(
            f"| {label} | {processes} × {threads} | {step * 1e3:.0f} ms ({q1 * 1e3:.0f}–{q3 * 1e3:.0f}) "
            f"| {throughput[label]:.1f} | {exposed} |"
        )
    ratio = throughput["graphforge DP"] / throughput["torch DDP"]
    first = best["graphforge DP"]["losses"], best["torch DDP"]["losses"]
    agree = all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(*first, strict=True))
    copy_ms = best["graphforge DP"].get("copy_s", 0.0) * 1e3
    lines = [
        f"GPT-2 {spec.config['n_layer']}×{spec.config['n_embd']}, vocab {spec.config['vocab_size']:,}, "
        f"sequence {spec.config['seq']}, batch {PER_RANK} per process, AdamW; "
        f"{measured['gradient_mib']:.0f} MiB of gradients per step; {helpers.cpu_name()}, {os.cpu_count()} cores; "
        f"torch {helpers.version('torch')}, onnxruntime {helpers.version('onnxruntime')}.",
        "",
        "| run | processes × threads | step (median, IQR) | samples/s | exposed allreduce per step |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"- **graphforge DP / torch DDP: {ratio:.2f}× the samples/s** (goal ≥ {GOAL}×: "
        f"{'met' if ratio >= GOAL else 'not met'}).",
        *(
            [
                f"- Scaling from 1 process × 2 threads to 2 processes × 1 thread: graphforge "
                f"{throughput['graphforge DP'] / throughput['graphforge']:.2f}×, torch "
                f"{throughput['torch DDP'] / throughput['torch']:.2f}×."
            ]
            if {"graphforge", "torch"} <= set(best)
            else []
        ),
        *(
            [
                f"- Overlap: with it graphforge's step waits {best['graphforge DP']['exposed_s'] * 1e3:.1f} ms per "
                f"step for reductions, without it {best['graphforge DP, no overlap']['exposed_s'] * 1e3:.1f} ms."
            ]
            if "graphforge DP, no overlap" in best
            else []
        ),
        f"- Gradients move between onnxruntime and torch without a copy: the segments write them into "
        f"the buckets' memory (DLPack); one copy of them would add {copy_ms:.1f} ms per step.",
        f"- First {CHECK_STEPS} losses, graphforge DP vs torch DDP: "
        + ", ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(*first, strict=True))
        + (" (agree)" if agree else " (**differ**)"),
        "",
        "Reading it: the two processes' computation takes both cores, so a reduction running beside "
        "backward competes with it for CPU time (gloo sums and copies on the CPU), and overlap can hide "
        f"little here; besides, {measured['largest_mib']:.0f} of the {measured['gradient_mib']:.0f} MiB are one "
        "gradient (the tied token embedding, whose two uses add up only when backward ends), so its reduction "
        "is exposed under any schedule, DDP's included. Two processes of one thread give about the samples/s "
        "of one process of two threads on the same cores: what the table measures is the cost of data "
        "parallelism beside DDP's, at equal settings.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(json.loads(Path(sys.argv[2]).read_text())))
    print(run(quick="--quick" in sys.argv))
