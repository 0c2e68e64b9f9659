"""Sharded data parallelism (ZeRO stages 1 and 2) for a Module: every replica runs the
forward and backward on its share of the batch, but keeps and updates only its shard of the
optimizer states (and at stage 2 of the reduced gradients), as DeepSpeed's ZeRO and
PyTorch's FSDP (``SHARD_GRAD_OP``) do.

The program says where (passes/zero.py): each gradient at the optimizer's boundary goes
through a ``graphforge.ReduceScatter`` call, in buckets filled in the order backward makes
them, and each updated parameter through ``graphforge.AllGather``. A step runs as follows.

1. **Layout.** Each bucket's parameters are one flat buffer per bucket (padded to a multiple
   of the world size N); the runner's parameter buffers are views of it (DLPack: no copy).
   Replica r owns the r-th contiguous 1/N of every bucket, so shards split by bytes, not by
   tensor count, and a tensor may straddle two replicas (``layout()`` says which ranges each
   owns). Its optimizer states are flat buffers of its shards only.
2. **Backward.** The step is cut after each bucket's gradients (as DataParallel cuts it);
   segment k writes bucket k's gradients into a flat buffer (views bound through DLPack) and,
   as soon as the bucket is complete, an asynchronous ``reduce_scatter`` sums it across the
   replicas into this replica's shard gradient, while segment k + 1 computes the next bucket.
   Stage 1 keeps a gradient buffer per bucket (as DataParallel) and reduces it in place;
   stage 2 writes the buckets into two buffers in turn (one being reduced while the next is
   written), so that only the shard of the reduced gradients stays: its gradient memory is
   two buckets and 1/N of the model, not the model.
3. **Update.** The global gradient norm (for clipping and the report) is the square root of
   the replicas' summed shard sums of squares, reduced once together with whether any
   replica's loss is not finite, so every replica takes the same decision to skip. The
   update is the program's own arithmetic in torch's kernels (graphforge/runtime/
   fused_update.py, held equal to the ONNX update by its tests) over the shard: SGD, Adam and
   AdamW elementwise over each bucket's shard at once, LAMB per piece of tensor, its trust
   ratio from the whole tensors' norms (the pieces' squared norms summed across replicas).
4. **Gather.** Each bucket's updated shard is all-gathered into the flat parameter buffer,
   asynchronously: the runner waits for it before its next run or read of a carried tensor
   (``Runner.wait_before_reads``), so the gather overlaps what the host does between steps (the loop's
   logging, the next batch's preparation, the BatchNorm buffers' broadcast).

Gradient accumulation (``module(...)`` per micro-batch, then ``optimizer.step()``) runs the
micro-batches without communication and reduce-scatters the accumulated gradients once.
Checkpoints (``save``): each replica writes its shard of the states beside the checkpoint,
which names them (graphforge.runtime.checkpoint); loading one makes the states whole again,
so a run resumes on any number of replicas, or on one. The optimizer states start from each
replica's own state (the same checkpoint or program on every one, as graphforge train
checks); the parameters and buffers from rank 0's, as DataParallel's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from graphforge.distributed.data_parallel import DataParallel
from graphforge.distributed.world import World
from graphforge.errors import GraphforgeError
from graphforge.passes.optimizers import state_names
from graphforge.placement.buckets import shard_layout
from graphforge.runtime.dlpack import ortvalue_of, tensor_of, torch_device, torch_dtype
from graphforge.runtime.fused_update import (
    clip_coefficient,
    kernel_refusal,
    loss_scale_step,
    state_refusal,
    step_counter,
    update_tensors,
)
from graphforge.runtime.runner import SegmentRun
from graphforge.runtime.training import Module

#: the ZeRO stages: 1 shards the optimizer states, 2 the reduced gradients too
STAGES = (1, 2)


@dataclass(frozen=True)
class Piece:
    """The part of one parameter (elements ``start``..``stop`` of it, flattened) that a
    replica's shard of a bucket holds, at ``offset`` in that shard."""

    parameter: str
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass
class _Bucket:
    """One bucket: its parameters, where each lies in the flat buffer, and this replica's
    shard of it (``chunk`` elements from ``rank * chunk``)."""

    index: int
    parameters: tuple[str, ...]
    names: tuple[str, ...]  # the boundary gradient of each parameter, as segments send it
    dtype: np.dtype
    offsets: dict[str, tuple[int, int]]  # parameter -> (start, stop) in the flat buffer
    chunk: int
    flat_params: Any = None  # torch: the flat parameter buffer [chunk * N]
    grads: Any = None  # torch: the flat gradient buffer this bucket is written into [chunk * N]
    grad_views: dict[str, Any] = field(default_factory=dict)  # torch views of ``grads``, by gradient name
    values: dict[str, ort.OrtValue] = field(default_factory=dict)  # the same, as OrtValues
    shard_grad: Any = None  # torch [chunk]: the reduced gradients of this replica's shard (stage 1: in grads)
    states: dict[str, Any] = field(default_factory=dict)  # state -> torch [chunk]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def used_total(self) -> int:
        """Elements of the flat buffer that hold parameters (the rest, to ``chunk * N``, is padding)."""
        return max(stop for _, stop in self.offsets.values())


class ZeroDataParallel(DataParallel):
    """Make ``module`` one replica of a sharded data-parallel group (ZeRO): its training runs
    (``train_step``, ``module(...)`` + ``optimizer.step()``) reduce-scatter the gradients,
    update this replica's shard and gather the parameters::

        world = World.join()
        module = Module("program.onnx", state, shard_optimizer_states=True)
        zero = ZeroDataParallel(module, world)  # the states' shard taken; rank 0's parameters everywhere
        for batch in my_share_of_each_batch:
            loss = module.train_step(**batch)

    The program must have the zero pass (``..., adamw(...), zero(stage=1)``); ``stage``
    overrides the stage it records. A Module made without ``shard_optimizer_states`` works
    too: its runner lets the full states go here (its peak memory then held them once).
    ``overlap``: reduce each bucket while backward computes the next.
    """

    shards_update = True

    def __init__(self, module: Module, world: World, *, stage: int | None = None, overlap: bool = True):
        role = module.roles.allreduce
        if role is None or not role.zero:
            raise GraphforgeError(
                "the program has no sharded reduction: compile it with the zero pass after the optimizer "
                '(e.g. "loss(...), autodiff, adamw(lr=1e-3), zero(stage=1)")'
            )
        stage = role.zero if stage is None else stage
        if stage not in STAGES:
            raise GraphforgeError(f"ZeRO stage must be 1 or 2, got {stage!r}")
        why = kernel_refusal(module.roles, foreach=True) or state_refusal(module.roles)
        if why is not None:
            raise GraphforgeError(f"cannot shard this program's update: {why}")
        self._join(module, world, overlap)
        self.stage = stage
        roles, runner = module.roles, module.runner
        self.kind, self.hyper = roles.optimizer, dict(roles.hyperparameters)
        self._states = state_names(self.kind, self.hyper)  # what the optimizer keeps per parameter
        self._device = torch_device(runner.device)
        self.buckets = self._shard_buckets(self._full_states())
        self._share_parameters()
        self._gradient_buffers()
        self._bucket_of = {g: b for b in self.buckets for g in b.names}
        self._groups: dict[np.dtype, list[_Bucket]] = {}
        for bucket in self.buckets:
            self._groups.setdefault(bucket.dtype, []).append(bucket)
        self._counters = {dtype: step_counter(self._device) for dtype in self._groups}
        self._in_flight: list[_Reduction] = []
        #: every parameter's column in LAMB's vector of tensor norms (the same on every replica)
        self._parameter_index = {p: i for i, p in enumerate(p for b in self.buckets for p in b.parameters)}
        self._gathers: list = []
        # the loss scale's scalars stay the runner's, in buffers no segment writes (the update is ours)
        self._scaling_views = [tensor_of(runner.carried[n].value) for n in roles.loss_scale_states]
        self.broadcast(list(runner.carried), "broadcasting rank 0's parameters and buffers")
        module.attach_reducer(self, world.rank)

    def _full_states(self) -> dict[str, np.ndarray]:
        """Every optimizer state whole, taken from the Module: those it left unheld
        (``shard_optimizer_states``) and those its runner held until now (then let go)."""
        module, role = self.module, self.module.roles.allreduce
        names = {f"{p}.{s}" for p in role.gathered for s in self._states}
        states = module.take_unheld_states()
        states.update(module.runner.release(sorted(n for n in names if n in module.runner.carried)))
        missing = sorted(names - set(states))
        if missing:
            raise GraphforgeError(f"the Module holds no optimizer state {missing[0]!r} to shard")
        return states

    def _shard_buckets(self, states: dict[str, np.ndarray]) -> list[_Bucket]:
        """The buckets, each with its flat parameter buffer and this replica's shard of each
        optimizer state (``states`` are consumed: only the shards stay)."""
        import torch

        role, roles, runner = self.module.roles.allreduce, self.module.roles, self.module.runner
        size, rank = self.world.size, self.world.rank
        sizes = {p: math.prod(runner.carried[p].shape) for b in role.buckets for p in b}
        mine = shard_layout(role.buckets, sizes, size)[rank]
        buckets = []
        for index, parameters in enumerate(role.buckets):
            offsets, total = {}, 0
            for p in parameters:
                offsets[p] = (total, total + sizes[p])
                total += sizes[p]
            bucket = _Bucket(
                index,
                tuple(parameters),
                tuple(roles.gradient_boundary[p] for p in parameters),
                runner.carried[parameters[0]].dtype,
                offsets,
                -(-total // size),
            )
            bucket.pieces = [
                Piece(p, start, stop, offsets[p][0] + start - rank * bucket.chunk)
                for b, p, start, stop in mine
                if b == index
            ]
            dtype = torch_dtype(bucket.dtype)
            bucket.flat_params = torch.zeros(bucket.chunk * size, dtype=dtype, device=self._device)
            for name in self._states:
                shard = torch.zeros(bucket.chunk, dtype=dtype, device=self._device)
                for piece in bucket.pieces:
                    full = np.asarray(states.pop(f"{piece.parameter}.{name}")).reshape(-1)
                    shard[piece.offset : piece.offset + piece.size] = torch.from_numpy(full[piece.start : piece.stop])
                bucket.states[name] = shard
            buckets.append(bucket)
        return buckets

    def _share_parameters(self) -> None:
        """The runner's parameter buffers become views of the buckets' flat buffers, which the
        gathers write; the runner waits for a gather in flight before it reads them."""
        runner = self.module.runner
        views = {}
        for bucket in self.buckets:
            for p, (start, stop) in bucket.offsets.items():
                views[p] = ortvalue_of(bucket.flat_params[start:stop].view(runner.carried[p].shape))
        runner.share(views)
        runner.wait_before_reads(self._wait_gathers)

    def _gradient_buffers(self) -> None:
        """Stage 1: a flat gradient buffer per bucket, reduce-scattered in place (this replica's
        shard of the reduced gradients is its own chunk of it). Stage 2: two buffers per dtype,
        that the buckets are written into in turn (each as large as the largest bucket of its
        turn), reduce-scattered into a buffer of this replica's shards."""
        import torch

        size, rank = self.world.size, self.world.rank
        turns: dict[tuple, int] = {}
        turn_of: dict[int, tuple] = {}
        if self.stage == 2:
            seen: dict[np.dtype, int] = {}
            for bucket in self.buckets:
                seen[bucket.dtype] = seen.get(bucket.dtype, -1) + 1
                key = turn_of[bucket.index] = (bucket.dtype, seen[bucket.dtype] % 2)
                turns[key] = max(turns.get(key, 0), bucket.chunk * size)
        slots = {key: torch.zeros(n, dtype=torch_dtype(key[0]), device=self._device) for key, n in turns.items()}
        for bucket in self.buckets:
            padded = bucket.chunk * size
            if self.stage == 1:
                bucket.grads = torch.zeros(padded, dtype=torch_dtype(bucket.dtype), device=self._device)
                bucket.shard_grad = bucket.grads[rank * bucket.chunk : (rank + 1) * bucket.chunk]
            else:
                bucket.grads = slots[turn_of[bucket.index]][:padded]
                bucket.shard_grad = torch.zeros(bucket.chunk, dtype=torch_dtype(bucket.dtype), device=self._device)
            for p, g in zip(bucket.parameters, bucket.names, strict=True):
                start, stop = bucket.offsets[p]
                view = bucket.grads[start:stop].view(self.module.runner.carried[p].shape)
                bucket.grad_views[g], bucket.values[g] = view, ortvalue_of(view)

    # ------------------------------------------------------------------ what replicas own

    def layout(self) -> list[list[tuple[int, str, int, int]]]:
        """Which elements each replica owns (graphforge.placement.buckets.shard_layout): per replica,
        (bucket, parameter, first element, end element) of each piece, flattened."""
        sizes = {p: stop - start for b in self.buckets for p, (start, stop) in b.offsets.items()}
        return shard_layout(tuple(b.parameters for b in self.buckets), sizes, self.world.size)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this replica holds."""
        return sum(t.numel() * t.element_size() for b in self.buckets for t in b.states.values())

    def shard_tensors(self) -> dict[str, tuple[np.ndarray, int, tuple[int, ...]]]:
        """This replica's pieces of the optimizer states, for a checkpoint's shard: state name
        -> (its elements start.. as a flat array, start, the whole tensor's shape)."""
        self._wait_gathers()
        runner = self.module.runner
        pieces = {}
        for bucket in self.buckets:
            for name, shard in bucket.states.items():
                for piece in bucket.pieces:
                    values = shard[piece.offset : piece.offset + piece.size].cpu().numpy().copy()
                    pieces[f"{piece.parameter}.{name}"] = (values, piece.start, runner.carried[piece.parameter].shape)
        return pieces

    def save(self, checkpoints) -> Path:
        """Checkpoint the Module's state into ``checkpoints`` (a CheckpointManager; a collective:
        every replica calls it): each replica writes its shard of the optimizer states beside
        the checkpoint, then rank 0 the checkpoint file itself, with the rest of the state and
        the list of shards. That file, written last, makes the checkpoint whole; loading it
        joins the shards (on any number of replicas). Returns the checkpoint's path."""
        state, world = self.module.state, self.world
        step = int(state.step)
        checkpoints.save_part(state, self.shard_tensors(), world.rank, world.size)
        world.barrier(f"waiting for every process's shard of the checkpoint of step {step}")
        if world.rank != 0:
            return checkpoints.path_for(step)
        return checkpoints.save(state, shards=[checkpoints.part_path(step, r, world.size) for r in range(world.size)])

    def gathered_states(self) -> dict[str, np.ndarray]:
        """Every optimizer state whole (a collective: every replica calls it; all get them)."""
        import torch

        self._wait_gathers()
        runner, whole = self.module.runner, {}
        for bucket in self.buckets:
            for name, shard in bucket.states.items():
                full = torch.empty(bucket.chunk * self.world.size, dtype=shard.dtype, device=self._device)
                with self.world.collective(f"gathering the optimizer state {name}"):
                    _collective("all_gather")(full, shard, group=self.world.group)
                for p, (start, stop) in bucket.offsets.items():
                    whole[f"{p}.{name}"] = full[start:stop].cpu().numpy().reshape(runner.carried[p].shape).copy()
        return whole

    # ------------------------------------------------------------------ the Module's reducer

    def step_segments(self, key: Any, keep: list[str], fetch: list[str], dims: dict[str, int] | None = None):
        runs = self.cut_step(key, keep, dims)[:-1]  # the last segment is the update
        runs = [SegmentRun(r.session, [n for n in fetch if n in r.session.outputs], r.sends, r.into) for r in runs]
        self.stats.steps += 1
        return runs, self._hook()

    def _complete(self, buckets: list[_Bucket]) -> None:
        for bucket in buckets:
            self._reduce_scatter(bucket)  # waited for by the update (or at once, without overlap)

    def reduce(self, gradients: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        for bucket in self.buckets:
            for name in bucket.names:
                bucket.grad_views[name].copy_(tensor_of(gradients[name]))
            self._reduce_scatter(bucket)
        self.stats.steps += 1
        return gradients

    def _reduce_scatter(self, bucket: _Bucket) -> None:
        """Start bucket's reduce-scatter; at stage 2 first finish the one before it, whose
        buffer the next bucket is written into (without overlap: finish this one too)."""
        if self.stage == 2:
            self._finish_reductions()
            bucket.grads[bucket.used_total :].zero_()  # another bucket's gradients were there
        self._in_flight.append(_Reduction(self, bucket))
        if not self.overlap:
            self._finish_reductions()

    def _finish_reductions(self) -> None:
        while self._in_flight:
            self._in_flight.pop(0).wait()

    # ------------------------------------------------------------------ the update

    def apply_update(self, lr: float, step: int, loss: float | None) -> tuple[bool, dict[str, np.ndarray]]:
        """This replica's shard of the update, then the gather of the parameters. Returns
        whether it was applied (every replica decides alike: not when a loss or the global
        gradient norm is not finite) and what the step reports (the gradient norm).

        A program that scales its loss (mixed_precision) multiplies the reduced gradients by
        1/scale first, as its update does; gradients that are not finite then are its own
        skip, as in the program: the parameters and states stay, the scale backs off and the
        step counts (applied, ``update_skipped`` reported). The program tells them by the sum
        of the gradients, this by their norm: the same but where finite gradients have a norm
        beyond float32's range, which clipping's norm could not take either."""
        import torch

        self._finish_reductions()
        hp = self.hyper
        scaling = self.module.roles.loss_scaling
        if scaling is not None:
            inverse = torch.reciprocal(self._scaling_views[0])
            for b in self.buckets:
                b.shard_grad.mul_(inverse.to(b.shard_grad.dtype))
        # float32 norms of each shard (no float64 copy of the gradients), their squares summed in
        # float64, read back once
        norms = torch.stack([torch.linalg.vector_norm(b.shard_grad) for b in self.buckets])
        local = float(norms.double().square().sum())
        bad_loss = 0.0 if loss is None or math.isfinite(loss) else 1.0
        group = self.module.collectives  # a tensor group this replica is a member of, or None
        split = set(getattr(group, "axes", ()))
        sliced = 0.0
        pieces = [
            b.shard_grad[p.offset : p.offset + p.size] for b in self.buckets for p in b.pieces if p.parameter in split
        ]
        if pieces:  # the squares of the slices this member holds (one read back), which the other members' complete
            sliced = float(torch.stack([torch.linalg.vector_norm(g) for g in pieces]).double().square().sum())
        started = time.perf_counter()
        what = f"summing the gradient norm of step {step + 1}"
        total, sliced, bad = self.world.sum([local, sliced, bad_loss], what)
        if split:
            (every,) = group.world.sum([sliced], f"{what} across the tensor group")
            total += every - sliced
        self.stats.other_s += time.perf_counter() - started
        norm = math.sqrt(total) if math.isfinite(total) else math.nan
        reports = {}
        if self.module.roles.grad_norm is not None:
            reports[self.module.roles.grad_norm] = np.asarray(norm, dtype=np.float32)
        if bad:
            return False, reports
        if scaling is not None:
            found_inf = not math.isfinite(norm)
            reports[scaling.update_skipped] = np.asarray(found_inf)
            step = loss_scale_step(scaling, self._scaling_views, found_inf, step)
            if step is None:
                return True, reports
        elif not math.isfinite(norm):
            return False, reports
        clip = clip_coefficient(hp.get("clip_grad_norm"), norm)
        for dtype, group in self._groups.items():
            if self.kind == "lamb":
                pieces = [(b, p) for b in group for p in b.pieces]
                params = [b.flat_params[self.world.rank * b.chunk :][p.offset : p.offset + p.size] for b, p in pieces]
                grads = [b.shard_grad[p.offset : p.offset + p.size] for b, p in pieces]
                states = {s: [b.states[s][p.offset : p.offset + p.size] for b, p in pieces] for s in group[0].states}
                norms = self._whole_norms([p for _, p in pieces], step)
            else:  # elementwise: each bucket's shard at once (its padding stays zero)
                params = [b.flat_params[self.world.rank * b.chunk : (self.world.rank + 1) * b.chunk] for b in group]
                grads = [b.shard_grad for b in group]
                states = {s: [b.states[s] for b in group] for s in group[0].states}
                norms = None
            if not params:
                if norms is not None:
                    norms(torch.zeros((2, 0), dtype=torch.float64))  # the collective every replica joins
                continue
            update_tensors(
                self.kind, hp, params, grads, states, lr=lr, step=step, clip=clip,
                counter=self._counters[dtype], norms=norms,
            )  # fmt: skip
        self._start_gathers(step)
        return True, reports

    def _whole_norms(self, pieces: list[Piece], step: int):
        """For LAMB: the squared norms [2, pieces] of this replica's pieces -> those of the
        whole tensors each piece is of (summed across the replicas, one collective)."""
        import torch
        import torch.distributed as dist

        index = self._parameter_index
        columns = torch.tensor([index[p.parameter] for p in pieces], dtype=torch.long)

        def norms(partial):
            total = torch.zeros((2, len(index)), dtype=torch.float64)
            total.index_add_(1, columns, partial.cpu())
            total = total.to(self._device)
            with self.world.collective(f"summing LAMB's tensor norms of step {step + 1}"):
                dist.all_reduce(total, group=self.world.group)
            return total[:, columns.to(self._device)]

        return norms

    def _start_gathers(self, step: int) -> None:

        rank = self.world.rank
        with self.world.collective(f"gathering the parameters updated by step {step + 1}"):
            for b in self.buckets:  # in place: this replica's chunk of the flat buffer is its input
                shard = b.flat_params[rank * b.chunk : (rank + 1) * b.chunk]
                self._gathers.append(
                    (_collective("all_gather")(b.flat_params, shard, group=self.world.group, async_op=True), shard)
                )
        if not self.overlap:
            self._wait_gathers()

    def _wait_gathers(self) -> None:
        if not self._gathers:
            return
        started = time.perf_counter()
        with self.world.collective("gathering the updated parameters"):
            for work, _ in self._gathers:
                work.wait()
        self._gathers = []
        self.stats.exposed_s += time.perf_counter() - started


class _Reduction:
    """An asynchronous reduce-scatter of one bucket into this replica's shard gradient;
    ``wait`` finishes it (and averages)."""

    def __init__(self, owner: ZeroDataParallel, bucket: _Bucket):

        self.owner, self.bucket = owner, bucket
        self.what = f"the gradient reduce-scatter of step {owner.step_number}"
        with owner.world.collective(self.what):
            self.work = _collective("reduce_scatter")(
                bucket.shard_grad, bucket.grads, group=self.owner.world.group, async_op=True
            )

    def wait(self) -> None:
        started = time.perf_counter()
        with self.owner.world.collective(self.what):
            self.work.wait()
        if self.owner.world.size > 1:
            self.bucket.shard_grad.div_(self.owner.world.size)
        self.owner.stats.exposed_s += time.perf_counter() - started


def _collective(kind: str):
    """torch.distributed's one-tensor reduce-scatter or all-gather (``reduce_scatter_single``,
    ``all_gather_single`` since torch 2.10; before, the ``*_tensor`` names those replaced)."""
    import torch.distributed as dist

    new, old = {"reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
                "all_gather": ("all_gather_single", "all_gather_into_tensor")}[kind]  # fmt: skip
    return getattr(dist, new, None) or getattr(dist, old)
