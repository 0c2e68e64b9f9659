"""Sharded optimizer states (ZeRO): graphforge's DataParallel and ZeroDataParallel (stages 1
and 2) beside PyTorch's DDP, ZeroRedundancyOptimizer (its ZeRO-1, over DDP) and FSDP with
``SHARD_GRAD_OP`` (its ZeRO-2: FSDP2's ``fully_shard(reshard_after_forward=False)``, as the
FSDP class needs an accelerator), on this machine's cores: the same model, batches, AdamW and
threads, 2 processes x 1 thread (torch.distributed, gloo on loopback).

The model is the training benchmark's GPT-2 (train_bench.py), batch 8 per process. Each run
is its own processes; every process warms up, meets the others at a barrier, times its steps,
and reports its peak resident memory (``ru_maxrss``: the whole run, start-up included) and the
bytes of optimizer state it holds, read from where they live: graphforge's runner buffers (both
of DataParallel's two buffers per state) or ZeroDataParallel's shards; torch's
``optimizer.state`` tensors (on each process, those of its own shard). The runs go twice, the
second time in reverse order, and each keeps its faster pass (this machine has other tenants).

    python benchmarks/zero_bench.py            # prints the markdown section
    python benchmarks/run.py zero              # writes it into docs/benchmarks.md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dp_bench  # noqa: E402  (its launcher)
import helpers  # noqa: E402  (what the benchmarks share)
import train_bench as tb  # noqa: E402  (the model, its export and the optimizer settings)

TITLE = "Sharded optimizer states (ZeRO)"
CACHE = helpers.cache("zero")
PER_RANK = 8
PROCESSES = 2
GOAL = 1.2  # graphforge's samples/s at least this many times torch's at equal sharding
#: (label, side, how: graphforge's ZeRO stage (0: DataParallel; negative: without overlap), or torch's wrapper)
RUNS = [
    ("graphforge DP", "graphforge", 0),
    ("graphforge ZeRO-1", "graphforge", 1),
    ("graphforge ZeRO-1, no overlap", "graphforge", -1),
    ("graphforge ZeRO-2", "graphforge", 2),
    ("torch DDP", "torch", "ddp"),
    ("torch ZeroRedundancyOptimizer (ZeRO-1)", "torch", "zero1"),
    ("torch FSDP2 SHARD_GRAD_OP (ZeRO-2)", "torch", "fsdp"),
]
PEERS = {
    "graphforge ZeRO-1": "torch ZeroRedundancyOptimizer (ZeRO-1)",
    "graphforge ZeRO-2": "torch FSDP2 SHARD_GRAD_OP (ZeRO-2)",
}
RUN_TIMEOUT_S = 1200


def worker_main(job: dict) -> int:
    import torch

    from graphforge.distributed import World

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    world = World.join(timeout_s=600)
    data = np.load(job["batches"])
    share = slice(world.rank, None, PROCESSES)
    batches = [
        (data["x"][i][share], data["y"][i].reshape(PROCESSES * PER_RANK, -1)[share].reshape(-1))
        for i in range(len(data["x"]))
    ]
    step, extra = (_graphforge if job["side"] == "graphforge" else _torch)(job, world)
    losses = helpers.checked_then_warm(step, batches, 3, job["warmup"])
    world.barrier("the start of the timed steps")
    before = extra["exposed"]() if "exposed" in extra else 0.0
    times = helpers.timed_steps(step, batches, job["steps"])
    result = {
        "losses": losses,
        "step_s": times,
        "state_bytes": extra["state_bytes"](),
        # VmHWM of this process (getrusage's ru_maxrss would carry the launcher's peak over the fork)
        "peak_rss": int(tb._peak_mib() * 2**20),
    }
    if "exposed" in extra:
        result["exposed_s"] = (extra["exposed"]() - before) / job["steps"]
    world.barrier("the end of the benchmark")
    world.leave()
    Path(f"{job['out']}.{world.rank}").write_text(json.dumps(result))
    return 0


def _graphforge(job: dict, world):
    from graphforge.distributed import DataParallel, ZeroDataParallel
    from graphforge.runtime import Module

    stage, overlap = abs(job["how"]), job["how"] >= 0
    module = Module(
        job["programs"][str(stage)], device="cpu", intra_op_threads=1, inter_op_threads=1,
        shard_optimizer_states=bool(stage),
    )  # fmt: skip
    if stage:
        parallel = ZeroDataParallel(module, world, stage=stage, overlap=overlap)
        state_bytes = parallel.state_bytes
    else:
        parallel = DataParallel(module, world)

        def state_bytes() -> int:
            carried = [c for c in module.runner.carried.values() if c.spec.role == "optimizer"]
            return sum(len(c.slots) * int(np.prod(c.shape)) * c.dtype.itemsize for c in carried)

    extra = {"exposed": lambda: parallel.stats.exposed_s, "state_bytes": state_bytes}
    return (lambda x, y: module.train_step(x, y)), extra


def _torch(job: dict, world):
    import torch
    import torch.distributed as dist

    spec = tb.Spec(**job["spec"])
    module = tb.build_torch(spec).train()
    settings = {"lr": tb.LR, "betas": tb.BETAS, "eps": tb.EPS, "weight_decay": tb.WEIGHT_DECAY}
    how = job["how"]
    if how == "fsdp":
        # FSDP2 (fully_shard): the FullyShardedDataParallel class refuses a machine without an
        # accelerator; reshard_after_forward=False keeps the parameters gathered between forward
        # and backward, which is SHARD_GRAD_OP's ZeRO-2 (states and gradients sharded)
        from torch.distributed.fsdp import fully_shard

        for block in module.inner.transformer.h:  # one unit per block, as FSDP wraps transformers
            fully_shard(block, reshard_after_forward=False)
        model = fully_shard(module, reshard_after_forward=False)
        optimizer = torch.optim.AdamW(model.parameters(), **settings)
    else:
        model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=25)
        if how == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **settings)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), **settings)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        return loss / world.size

    def state_bytes() -> int:
        held = optimizer.optim.state if how == "zero1" else optimizer.state
        local = [getattr(t, "_local_tensor", t) for s in held.values() for t in s.values()]  # FSDP2: DTensors
        return sum(t.numel() * t.element_size() for t in local if t.dim() > 0)

    return step, {"state_bytes": state_bytes}


def prepare(spec: tb.Spec, folder: Path) -> tuple[dict[str, str], Path]:
    import graphforge

    module = tb.build_torch(spec)
    batches = tb.make_batches(tb.Spec(**{**asdict(spec), "batch": PROCESSES * PER_RANK}))
    model = tb.export(module, batches[0][0], folder / "model.onnx", "input_ids")
    programs = {}
    for stage, tail in (
        (0, "allreduce(bucket_mb=25)"),
        (1, "zero(stage=1, bucket_mb=25)"),
        (2, "zero(stage=2, bucket_mb=25)"),
    ):
        program = graphforge.compile(str(model), f"{tb.PIPELINE}, {tail}").model
        programs[str(stage)] = str(graphforge.save(program, folder / f"program-{stage}.onnx"))
    np.savez(folder / "batches.npz", x=np.stack([b[0] for b in batches]), y=np.stack([b[1] for b in batches]))
    return programs, folder / "batches.npz"


def benchmark(spec: tb.Spec, *, quick: bool = False, passes: int = 2, cache: Path = CACHE) -> dict:
    """Every run of ``spec``'s model, ``passes`` times (alternating the order), each keeping its fastest."""
    spec = tb.Spec(**{**asdict(spec), "batch": PER_RANK})
    folder = cache / ("quick" if quick else spec.label.split(",")[0].replace(" ", "-").replace("×", "x"))
    folder.mkdir(parents=True, exist_ok=True)
    programs, batches = prepare(spec, folder)
    steps, warmup = (4, 1) if quick else (spec.steps // 2, 2)
    results: dict[str, list[list[dict]]] = {label: [] for label, *_ in RUNS}
    for order in ([RUNS, RUNS[::-1]] * passes)[:passes]:
        for label, side, how in order:
            job = {
                "label": label, "side": side, "how": how, "programs": programs, "batches": str(batches),
                "spec": asdict(spec), "steps": steps, "warmup": warmup, "out": str(folder / "result.json"),
                "processes": PROCESSES, "threads": 1,
            }  # fmt: skip
            dp_bench.run_workers(__file__, job, folder, PROCESSES, 1, RUN_TIMEOUT_S)
            ranks = [json.loads(Path(f"{job['out']}.{r}").read_text()) for r in range(PROCESSES)]
            results[label].append(ranks)
    best = {
        label: min(runs, key=lambda ranks: statistics.median(ranks[0]["step_s"])) for label, runs in results.items()
    }
    return {"spec": spec, "best": best, "steps": steps}


def run(quick: bool = False) -> str:
    """GPT-2 2×256 (two passes) and GPT-2 small (one: each of its runs takes minutes here)."""
    if quick:
        return report(benchmark(next(s for s in tb.QUICK if s.key == "gpt2"), quick=True))
    small = next(s for s in tb.LARGE if s.key == "gpt2")
    sections = [report(benchmark(next(s for s in tb.FULL if s.key == "gpt2"))), report(benchmark(small, passes=1))]
    return "\n".join(sections)


def report(measured: dict) -> str:
    spec, best = measured["spec"], measured["best"]
    mib = 2**20
    rows, throughput, rss, states = [], {}, {}, {}
    for label, _, _ in RUNS:
        ranks = best[label]
        step = statistics.median(ranks[0]["step_s"])
        throughput[label] = PROCESSES * PER_RANK / step
        rss[label] = max(r["peak_rss"] for r in ranks)
        states[label] = max(r["state_bytes"] for r in ranks)
        exposed = f"{ranks[0]['exposed_s'] * 1e3:.1f} ms" if "exposed_s" in ranks[0] else "—"
        rows.append(
            f"| {label} | {step * 1e3:.0f} ms | {throughput[label]:.1f} | {states[label] / mib:.1f} MiB "
            f"| {rss[label] / mib:.0f} MiB | {exposed} |"
        )
    dp = "graphforge DP"
    notes = []
    for ours, theirs in PEERS.items():
        notes.append(
            f"- **{ours} / {theirs.split(' (')[0]}: {throughput[ours] / throughput[theirs]:.2f}× the samples/s** "
            f"(goal ≥ {GOAL}×: {'met' if throughput[ours] >= GOAL * throughput[theirs] else 'not met'}); "
            f"optimizer state {states[ours] / mib:.1f} vs {states[theirs] / mib:.1f} MiB, peak RSS "
            f"{rss[ours] / mib:.0f} vs {rss[theirs] / mib:.0f} MiB."
        )
    for stage in ("graphforge ZeRO-1", "graphforge ZeRO-2"):
        notes.append(
            f"- {stage} beside graphforge DP: optimizer state {states[stage] / states[dp]:.2f}× (DP keeps two "
            f"buffers per state, so 1/{PROCESSES} of one is 1/{2 * PROCESSES} of DP's), peak RSS "
            f"{(rss[dp] - rss[stage]) / mib:.0f} MiB lower, step time {1 / throughput[stage] * throughput[dp]:.2f}× DP's."
        )
    notes.append(
        f"- Overlap: graphforge ZeRO-1's step waits {best['graphforge ZeRO-1'][0]['exposed_s'] * 1e3:.1f} ms for its "
        f"reduce-scatters and gathers with overlap, {best['graphforge ZeRO-1, no overlap'][0]['exposed_s'] * 1e3:.1f} "
        "ms without (each reduced as its bucket completes and the gathers waited at once)."
    )
    first = best["graphforge ZeRO-1"][0]["losses"], best["torch ZeroRedundancyOptimizer (ZeRO-1)"][0]["losses"]
    notes.append(
        "- First 3 losses, graphforge ZeRO-1 vs torch ZeroRedundancyOptimizer: "
        + ", ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(*first, strict=True))
    )
    lines = [
        f"### {spec.label.split(',')[0]}",
        "",
        f"GPT-2 {spec.config['n_layer']}×{spec.config['n_embd']}, vocab {spec.config['vocab_size']:,}, "
        f"sequence {spec.config['seq']}, batch {PER_RANK} per process, AdamW; {PROCESSES} processes × 1 thread "
        f"(gloo); {helpers.cpu_name()}, {os.cpu_count()} cores; torch {helpers.version('torch')}, "
        f"onnxruntime {helpers.version('onnxruntime')}. Per process: optimizer state held, peak RSS (the "
        "larger of the two processes'); exposed: the step's wait for reductions and gathers.",
        "",
        "| run | step (median) | samples/s | optimizer state | peak RSS | exposed communication |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        *notes,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(json.loads(Path(sys.argv[2]).read_text())))
    print(run(quick="--quick" in sys.argv))
