"""One rank of a data-parallel or pipeline test run: ``python _worker.py SPEC.json`` under the
environment torchrun sets. For each case of the spec it trains a program, data-parallel on
its share of the global batches (rows rank::N of each), or as one pipeline stage (a case
with ``"pipeline": true``: every micro-batch whole), on the spec's ``device`` (the CPU by
default; "cuda": NCCL, one GPU per rank), and writes its final carried state and
the losses it reported to ``<out>/<case>-rank<r>.npz``."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from graphforge.distributed import DataParallel, World, ZeroDataParallel
from graphforge.distributed.stages import Stage, StageReplicas, TorchTransport
from graphforge.runtime import CheckpointState, Module, Optimizer


def stage(case: dict, world: World) -> None:
    """One stage of one pipeline; with more ranks than stages, pipelines side by side (rank =
    replica × stages + stage), replica d taking rows d::D of every micro-batch."""
    batches = np.load(case["batches"])
    state = CheckpointState.from_program(case["program"])
    stages = case["stages"]
    replicas = StageReplicas(world, stages) if world.size > stages else None
    transport = TorchTransport(world, first=world.rank - world.rank % stages, stages=stages)
    pipeline = Stage(
        case["program"], state, transport, device=case.get("device", "cpu"), intra_op_threads=1, replicas=replicas
    )
    share = slice(world.rank // stages, None, world.size // stages)
    m = pipeline.microbatches
    losses = []
    for step in range(case["steps"]):
        if case.get("die_at_step") == step and world.rank == case.get("die_rank", 1):
            os._exit(17)  # a stage that dies mid-run: the others must fail, not hang
        micro = [{n: batches[n][step * m + i][share] for n in batches.files} for i in range(m)]
        losses.append(pipeline.train_step(micro).loss)
    gathered = pipeline.gathered_tensors()
    np.savez(f"{case['out']}-rank{world.rank}.npz", __losses__=np.array(losses), **pipeline.tensors())
    if gathered is not None:
        np.savez(f"{case['out']}-gathered.npz", **gathered)


def train(case: dict, world: World) -> None:
    batches = np.load(case["batches"])
    zero = case.get("zero")
    module = Module(
        case["program"],
        device=case.get("device", "cpu"),
        intra_op_threads=1,
        shard_optimizer_states=bool(zero),
        capture=case.get("capture"),
    )
    if zero:
        sharded = ZeroDataParallel(module, world, stage=zero, overlap=case.get("overlap", True))
    else:
        DataParallel(module, world, overlap=case.get("overlap", True))
    optimizer = Optimizer(module)
    accumulate = case.get("accumulate", 1)
    share = slice(world.rank, None, world.size)
    losses = []
    for step in range(case["steps"]):
        for micro in range(accumulate):
            feeds = {name: batches[name][step * accumulate + micro][share] for name in batches.files}
            losses.append(float(module.train_step(**feeds) if accumulate == 1 else module(**feeds)))
        if accumulate > 1:
            optimizer.step()
            module.lazy_reset_grad()
    # before anything here allocates more: the peak of the training itself, and its optimizer state
    peak = _peak_rss()
    held = [c for c in module.runner.carried.values() if c.spec.role == "optimizer"]
    state_bytes = sharded.state_bytes() if zero else sum(len(c.slots) * c.value.numpy().nbytes for c in held)
    if case.get("memory_only"):
        np.savez(f"{case['out']}-rank{world.rank}.npz", __peak_rss__=peak, __state_bytes__=state_bytes)
        return
    state = module.runner.read_tensors()
    if case.get("report_static"):  # how many of the sessions that trained ran against fixed buffers
        state["__static_sessions__"] = np.array(
            sum(b.static_inputs is not None for b in module.runner._sessions.values())
        )
    if zero:
        state["__state_bytes__"] = np.array(state_bytes)
        state.update(sharded.gathered_states())
    if case.get("broadcast_buffers_at_end"):  # what the next forward would start from
        before = {f"__before__{k}": v for k, v in module.runner.read_role("buffer").items()}
        module.reducer.before_forward()
        state = {**module.runner.read_tensors(), **before}
    np.savez(f"{case['out']}-rank{world.rank}.npz", __losses__=np.array(losses), **state)


def _peak_rss() -> int:
    """This process's peak resident memory, bytes (VmHWM: ru_maxrss would carry the launcher's over the fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    device = spec.get("device", "cpu")  # "cuda": NCCL, one GPU per rank
    world = World.join(cuda=device == "cuda", timeout_s=spec.get("timeout_s", 60))
    try:
        for case in spec["cases"]:
            case.setdefault("device", device)
            (stage if case.get("pipeline") else train)(case, world)
    finally:
        world.leave()


if __name__ == "__main__":
    main()
