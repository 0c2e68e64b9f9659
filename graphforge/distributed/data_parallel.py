"""Data parallelism for a Module: every replica runs the same program on its share of the
batch, and the gradients are reduced between them as PyTorch's DDP does.

The program says where (passes/allreduce.py): each gradient at the optimizer's boundary
goes through a ``graphforge.AllReduce`` call, grouped in buckets in the order backward
makes them. A training step (``module.train_step``) is cut (graphforge.placement.cut) after each
bucket's gradients, so the program runs as segments 0..B-1, each ending with a bucket's
gradients, and a last one with the update. Each bucket is one flat torch tensor; the
segment that makes its gradients writes them straight into views of it (bound to
onnxruntime through DLPack: no copy), and as soon as a bucket is complete it is reduced
with an asynchronous ``all_reduce`` while the next segment computes the next bucket
(``overlap``). The update waits for every bucket, then reads the reduced gradients from the
same memory. With gradient accumulation (``module(...)`` per micro-batch, then
``optimizer.step()``) the micro-batches run without communication and the accumulated
gradients are copied into the buckets and reduced once per step.

As DDP: parameters and every carried tensor start as rank 0's; the reduction is the mean
(the allreduce pass's ``average``); BatchNorm running statistics are broadcast from rank 0
before each training forward (DDP's ``broadcast_buffers=True``); each replica draws its own
dropout masks (``run_key(..., replica=rank)``). The loss a step reports is the mean over
the replicas.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphforge.distributed.world import DistributedError, World
from graphforge.errors import GraphforgeError
from graphforge.placement.cut import Segment, cut
from graphforge.runtime.dlpack import ortvalue_of, tensor_of, torch_device, torch_dtype
from graphforge.runtime.runner import SegmentRun
from graphforge.runtime.training import Module


@dataclass
class _Bucket:
    """One bucket: the boundary gradients it holds, in one flat tensor, and a view of each
    (as a torch tensor, and as an OrtValue over the same memory)."""

    index: int
    names: tuple[str, ...]
    flat: Any  # torch.Tensor
    tensors: dict[str, Any] = field(default_factory=dict)
    values: dict[str, ort.OrtValue] = field(default_factory=dict)


@dataclass
class CommStats:
    """Where a replica's time in communication went (seconds, summed over steps)."""

    #: blocked waiting for gradient reductions (with overlap: what backward did not hide)
    exposed_s: float = 0.0
    #: the loss mean and the BatchNorm buffer broadcast
    other_s: float = 0.0
    steps: int = 0


class DataParallel:
    """Make ``module`` one replica of a data-parallel group (``world``): its training runs
    (``train_step``, ``module(...)`` + ``optimizer.step()``) reduce the gradients across the
    replicas, as ``DistributedDataParallel`` does for a torch module::

        world = World.join()
        module = Module("program.onnx", state)
        DataParallel(module, world)     # broadcasts rank 0's state; from now on steps reduce
        for batch in my_share_of_each_batch:
            loss = module.train_step(**batch)

    The program must have the allreduce pass (``..., adamw(...), allreduce``). ``overlap``:
    reduce each bucket while backward computes the next (else each as it completes, in turn).
    """

    #: whether the reducer runs the update itself (ZeroDataParallel), or the program's segments do
    shards_update = False

    def __init__(self, module: Module, world: World, *, overlap: bool = True):
        import torch

        role = module.roles.allreduce
        if role is not None and role.zero:
            raise GraphforgeError(
                f"the program shards its update (the zero pass, stage {role.zero}): run it with "
                "graphforge.distributed.ZeroDataParallel"
            )
        self._join(module, world, overlap)
        boundary = module.roles.gradient_boundary
        carried = module.runner.carried
        self.buckets: list[_Bucket] = []
        for index, parameters in enumerate(role.buckets):
            names = tuple(boundary[p] for p in parameters)
            specs = [carried[p] for p in parameters]
            dtype = torch_dtype(specs[0].dtype)
            flat = torch.zeros(sum(int(np.prod(c.shape)) for c in specs), dtype=dtype, device=world.device)
            bucket = _Bucket(index, names, flat)
            offset = 0
            for name, c in zip(names, specs, strict=True):
                count = int(np.prod(c.shape))
                view = flat[offset : offset + count].view(c.shape)
                bucket.tensors[name], bucket.values[name] = view, ortvalue_of(view)
                offset += count
            self.buckets.append(bucket)
        self._bucket_of = {name: b for b in self.buckets for name in b.names}
        self.broadcast(list(carried), "broadcasting rank 0's parameters and state")
        module.attach_reducer(self, world.rank)

    def _join(self, module: Module, world: World, overlap: bool) -> None:
        """What every data-parallel Module needs: checks, and the state shared by the subclasses."""
        if module.roles.allreduce is None:
            raise GraphforgeError(
                "the program has no gradient allreduce: compile it with the allreduce pass after the "
                'optimizer (e.g. "loss(...), autodiff, adamw(lr=1e-3), allreduce")'
            )
        if module.reducer is not None:  # before anything changes (attach_reducer would refuse it last)
            raise GraphforgeError("this Module is already data-parallel")
        expected = str(torch_device(module.runner.device))
        if world.device != expected:
            raise DistributedError(
                f"rank {world.rank}: the Module runs on {module.device} but the group's collectives on "
                f"{world.device} ({world.backend}); make both the same device"
            )
        # a data-parallel step keeps two buffers per carried tensor: its update is cut into
        # several segments, and the train loop undoes a step whose loss is not finite
        module.runner.disable_in_place()
        self.module, self.world, self.overlap = module, world, overlap
        self.average = module.roles.allreduce.average
        self.stats = CommStats()
        #: the step cut after each bucket, per set of outputs: (segment, the bucket views it writes into)
        self._cuts: dict[Any, list[tuple[Segment, dict[str, ort.OrtValue]]]] = {}
        self._buffers = [name for name, c in module.runner.carried.items() if c.spec.role == "buffer"]

    # ------------------------------------------------------------------ the Module's reducer

    def before_forward(self) -> None:
        if self._buffers and self.world.size > 1:
            started = time.perf_counter()
            self.broadcast(self._buffers, f"broadcasting the BatchNorm buffers before step {self.step_number}")
            self.stats.other_s += time.perf_counter() - started

    def step_segments(self, key: Any, keep: list[str], fetch: list[str], dims: dict[str, int] | None = None):
        runs = self.cut_step(key, keep, dims)
        runs = [SegmentRun(r.session, [n for n in fetch if n in r.session.outputs], r.sends, r.into) for r in runs]
        self.stats.steps += 1
        return runs, self._hook()

    def reduce(self, gradients: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        for bucket in self.buckets:
            for name in bucket.names:
                bucket.tensors[name].copy_(tensor_of(gradients[name]))
        _Reduction(self, self.buckets).wait()
        self.stats.steps += 1
        return {**gradients, **{n: b.values[n] for b in self.buckets for n in b.names}}

    def mean(self, value: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        (mean,) = self.world.mean([float(value)], f"averaging the loss of step {self.step_number}")
        self.stats.other_s += time.perf_counter() - started
        return np.asarray(mean, dtype=np.asarray(value).dtype)

    # ------------------------------------------------------------------ the pieces

    def broadcast(self, names: list[str], what: str) -> None:
        """Rank 0's current values of the carried tensors ``names`` on every rank."""
        if self.world.size > 1:
            world = self.world
            broadcast_carried(world, self.module.runner, names, world.global_of(0), what, group=world.group)

    def cut_step(self, key: Any, keep: list[str], dims: dict[str, int] | None = None) -> list[SegmentRun]:
        """The training step cut after each bucket: segment k makes bucket k's gradients
        (writing them into the bucket) and what later segments need; the last one updates.
        Cut once per ``key``; each segment's session specialized to the batch's ``dims`` (the
        runner's sessions for that key and dims: capture-ready where the runner is)."""
        cuts = self._cuts.get(key)
        if cuts is None:
            cuts = self._cuts[key] = self._cut(keep)
        runner = self.module.runner
        runs = []
        for segment, into in cuts:
            run = runner.segment(segment, key=("data-parallel", key, segment.index), fetch=segment.outputs, dims=dims)
            runs.append(SegmentRun(run.session, run.fetch, run.sends, into))
        return runs

    def _cut(self, keep: list[str]) -> list[tuple[Segment, dict[str, ort.OrtValue]]]:
        module = self.module
        program = onnx.ModelProto()
        program.CopyFrom(module.train_program)  # once per set of outputs (seeded dropout's copy holds no weights)
        kept = [o for o in program.graph.output if o.name in set(keep)]
        del program.graph.output[:]
        program.graph.output.extend(kept)
        boundaries = [list(b.names) for b in self.buckets]
        update = module.roles.update_outputs
        boundaries[-1] += [o.name for o in kept if o.name not in update]  # the loss, with backward
        return [
            (segment, {n: self._bucket_of[n].values[n] for n in segment.sends if n in self._bucket_of})
            for segment in cut(program, [list(dict.fromkeys(b)) for b in boundaries])
        ]

    def _hook(self):
        """A hook for one execution: reduce each bucket once all its gradients were sent."""
        ready: set[str] = set()
        pending = list(self.buckets)

        def hook(index: int, sent: dict[str, ort.OrtValue]):
            ready.update(n for n in sent if n in self._bucket_of)
            complete = [b for b in pending if ready.issuperset(b.names)]
            for b in complete:
                pending.remove(b)
            return self._complete(complete) if complete else None

        return hook

    def _complete(self, buckets: list) -> _Reduction | None:
        """Start reducing ``buckets``, whose gradients are all written: the reduction to wait
        for before a later segment reads them (with overlap), or None when it is done."""
        reduction = _Reduction(self, buckets)
        if self.overlap:
            return reduction
        reduction.wait()
        return None

    @property
    def step_number(self) -> int:
        """The step being run, counted from 1 (for what a failed collective names)."""
        return int(self.module.state.step) + 1


class _Reduction:
    """Asynchronous all_reduce of some buckets (started at once); ``wait`` finishes them
    (and averages). A Pending for the runner's executor: it covers the buckets' gradients."""

    def __init__(self, owner: DataParallel, buckets: list[_Bucket]):
        import torch.distributed as dist

        self.owner, self.buckets = owner, buckets
        self.covers = [n for b in buckets for n in b.names]
        self.what = f"the gradient allreduce of step {owner.step_number}"
        with owner.world.collective(self.what):
            self.works = [dist.all_reduce(b.flat, group=owner.world.group, async_op=True) for b in buckets]

    def wait(self) -> Mapping[str, ort.OrtValue] | None:
        started = time.perf_counter()
        with self.owner.world.collective(self.what):
            for work in self.works:
                work.wait()
        if self.owner.average and self.owner.world.size > 1:
            for b in self.buckets:
                b.flat.div_(self.owner.world.size)
        self.owner.stats.exposed_s += time.perf_counter() - started
        return None  # the gradients were reduced in place, in the memory the segments wrote


def broadcast_carried(world: World, runner, names, source: int, what: str, group=None) -> None:
    """Rank ``source``'s current values of the runner's carried tensors ``names`` on every
    rank of ``group`` (default: all), in place, as one flat byte buffer: one collective."""
    import torch
    import torch.distributed as dist

    views = [tensor_of(runner.carried[n].value).reshape(-1).view(torch.uint8) for n in names]
    if not views:
        return
    flat = torch.cat(views)
    with world.collective(what):
        dist.broadcast(flat, source, group=group)
    if world.global_rank != source:  # (``source`` is a rank of the whole run, as torch's)
        offset = 0
        for view in views:
            view.copy_(flat[offset : offset + view.numel()])
            offset += view.numel()
