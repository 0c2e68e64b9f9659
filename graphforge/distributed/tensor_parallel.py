"""Tensor parallelism: a group of processes splits each marked layer between them, as Megatron-LM.

Each member runs its own program: the forward model compiled with
``tensor_parallel(size=T, rank=r)`` before the rest of the pipeline, so that member r holds
its slice of each split weight (and its gradients and optimizer states are the slice's) and
the passes after it wrote its backward and update for its shapes. Where the split ends
(``graphforge.TensorParallelReduce`` calls: after a row-parallel projection in the forward,
before a column-parallel one's input in the backward) the members sum a value across the
group; the Module cuts every run after those calls (graphforge/runtime/chain.py) and this
module's hook sums in place between the parts, on torch.distributed (gloo on the CPU, NCCL
on CUDA). Everything else (norms, residuals, the loss) is computed alike on every member.

::

    # torchrun --standalone --nproc-per-node=2 my_training.py
    world = World.join()
    member = graphforge.compile(model, f"tensor_parallel(size=2, rank={world.rank}), loss(...), autodiff, adamw(...)")
    module = Module(member.model, member_state(whole_state, member.model))   # or its own initial state
    group = TensorParallel(module, world)
    loss = module.train_step(**batch)        # the same batch on every member
    group.save(CheckpointManager("ckpts"))   # each member its slices; loads whole, on any T
    state = group.whole_state()              # on member 0: the one-process program's state

The state of the whole program (without ``rank``) is the members' states joined along the
split axes (``join_tensors``); a member's is the whole's slice (``member_tensors``). A
checkpoint (``save``: each member writes its slices, member 0 the file that lists them; or
``whole_state`` saved by member 0) loads whole, so it resumes on any T, or on one process,
and exports.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from graphforge import roles
from graphforge.distributed.world import DistributedError, World
from graphforge.errors import GraphforgeError
from graphforge.program import (
    CarriedSpec,
    ProgramRoles,
    TensorParallelRole,
    joined_slices,
    member_range,
    member_slice,
)
from graphforge.runtime.checkpoint import CheckpointState, TensorSpec
from graphforge.runtime.dlpack import tensor_of
from graphforge.runtime.training import Module


@dataclass
class TensorStats:
    """What a member's collectives cost (summed over its runs)."""

    #: sums across the group, and the bytes each member contributed to them
    reductions: int = 0
    bytes: int = 0
    #: time in them (the members wait for each other there: it is not hidden)
    seconds: float = 0.0


def carried_axes(program_roles: ProgramRoles) -> dict[str, int]:
    """The axis along which each carried tensor of a tensor-parallel program is split: a split
    parameter's, and its optimizer states' and accumulator's (``like`` it); others are whole."""
    return {name: axis for name, (axis, _) in carried_split(program_roles).items()}


def carried_split(program_roles: ProgramRoles) -> dict[str, tuple[int, tuple[int, ...] | None]]:
    """Each split carried tensor -> (its axis, the sections a member holds a part of each of,
    or None): ``carried_axes`` with a fused projection's sections."""
    role = program_roles.tensor_parallel
    if role is None:
        return {}
    split = {}
    for spec in program_roles.carried:
        source = spec.input if spec.input in role.split else spec.like
        if source in role.split:
            split[spec.input] = (role.split[source], role.sections.get(source))
    return split


def carried_wholes(program_roles: ProgramRoles) -> dict[str, int]:
    """The whole size of the split axis of each carried tensor that the members hold unequal
    parts of (a vocabulary the group size does not divide)."""
    role = program_roles.tensor_parallel
    if role is None or not role.uneven:
        return {}
    wholes = {}
    for spec in program_roles.carried:
        source = spec.input if spec.input in role.uneven else spec.like
        if source in role.uneven:
            wholes[spec.input] = role.uneven[source]
    return wholes


def member_tensors(whole: Mapping[str, np.ndarray], split: Mapping, rank: int, size: int):
    """Member ``rank``'s tensors (of ``size``): each split tensor's slice (``split``: name ->
    its axis, or (axis, sections)), the others as they are."""
    split = _with_sections(split)
    return {
        name: member_slice(value, split[name][0], rank, size, split[name][1]) if name in split else value
        for name, value in whole.items()
    }


def join_tensors(members: Sequence[Mapping[str, np.ndarray]], split: Mapping) -> dict[str, np.ndarray]:
    """The whole program's tensors from every member's, in rank order: the split ones joined
    (``split``: name -> its axis, or (axis, sections)), the others member 0's (every member
    holds the same)."""
    split = _with_sections(split)
    return {
        name: joined_slices([m[name] for m in members], *split[name]) if name in split else value
        for name, value in members[0].items()
    }


def _with_sections(split: Mapping) -> dict[str, tuple[int, tuple[int, ...] | None]]:
    return {n: (v, None) if isinstance(v, int | np.integer) else tuple(v) for n, v in split.items()}


def member_state(whole: CheckpointState, member_program) -> CheckpointState:
    """A member's state from the whole program's (a checkpoint saved by one process, or
    ``whole_state`` at another T): its slices of the split tensors, everything else as it is."""
    program_roles = ProgramRoles.read(member_program)
    role = _member_role(program_roles)
    tensors = member_tensors(whole.tensors, carried_split(program_roles), role.rank, role.size)
    state = _with_tensors(whole, tensors, program_roles.carried)
    state.check(program_roles.carried)
    return state


def _with_tensors(state: CheckpointState, tensors: dict[str, np.ndarray], specs: Sequence[CarriedSpec]):
    """``state``'s step, learning rate, seeds and the rest, with other tensors."""
    return state.with_tensors(  # (a pipeline stage's tensors are its own only)
        tensors,
        [TensorSpec(s.input, s.role, s.dtype, tuple(tensors[s.input].shape)) for s in specs if s.input in tensors],
    )


def _member_role(program_roles: ProgramRoles) -> TensorParallelRole:
    role = program_roles.tensor_parallel
    if role is None:
        raise GraphforgeError(
            "the program has no tensor-parallel split: compile it with tensor_parallel(size=T, rank=r) first"
        )
    if role.rank is None:
        raise GraphforgeError(
            f"the program is the whole model split for {role.size} processes, not one member's: compile each member's "
            f"program with tensor_parallel(size={role.size}, rank=r) (r = its rank) before the rest of the pipeline"
        )
    return role


class TensorParallel:
    """Make ``module`` (on one member's program) a member of the tensor-parallel group of
    ``world``'s processes: its runs sum the marked values across the group from now on. Every
    member must be fed the same batches; the loss each reports is the whole model's.

    The global gradient norm (``grad_norm``, and clipping by it) is the whole model's: the
    optimizer pass sums the squares of a member's slices across the group (a
    TensorParallelReduce call of its own) before adding the replicated parameters' once.

    ``world``: the tensor group (``World.mesh(tensor=T).tensor`` in a mesh with data
    parallelism: the same Module is then a replica of ``DataParallel(module, mesh.data)``
    too, or of ``ZeroDataParallel``, its gradients reduced across the replicas between its
    forward/backward and its update).

    Refused: a program that is not a member's, a group size or rank other than the
    program's, and LAMB (its trust ratio takes whole parameters' norms). With ZeRO over the
    replicas (``ZeroDataParallel(module, mesh.data)``) the sharded update sums the split
    parameters' squares across the tensor group too, so the global norm stays the whole's.
    """

    ops: ClassVar[Mapping[str, str]] = {roles.TENSOR_PARALLEL_REDUCE_OP: "sum", roles.TENSOR_PARALLEL_MAX_OP: "max"}

    def __init__(self, module: Module, world: World):
        role = _member_role(module.roles)
        if role.size != world.size or role.rank != world.rank:
            raise DistributedError(
                f"rank {world.global_rank}, member {world.rank} of a tensor group of {world.size}: its program is "
                f"member {role.rank}'s of {role.size} (compile it with tensor_parallel(size={world.size}, "
                f"rank={world.rank}))"
            )
        if module.roles.optimizer == "lamb":
            raise GraphforgeError(
                "a tensor-parallel program cannot use LAMB yet: its trust ratio takes each whole parameter's norm, "
                "and a member holds slices (use adamw, adam or sgd)"
            )
        self.module, self.world, self.role = module, world, role
        self.stats = TensorStats()
        self.split = self.program_split = carried_split(module.roles)
        stage = getattr(module, "parts", None)  # a pipeline stage (Stage) holds its own tensors only
        if stage is not None:
            self.split = {n: v for n, v in self.split.items() if n in set(stage.carried)}
        self.axes = {name: axis for name, (axis, _) in self.split.items()}
        self.wholes = carried_wholes(module.roles)
        world.agree(
            "tensor-parallel program",
            {"size": role.size, "split": sorted(role.split.items()), "carried": sorted(self.split.items())},
        )
        module.attach_collectives(self)

    def hook(self, reduced: Sequence[Sequence[str]], how: Mapping[str, str]):
        """Reduce part k's marked outputs across the group (``how``: "sum" or "max"), in place,
        as soon as the part has run."""
        import torch.distributed as dist

        reductions = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

        def hook(index: int, sent):
            names = [n for n in reduced[index] if n in sent] if index < len(reduced) else []
            if not names or self.world.size == 1:
                return None
            started = time.perf_counter()
            what = f"the tensor-parallel sum of {names[0]!r} (step {int(self.module.state.step) + 1})"
            with self.world.collective(what):
                for name in names:
                    tensor = tensor_of(sent[name])
                    dist.all_reduce(tensor, op=reductions[how[name]], group=self.world.group)
                    self.stats.bytes += tensor.numel() * tensor.element_size()
                    self.stats.reductions += 1
            self.stats.seconds += time.perf_counter() - started
            return None

        return hook

    def current_tensors(self) -> dict[str, np.ndarray]:
        """This member's carried tensors now: the Module's, with its optimizer states gathered
        from the data-parallel replicas where ZeRO shards them (then a collective every
        replica of the member joins)."""
        module = self.module
        tensors = dict(module.tensors() if getattr(module, "parts", None) is not None else module.state.tensors)
        reducer = getattr(module, "reducer", None)
        if reducer is not None and reducer.shards_update:
            tensors.update(reducer.gathered_states())
        return tensors

    def save(self, checkpoints, tensors: Mapping[str, np.ndarray] | None = None) -> Path:
        """Checkpoint the whole model's state into ``checkpoints`` (a CheckpointManager; a
        collective: every member calls it): each member writes its slices beside the
        checkpoint, then member 0 the checkpoint file itself, with the replicated tensors, the
        rest of the state and the list of the members' files. That file, written last, makes
        the checkpoint whole; loading it joins the slices (no process ever holds them all), so
        it resumes on any T, or one process, and exports. Returns the checkpoint's path.
        ``tensors``: ``current_tensors()``, which a replica of a mesh takes first where ZeRO
        shards the states (every replica joins that; one replica's group saves)."""
        state, world, size = self.module.state, self.world, self.role.size
        step = int(state.step)
        tensors = dict(tensors) if tensors is not None else self.current_tensors()
        state = _with_tensors(state, tensors, self.module.roles.carried)
        checkpoints.save_slices(state, self.parts(tensors), self.role.rank, size)
        world.barrier(f"waiting for every member's slices of the checkpoint of step {step}")
        if self.role.rank != 0:
            return checkpoints.path_for(step)
        shards = [checkpoints.slice_path(step, r, size) for r in range(size)]
        return checkpoints.save(state, names=[n for n in tensors if n not in self.axes], shards=shards)

    def parts(self, tensors: Mapping[str, np.ndarray]) -> dict[str, tuple]:
        """This member's slices of ``tensors``' split ones, as a checkpoint file holds pieces
        (CheckpointState.save's ``parts``): each with where it starts in the whole tensor."""
        parts = {}
        for name, (axis, sections) in self.split.items():
            value = tensors[name]
            whole = list(value.shape)
            whole[axis] = self.wholes.get(name, whole[axis] * self.role.size)
            first, _ = member_range(whole[axis], self.role.rank, self.role.size)
            parts[name] = (value, first, tuple(whole), axis, sections)
        return parts

    def gather(self, value, what: str) -> list:
        """Every member's ``value`` (any picklable), in rank order (a collective)."""
        import torch.distributed as dist

        gathered: list = [None] * self.world.size
        with self.world.collective(what):
            dist.all_gather_object(gathered, value, group=self.world.group)
        return gathered

    def join(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """``tensors`` (this member's carried tensors, of the same names on every member: a
        stage's, or every stage's gathered on stage 0) with the split ones joined from every
        member's, on member 0 (None on the others; a collective)."""
        split = {n: v for n, v in tensors.items() if n in self.program_split}
        gathered = self.gather(split, "gathering the tensor-parallel members' tensors")
        if self.world.rank != 0:
            return None
        return {**tensors, **join_tensors(gathered, {n: self.program_split[n] for n in split})}

    def whole_state(self) -> CheckpointState | None:
        """On member 0, the whole program's state (the members' split tensors joined; step,
        learning rate and the rest member 0's), to save, export or resume on another T or on
        one process; None on the other members. Every member must call it (a collective)."""

        tensors = self.current_tensors()
        joined = self.join(tensors)
        if joined is None:
            return None
        return _with_tensors(self.module.state, {n: joined[n] for n in tensors}, self.module.roles.carried)
