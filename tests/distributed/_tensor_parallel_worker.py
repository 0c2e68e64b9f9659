"""One member of a tensor-parallel test run: ``python _tensor_parallel_worker.py SPEC.json``
under the environment torchrun sets. For each case of the spec it compiles this member's
program (``tensor_parallel(size=T, rank=r)`` after the case's loss pass; T the world's size,
or with ``data`` = D replicas a mesh of D × T, each replica's program ending with the
allreduce pass), trains it on every batch (whole, or each replica its 1/D of the rows),
evaluates the last batch, and rank 0 writes the whole program's state joined from its tensor
group's (``<out>-whole.safetensors``) and the losses (``<out>-losses.npz``); each process
writes the shapes of its parameters (``<out>-rank<r>.json``)."""

from __future__ import annotations

import json
import os
import sys
import warnings

import numpy as np
from graphforge.passes import TensorParallel as TensorParallelPass
from graphforge.passes.tensor_parallel import with_tensor_parallel

import graphforge
from graphforge.distributed import DataParallel, DistributedError, World, ZeroDataParallel
from graphforge.distributed.stages import Stage, StageReplicas, TorchTransport
from graphforge.distributed.tensor_parallel import TensorParallel
from graphforge.pass_manager import parse_pipeline
from graphforge.runtime import CheckpointState, Module
from graphforge.train.evaluation import _argmax_across


def member_pipeline(pipeline: str, size: int, rank: int | None = None) -> list:
    """``pipeline`` with ``tensor_parallel(size=size, rank=rank)`` after its loss pass (which
    the split's vocabulary-parallel cross-entropy replaces)."""
    return with_tensor_parallel(parse_pipeline(pipeline), TensorParallelPass(size=size, rank=rank))


def train(case: dict, world: World) -> None:
    replicas = case.get("data", 1)
    mesh = world.mesh(tensor=world.size // replicas)
    tensor, data = mesh.tensor, mesh.data
    zero = case.get("zero", 0)  # ZeRO over the replicas: the zero pass instead of allreduce
    pipeline = case["pipeline"] + ((f", zero(stage={zero})" if zero else ", allreduce") if replicas > 1 else "")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exports' padding-row notice
        member = graphforge.compile(case["model"], member_pipeline(pipeline, tensor.size, tensor.rank)).model
    in_place = case.get("in_place", True)
    module = Module(member, device="cpu", intra_op_threads=1, in_place=in_place, shard_optimizer_states=bool(zero))
    group = TensorParallel(module, tensor)
    if replicas > 1:
        ZeroDataParallel(module, data, stage=zero) if zero else DataParallel(module, data)
    batches = np.load(case["batches"])
    steps = len(batches[batches.files[0]])
    losses = []
    for step in range(steps):
        if case.get("die_at_step") == step and world.rank == case.get("die_rank", 1):
            os._exit(17)  # a member that dies mid-run: the others must stop with its name, not hang
        rows = len(batches[batches.files[0]][step]) // replicas
        share = slice(data.rank * rows, (data.rank + 1) * rows)
        losses.append(float(module.train_step(**{n: batches[n][step][share] for n in batches.files})))
    module.eval()
    last = {n: batches[n][-1] for n in batches.files}
    evaluated = float(module(**last))
    # the logits a member holds a slice of: the class the group's argmax picks (graphforge train's eval accuracy)
    sliced = next((n for n, axis in group.role.split_outputs.items() if axis == 1), None)
    chosen = _argmax_across(module(**last, outputs=[sliced])[1], group) if sliced else np.zeros(0)
    whole = group.whole_state()
    shapes = {name: list(value.shape) for name, value in module.parameters.items()}
    with open(f"{case['out']}-rank{world.rank}.json", "w") as f:
        where = {"node": int(os.environ.get("GROUP_RANK", 0)), "tensor_ranks": list(tensor.ranks or range(tensor.size))}
        json.dump({"shapes": shapes, "reductions": group.stats.reductions, **where}, f)
    if whole is not None and data.rank == 0:  # every replica holds the same state
        whole.save(f"{case['out']}-whole.safetensors")
        np.savez(
            f"{case['out']}-losses.npz",
            losses=np.array(losses),
            eval=np.array(evaluated),
            grad_norm=np.array(module.last_grad_norm),
            argmax=chosen,
        )


def train_staged(case: dict, world: World) -> None:
    """A mesh of tensor groups and pipeline stages (T × S = the world): each member of a
    stage's tensor group runs its stage of its own program (``tensor_parallel(size=T,
    rank=t)`` after the case's loss, the pipeline ending with the pipeline pass), on every batch
    cut into the program's micro-batches. Each stage's tensor-group member 0 writes the
    stage's tensors joined from its group's (``<out>-stage<s>.npz``), rank 0 the losses. With
    ``data`` = D, D such pipelines (T × S × D), each taking its 1/D of every micro-batch's rows,
    their stages' accumulated gradients averaged across the replicas before the update."""
    stages, replicas = case["stages"], case.get("data", 1)
    mesh = world.mesh(tensor=world.size // (stages * replicas), stages=stages)
    tensor, pipe, data = mesh.tensor, mesh.stages, mesh.data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        member = graphforge.compile(case["model"], member_pipeline(case["pipeline"], tensor.size, tensor.rank)).model
    stage = Stage(
        member,
        CheckpointState.from_program(member),
        TorchTransport(pipe),
        intra_op_threads=1,
        replicas=StageReplicas.of_mesh(mesh) if replicas > 1 else None,
    )
    group = TensorParallel(stage, tensor)
    batches = np.load(case["batches"])
    m = stage.microbatches
    losses = []
    for step in range(len(batches[batches.files[0]])):
        rows = len(batches[batches.files[0]][step]) // m
        share = rows // replicas
        micro = [
            {
                n: batches[n][step][i * rows + data.rank * share : i * rows + (data.rank + 1) * share]
                for n in batches.files
            }
            for i in range(m)
        ]
        losses.append(stage.train_step(micro).loss)
    whole = group.whole_state()  # this stage's tensors, joined across its tensor group
    if whole is not None and data.rank == 0:
        np.savez(f"{case['out']}-stage{pipe.rank}.npz", **{n: whole.tensors[n] for n in stage.parts.carried})
    if world.rank == 0:
        np.savez(f"{case['out']}-losses.npz", losses=np.array(losses), grad_norm=np.array(stage.last_grad_norm))


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    world = World.join(timeout_s=spec.get("timeout_s", 60))
    try:
        for case in spec["cases"]:
            (train_staged if case.get("stages") else train)(case, world)
    except DistributedError as exc:  # one line naming who is gone, as graphforge train prints it
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(3)
    finally:
        world.leave()


if __name__ == "__main__":
    main()
