"""The split planner: which data × tensor × pipeline split of N processes trains a model
fastest within a memory per process, predicted from the programs graphforge would run. It
compiles (never runs) each candidate's program and reads its costs:

- compute: each node of one process's program at its batch (graphforge.analysis.cost) the
  longer of its FLOPs at a sustained rate (``Hardware.flops``) and its bytes moved at the
  memory's (``Hardware.memory_bandwidth``, where given: a roofline, so that the optimizer's
  elementwise update over every parameter weighs what it moves), and ``Hardware.overhead`` for each onnxruntime run
  of its step (the update, each part a tensor-parallel member's run is cut into, each
  data-parallel bucket's segment, each stage's forward and backward); with pipeline stages, each stage's forward and
  backward per micro-batch (the pipeline pass's FLOPs report, stretched by the program's
  roofline over its FLOPs alone) through the schedule simulator
  (graphforge.distributed.simulate), whose makespan holds the bubble;
- communication, at a link's ``bandwidth`` and per-message ``latency`` (the node's own link
  for a group one node holds, ``Hardware.link``): a tensor-parallel
  member's sums (each TensorParallelReduce of its program, forward and backward, and the
  vocabulary's TensorParallelMax, a ring all-reduce of 2 (T - 1) / T of its bytes), the
  data-parallel gradient reduction (2 (D - 1) / D of the gradients' bytes, in 25 MB buckets; ZeRO's reduce-scatter and all-gather move
  the same), the activations a stage sends per micro-batch (inside the simulation);
- memory: a step's predicted peak (graphforge.placement.step_memory) of the member's program
  (two buffers per carried tensor where the run is data-parallel, as DataParallel keeps
  them), less ZeRO's sharded states (and gradients at stage 2); a stage's parameters, their
  gradients, its optimizer states and the activations its schedule stashes at most.

A split without stages is also weighed with ``recompute(budget=0)`` after its optimizer: its
program's copies of the forward add to the FLOPs, and the activations it no longer keeps
leave the memory model's peak. And accumulating M = 2 or 4 batches a step (the optimizer
accumulating, train.accumulate = M): M forward/backward runs at a 1/M of the replica's
batch, whose peak is the memory model's at that batch (the accumulators held besides),
then the update once.

Nothing overlaps in the prediction (gloo on the CPU does not overlap much: the collectives
and the kernels share the cores). The global batch is the
config's; a split with D replicas gives each replica 1/D of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from graphforge import roles
from graphforge.analysis.cost import model_costs, tensor_bytes
from graphforge.distributed.schedules import make_schedule
from graphforge.distributed.simulate import Costs, simulate
from graphforge.errors import GraphforgeError
from graphforge.graph import Model
from graphforge.pass_infra import Pass
from graphforge.pass_manager import PassManager
from graphforge.passes import Recompute, StagePartition, TensorParallel
from graphforge.passes.tensor_parallel import with_tensor_parallel
from graphforge.placement.stages import UPDATE, phases
from graphforge.placement.step_memory import step_memory
from graphforge.program import ProgramRoles
from graphforge.stand_ins import weights_left_out

#: gloo's all-reduce between 2 processes on one machine (loopback), measured on the 2-core
#: EPYC VM the benchmarks run on: 16 MiB in 16 ms (2 (n - 1) / n of it moved: 1.0 GB/s), and
#: anything from 1 KiB to 64 KiB in about 2 ms (the ring's rounds wait for the peer's turn
#: on the cores; 4 bytes alone take 0.1 ms)
GLOO_BANDWIDTH = 1.0e9
GLOO_LATENCY = 2.0e-3
#: what an onnxruntime run costs besides its kernels there: the digits MLP's step (2 runs,
#: about 2 MFLOP) takes 0.27 ms
CPU_RUN_OVERHEAD = 1.3e-4
#: the data-parallel bucket the planner assumes (graphforge train's default bucket_mb)
BUCKET_BYTES = 25 * 2**20
#: micro-batches per step tried for S stages: S × each
MICROBATCH_FACTORS = (1, 2, 4)
#: recompute budgets tried for splits without stages (1.0: none; 0: the least memory)
RECOMPUTE_BUDGETS = (1.0, 0.0)
#: batches a step accumulates, tried for splits without stages (each a 1/M of the replica's)
ACCUMULATION_FACTORS = (1, 2, 4)


@dataclass(frozen=True)
class Hardware:
    """What one process has: sustained FLOP/s on training programs, memory in bytes, and the
    link to the others (bytes/s each way; seconds per collective or message)."""

    flops: float
    memory: int
    bandwidth: float = GLOO_BANDWIDTH
    latency: float = GLOO_LATENCY
    #: seconds each onnxruntime run of a step costs besides its kernels (binding, launching,
    #: the Python around it): what small models' steps are made of
    overhead: float = CPU_RUN_OVERHEAD
    #: bytes/s a process's kernels stream through memory (None: FLOPs alone time a node)
    memory_bandwidth: float | None = None
    #: processes per node (0: all on one), whose collectives among themselves take the node's
    #: own link at ``node_bandwidth`` and ``node_latency`` (NVLink beside InfiniBand, say)
    node_processes: int = 0
    node_bandwidth: float | None = None
    node_latency: float | None = None

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a collective among processes within ``span`` consecutive
        ranks: the node's link where one node holds them, else the link between nodes."""
        if self.node_processes and span <= self.node_processes:
            bandwidth = self.node_bandwidth if self.node_bandwidth is not None else self.bandwidth
            return bandwidth, self.node_latency if self.node_latency is not None else self.latency
        return self.bandwidth, self.latency


@dataclass(frozen=True)
class Split:
    """``data`` replicas × ``tensor`` members × ``stages``, ``microbatches`` per step (a
    pipeline's, or without stages the batches a step accumulates, train.accumulate), ZeRO
    stage ``zero`` over the replicas."""

    data: int
    tensor: int = 1
    stages: int = 1
    microbatches: int = 1
    zero: int = 0
    #: the recompute pass's budget (the share of the activations' bytes the backward keeps
    #: saved): 1.0 recomputes nothing
    recompute: float = 1.0

    @property
    def processes(self) -> int:
        return self.data * self.tensor * self.stages

    def __str__(self) -> str:
        text = f"D={self.data} T={self.tensor} S={self.stages}"
        if self.stages > 1 or self.microbatches > 1:
            text += f" M={self.microbatches}"
        if self.zero:
            text += f" ZeRO-{self.zero}"
        if self.recompute < 1:
            text += f" recompute={self.recompute:g}"
        return text


@dataclass(frozen=True)
class Prediction:
    """One split's predicted step: its parts (seconds), the pipeline's bubble and the memory
    of its largest process."""

    split: Split
    compute_s: float
    tensor_s: float
    data_s: float
    bubble: float
    memory: int
    fits: bool

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tensor_s + self.data_s


@dataclass(frozen=True)
class Candidate:
    """A split the planner weighed and could not predict (the reason), or did."""

    split: Split
    prediction: Prediction | None = None
    reason: str = ""


def splits(processes: int, batch: int) -> list[Split]:
    """Every split of ``processes`` graphforge can run, with a global ``batch`` each replica
    (and each micro-batch) divides."""
    out = []
    for tensor in _divisors(processes):
        for stages in _divisors(processes // tensor):
            data = processes // (tensor * stages)
            if batch % data:
                continue
            per_replica = batch // data
            if stages == 1:
                zeros = (0, 1, 2) if data > 1 else (0,)
                out += [Split(data, tensor, 1, 1, z, r) for r in RECOMPUTE_BUDGETS for z in zeros]
                # accumulation: the other way to hold fewer activations (not with recompute as well)
                accumulated = [m for m in ACCUMULATION_FACTORS if m > 1 and per_replica % m == 0]
                out += [Split(data, tensor, 1, m, z) for m in accumulated for z in zeros]
                continue
            for factor in MICROBATCH_FACTORS:
                micro = stages * factor
                if per_replica % micro == 0:
                    out.append(Split(data, tensor, stages, micro))
    return out


def plan(
    model: onnx.ModelProto,
    passes: Sequence[Pass],
    batch: int,
    dims: Mapping[str, int],
    processes: int,
    hardware: Hardware,
) -> list[Candidate]:
    """Each split's prediction (fastest first; those that do not fit the memory after those
    that do), then the splits that could not be predicted, with why. ``model``: the forward
    model; ``passes``: the training pipeline after it (loss, autodiff, the optimizer);
    ``batch``: the global batch; ``dims``: the other symbolic dims' sizes (sequence)."""
    batch_dims = batch_dims_of(model)
    if not batch_dims:
        raise GraphforgeError("the model's inputs have no symbolic batch dim for the planner to divide")
    programs = _Programs(model, list(passes))
    done = []
    for split in splits(processes, batch):
        if hardware.node_processes and split.tensor > hardware.node_processes:
            reason = (f"{split}: a tensor group of {split.tensor} would span nodes of {hardware.node_processes} "
                      "processes, its sums in every layer on the link between them: not weighed")  # fmt: skip
            done.append(Candidate(split, reason=reason))
            continue
        try:
            done.append(Candidate(split, _predict(split, programs, batch, batch_dims, dims, hardware)))
        except GraphforgeError as exc:
            done.append(Candidate(split, reason=str(exc)))
    predicted = [c for c in done if c.prediction is not None]
    predicted.sort(key=lambda c: (not c.prediction.fits, c.prediction.step_s))
    return predicted + [c for c in done if c.prediction is None]


def planned_passes(passes: Sequence[Pass], split: Split, dims: Mapping[str, int] | None = None) -> list[Pass]:
    """The training pipeline for ``split``: with a recompute budget, ``recompute(budget)``
    after the optimizer (activations weighed at ``dims``); with micro-batches, the optimizer
    accumulating (train.accumulate's, and the pipeline pass's), and with stages
    ``pipeline(stages, microbatches)`` after it."""
    out = list(passes)
    if split.recompute < 1 and not any(isinstance(p, Recompute) for p in out):
        weighed = tuple(f"{k}={v}" for k, v in sorted((dims or {}).items()))
        out.append(Recompute(budget=split.recompute, dims=weighed))
    if split.stages > 1 or split.microbatches > 1:
        out = [dataclasses.replace(p, accumulate=True) if hasattr(p, "accumulate") else p for p in out]
    if split.stages > 1:
        out.append(StagePartition(stages=split.stages, microbatches=split.microbatches))
    return out


# ---------------------------------------------------------------------- one split


class _Programs:
    """The compiled programs the splits read, each made once: (tensor size, stages, micro-batches)."""

    def __init__(self, model: onnx.ModelProto, passes: list[Pass]):
        # compiled without the weights (read for shapes and costs only): a model larger than
        # this machine's memory plans too, and no split's compile copies them
        self.model, self.passes = weights_left_out(model), passes
        self._made: dict[tuple, onnx.ModelProto | GraphforgeError] = {}
        self._measured: dict[tuple, object] = {}

    def measured(self, program: onnx.ModelProto, what: str, dims: Mapping[str, int], *more, measure):
        """``measure()``, what ``program`` costs at ``dims`` (its FLOPs, its Model, its memory),
        made once: the splits that differ only in their ZeRO stage share it."""
        key = (id(program), what, tuple(sorted(dims.items())), *more)
        if key not in self._measured:
            self._measured[key] = measure()
        return self._measured[key]

    def get(self, split: Split, dims: Mapping[str, int]) -> onnx.ModelProto:
        # (without stages, every accumulation count runs one program: accumulating)
        key = (split.tensor, split.stages, split.microbatches if split.stages > 1 else split.microbatches > 1)
        key += (split.recompute,)
        if split.recompute < 1:
            key += (tuple(sorted(dims.items())),)  # the activations it keeps depend on the batch
        made = self._made.get(key)
        if made is None:
            try:
                made = self._compile(split, dims)
            except GraphforgeError as exc:
                made = GraphforgeError(f"{split}: {exc}")
            self._made[key] = made
        if isinstance(made, GraphforgeError):
            raise made
        return made

    def _compile(self, split: Split, dims: Mapping[str, int]) -> onnx.ModelProto:
        passes = planned_passes(self.passes, split, dims)
        if split.tensor > 1:
            passes = with_tensor_parallel(passes, TensorParallel(size=split.tensor, rank=0))
        if split.stages == 1 and split.recompute == 1:
            return PassManager(passes, shapes_only=True).run(self.model).model
        # the splits of one tensor size share their program up to the pass a split adds last
        # (the pipeline's, the recompute's): compiled once (a deep model's dozens of stage,
        # micro-batch and replica counts)
        last = passes[-1]
        if split.stages > 1:
            last = dataclasses.replace(last, dims=tuple(f"{k}={v}" for k, v in sorted(dims.items())))
        key = ("before the last pass", split.tensor, split.stages > 1)
        before = self._made.get(key)
        if before is None:
            try:
                before = PassManager(passes[:-1], shapes_only=True).run(self.model).model
            except GraphforgeError as exc:
                before = exc
            self._made[key] = before
        if isinstance(before, GraphforgeError):
            raise before
        return PassManager([last], shapes_only=True).run(before).model


@dataclass(frozen=True)
class _Program:
    """A split's program as its prediction reads it: at the dims of its runs (a micro-batch),
    its nodes' (FLOPs, bytes), and the bytes of its parameters and optimizer states."""

    proto: onnx.ModelProto
    roles: ProgramRoles
    model: Model
    dims: dict[str, int]
    by_node: dict[int, tuple[float, float]]
    parameter_bytes: int
    state_bytes: int

    @classmethod
    def read(cls, split: Split, programs: _Programs, dims: dict[str, int]) -> _Program:
        proto = programs.get(split, dims)
        program_roles = ProgramRoles.of_proto(proto)
        if split.tensor > 1 and program_roles.optimizer == "lamb":
            raise GraphforgeError(f"{split}: LAMB does not run tensor-parallel yet (its trust ratio takes whole norms)")
        model = programs.measured(proto, "model", {}, measure=lambda: Model.from_proto(proto))
        by_node = programs.measured(proto, "costs", dims, measure=lambda: model_costs(model, dims))
        parameter_bytes = sum(_bytes(c) for c in program_roles.carried if c.role == "parameter")
        state_bytes = sum(_bytes(c) for c in program_roles.carried if c.role == "optimizer")
        return cls(proto, program_roles, model, dims, by_node, parameter_bytes, state_bytes)


def _predict(
    split: Split, programs: _Programs, batch: int, batch_dims: set[str], dims: Mapping[str, int], hardware: Hardware
) -> Prediction:
    """``split``'s step: its compute (a pipeline's through the schedule simulator), its tensor
    group's sums, its replicas' gradient reduction, and the memory of its largest process."""
    micro = batch // split.data // split.microbatches
    program = _Program.read(split, programs, {**dims, **dict.fromkeys(batch_dims, micro)})
    # the mesh's ranks are ordered data, pipeline, tensor: a tensor group is T consecutive
    # ranks, a pipeline T × S, the data-parallel replicas all of them (each part's hardware.link)
    phase: dict[int, str] = {}  # each node's phase, where accumulation without stages needs it
    if split.stages > 1:
        compute, bubble, memory, gradient_bytes = _staged_step(split, program, hardware)
    else:
        compute, memory, phase = _replica_step(split, programs, program, hardware)
        bubble, gradient_bytes = 0.0, program.parameter_bytes
    tensor_s = _tensor_sums(split, program, phase, hardware)
    data_s = _gradient_reduction(split, gradient_bytes, hardware)
    return Prediction(split, compute, tensor_s, data_s, bubble, int(memory), memory <= hardware.memory)


def _staged_step(split: Split, program: _Program, hardware: Hardware) -> tuple[float, float, float, float]:
    """A pipeline's step (compute, bubble, memory, the gradients' bytes its largest stage
    reduces): each stage's forward and backward per micro-batch through the schedule
    simulator, then the update; the memory of the stage holding the most."""
    costs = program.roles.stages.costs
    rate = hardware.flops
    flops = sum(f for f, _ in program.by_node.values())
    seconds = _seconds(program.by_node.values(), hardware)
    stretch = seconds / (flops / rate) if flops else 1.0  # (what memory adds, spread evenly)
    # a backward is about twice its forward
    forward = [stretch * f / 3 / rate + hardware.overhead for f in costs["flops"]]
    backward = [stretch * 2 * f / 3 / rate + hardware.overhead for f in costs["flops"]]
    tensors = program.model.graph.tensors()
    cuts = program.roles.stages.cuts
    sends = max((tensor_bytes(tensors[c], program.dims) for c in cuts if c in tensors), default=0)
    bandwidth, latency = hardware.link(split.tensor * split.stages)
    comm = latency + sends / bandwidth  # a stage's activations out, its gradients back
    schedule = make_schedule(program.roles.stages.schedule, split.stages, split.microbatches)
    simulation = simulate(schedule, Costs(forward, backward, comm))
    compute = simulation.makespan + stretch * max(costs["update_flops"]) / rate + hardware.overhead
    stage = max(range(split.stages), key=lambda k: costs["parameter_bytes"][k] + costs["state_bytes"][k])
    memory = (
        2 * costs["parameter_bytes"][stage]  # the parameters and their accumulated gradients
        + costs["state_bytes"][stage]
        + costs["stash_bytes"][stage] * max(simulation.peak_stash)
    )
    return compute, simulation.bubble, memory, costs["parameter_bytes"][stage]


def _replica_step(
    split: Split, programs: _Programs, program: _Program, hardware: Hardware
) -> tuple[float, float, dict[int, str]]:
    """A step without stages (compute, memory, each node's phase where it accumulates): a
    forward/backward run (cut after each tensor sum) per micro-batch, at a 1/M of the
    replica's batch; then the update, and each data-parallel bucket's segment. Its memory is
    the step's peak, less ZeRO's shards."""
    by_node, model = program.by_node, program.model
    seconds = _seconds(by_node.values(), hardware)
    update = 0.0
    phase: dict[int, str] = {}
    if split.microbatches > 1:
        phase = programs.measured(program.proto, "phases", {}, measure=lambda: phases(model))
        update = _seconds([c for i, c in by_node.items() if phase.get(i) == UPDATE], hardware)
    backward_runs = 1 + sum(_is_reduce(n) for n in model.graph.nodes)
    other_runs = 1 + (math.ceil(program.parameter_bytes / BUCKET_BYTES) if split.data > 1 else 0)
    compute = split.microbatches * (seconds - update + backward_runs * hardware.overhead)
    compute += update + other_runs * hardware.overhead
    in_place = split.data == 1
    peak = lambda: step_memory(program.proto, dims=program.dims, in_place=in_place).peak  # noqa: E731
    memory = programs.measured(program.proto, "peak", program.dims, in_place, measure=peak)
    if split.zero:
        memory -= int(program.state_bytes * (1 - 1 / split.data))
    if split.zero >= 2:
        memory -= int(program.parameter_bytes * (1 - 1 / split.data))
    return compute, memory, phase


def _tensor_sums(split: Split, program: _Program, phase: dict[int, str], hardware: Hardware) -> float:
    """Seconds a tensor-group member spends in its sums a step: each TensorParallelReduce
    and TensorParallelMax a ring all-reduce, once per micro-batch of its stage's share (about
    1/S of the program's); accumulating without stages, the update's (the global norm's)
    once a step."""
    if split.tensor == 1:
        return 0.0
    tensors = program.model.graph.tensors()
    bandwidth, latency = hardware.link(split.tensor)
    runs = split.microbatches / split.stages
    total = 0.0
    for node in program.model.graph.nodes:
        if _is_reduce(node):
            size = tensor_bytes(tensors[node.outputs[0].name], program.dims)
            once = latency + 2 * (split.tensor - 1) / split.tensor * size / bandwidth
            total += once * (1 if phase.get(id(node)) == UPDATE else runs)
    return total


def _gradient_reduction(split: Split, gradient_bytes: float, hardware: Hardware) -> float:
    """Seconds the replicas' gradient all-reduce takes a step, in BUCKET_BYTES buckets."""
    if split.data == 1:
        return 0.0
    buckets = max(1, math.ceil(gradient_bytes / BUCKET_BYTES))
    bandwidth, latency = hardware.link(split.processes)
    return buckets * latency + 2 * (split.data - 1) / split.data * gradient_bytes / bandwidth


def _seconds(pairs, hardware: Hardware) -> float:
    """The nodes' time, each the longer of its FLOPs at the rate and its bytes at the memory's."""
    bandwidth = hardware.memory_bandwidth
    if not bandwidth:
        return sum(f for f, _ in pairs) / hardware.flops
    return sum(max(f / hardware.flops, b / bandwidth) for f, b in pairs)


def _is_reduce(node) -> bool:
    """A collective across the tensor group: a sum, or the vocabulary-parallel softmax's maximum."""
    ops = (roles.TENSOR_PARALLEL_REDUCE_OP, roles.TENSOR_PARALLEL_MAX_OP)
    return node.op in ops and node.domain == roles.MARKER_DOMAIN


def _bytes(spec) -> int:
    return int(math.prod(spec.shape)) * np.dtype(spec.dtype).itemsize


def batch_dims_of(model: onnx.ModelProto) -> set[str]:
    """The names of the inputs' first dims that are symbolic: what a batch divides."""
    initializers = {t.name for t in model.graph.initializer}
    names = set()
    for value in model.graph.input:
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].dim_param:
            names.add(dims[0].dim_param)
    return names


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
