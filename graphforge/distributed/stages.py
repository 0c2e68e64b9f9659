"""Pipeline parallelism: one process per stage, each running its stage's segments of the
program in the order a schedule's action list gives, with the activations and their
gradients sent between neighbouring stages.

The program says where the stages are (passes/stage_partition.py); graphforge/placement/stages.py
cuts it into each stage's forward, backward and update segments and names the tensors of
every message. A :class:`Stage` holds only its own stage's parameters and states
(on onnxruntime's device, in the runner's ping-pong buffers) and follows its action list
(graphforge/distributed/schedules.py) step by step:

- ``RECV_F`` / ``RECV_B``: the tensors of micro-batch m's forward (backward) message, from
  the previous (next) stage; ``SEND_F`` / ``SEND_B``: the same to the next (previous) one,
  without waiting for the receiver (the sends are waited for at the end of the step);
- ``F`` / ``B``: the stage's forward or backward segment on micro-batch m; the backward
  adds the micro-batch's gradients into the stage's accumulators (the first overwrites);
- after the last action, the update: the stages gather their partial sums of squared
  gradients (one all_reduce of a vector, exact: every slot but one is zero), and each
  computes the same global norm and clipping and updates its own parameters.

A message is two point-to-point transfers: a header of the tensors' shapes, then one flat
buffer of their bytes (their dtypes are the program's). Every receive runs under the
group's timeout, so a stage that died or hangs ends the run with an error naming it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from graphforge.distributed.data_parallel import broadcast_carried
from graphforge.distributed.schedules import (
    BACKWARD,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    make_schedule,
)
from graphforge.distributed.world import DistributedError
from graphforge.errors import GraphforgeError
from graphforge.model_io import ModelSource
from graphforge.placement.stages import StageSegments, stage_segments
from graphforge.program import ProgramRoles, program_proto
from graphforge.runtime.chain import Chains, GroupMember
from graphforge.runtime.checkpoint import CheckpointState
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.dlpack import ortvalue_of, tensor_of, torch_dtype
from graphforge.runtime.dropout import run_key
from graphforge.runtime.runner import BoundSession, Runner, SegmentRun, to_numpy
from graphforge.runtime.training import DROPOUT_MODES, check_choice, training_program

#: the most dims a tensor of a message may have (the header's room per tensor)
MAX_RANK = 8


class Transport(Protocol):
    """How a stage talks to the others: point-to-point messages of tensors between
    neighbours, and the two collectives of a step (the partial norms, the loss)."""

    stage: int
    stages: int

    def send(self, peer: int, values: Sequence[ort.OrtValue], what: str) -> None:
        """Start sending ``values`` to stage ``peer`` (done by :meth:`flush`)."""

    def receive(self, peer: int, dtypes: Sequence[np.dtype], what: str) -> list[ort.OrtValue]:
        """The next message from stage ``peer``: tensors of ``dtypes``, waited for."""

    def gather(self, value: float, what: str) -> list[float]:
        """Every stage's ``value`` (float32), by stage."""

    def broadcast(self, values: Sequence[float], source: int, what: str) -> list[float]:
        """Stage ``source``'s ``values`` on every stage (float64)."""

    def flush(self) -> None:
        """Wait until every message sent so far has left."""


@dataclass
class ActionTime:
    """When one action of a step ran on this stage (seconds since the step started)."""

    action: Action
    start: float
    end: float


@dataclass
class StepResult:
    """What one pipelined step gives: the mean loss over its micro-batches (every stage
    gets the last stage's), the global gradient norm, and, when timed, each action's span."""

    loss: float
    grad_norm: float | None
    seconds: float
    times: list[ActionTime] = field(default_factory=list)
    #: the wall-clock time (time.time()) the step started at: the stages' times on one clock
    started_at: float = 0.0


class Stage(GroupMember):
    """Stage ``transport.stage`` of a program the pipeline pass split::

        world = World.join()                                  # torchrun, one process per stage
        stage = Stage("program.onnx", state, TorchTransport(world))
        for step_batches in batches:                          # M micro-batches per step
            result = stage.train_step(step_batches)           # every stage gets the loss

    ``state``: the program's CheckpointState (every stage reads its own tensors from it;
    :meth:`tensors` gives them back). ``schedule``: the program's unless given ("gpipe",
    "1f1b"). ``dropout``: as Module's; "seeded" (default) seeds the masks per micro-batch, so
    a pipelined step draws exactly the masks of one process running the same micro-batches;
    "onnxruntime" keeps onnxruntime's own Dropout (each segment's mask output carries the
    forward's mask to the backward, as it does in one process).
    """

    def __init__(
        self,
        program: ModelSource,
        state: CheckpointState,
        transport: Transport,
        *,
        device: str | None = None,
        intra_op_threads: int | None = None,
        schedule: str | None = None,
        timed: bool = False,
        replicas: StageReplicas | None = None,
        dropout: str = "seeded",
    ):
        check_choice("dropout", dropout, DROPOUT_MODES)
        proto = program_proto(program)
        roles = ProgramRoles.of_proto(proto).require_training_program()
        role = roles.stages
        if role is None:
            raise GraphforgeError(
                "the program has no pipeline stages: compile it with the pipeline pass "
                '(e.g. "..., adamw(lr=1e-3, accumulate=true), pipeline(stages=2, microbatches=4)")'
            )
        if transport.stages != role.stages:
            raise GraphforgeError(
                f"the program has {role.stages} pipeline stages but {transport.stages} processes run it; "
                f"start it with torchrun --nproc-per-node={role.stages}"
            )
        state.check(roles.carried)
        self.roles, self.role, self.transport, self.state = roles, role, transport, state
        self.stage, self.stages, self.microbatches = transport.stage, role.stages, role.microbatches
        self.timed = timed
        #: data parallelism: this stage's replicas in the other pipelines (None: one pipeline)
        self.replicas = replicas
        self.replica = replicas.index if replicas is not None else 0
        runner_device = resolve_device(device)
        train_program, self._key = training_program(proto, roles, runner_device.type, dropout)
        self.parts: StageSegments = stage_segments(train_program, self.stage)
        specs = [roles.carried_spec(name) for name in self.parts.carried]
        self.runner = Runner(
            [s for s in specs if s is not None],
            runner_device,
            batch_inputs=roles.batch_input_names(),
            intra_op_threads=intra_op_threads,
            spin=False,  # a step runs the forward, backward and update segments: see Runner
        )
        self.runner.write_tensors({name: state.tensors[name] for name in self.parts.carried})
        self._buffers = [n for n in self.parts.carried if roles.carried_spec(n).role == "buffer"]
        if replicas is not None:  # as DDP: every replica starts from replica 0's state
            replicas.broadcast(self.runner, list(self.parts.carried), "broadcasting replica 0's state")
        self.actions = make_schedule(schedule or role.schedule, role.stages, role.microbatches)[self.stage]
        # a segment that computes nothing (the backward of a first stage without parameters) is not run
        segments = [("forward", self.parts.forward), ("backward", self.parts.backward)]
        segments += [(f"update {i}", seg) for i, seg in enumerate(self.parts.update)]
        self._models = {label: seg.model for label, seg in segments if seg.model.graph.node}
        #: a tensor-parallel group this stage is a member of (attach_collectives): its runs are cut after the sums
        self._chains: Chains | None = None
        self.reducer = None  # (a stage's replicas average through ``replicas``)
        self._update_labels = [label for label in self._models if label.startswith("update")]
        for label in self._models:  # sessions made now: a load error shows before the first step
            self._session(label)
        types = self.parts.dtypes
        self._dtypes = {
            "receive_forward": [types[n] for n in self.parts.receive_forward],
            "receive_backward": [types[n] for n in self.parts.receive_backward],
        }
        self.loss_name = roles.loss or "loss"
        self.last_grad_norm: float | None = None
        self._written: list = []  # what the last step's update wrote (undo_last_run brings it back)

    def _session(self, label: str) -> BoundSession:
        """The session of one segment (its profiled twin while profiling)."""
        model = self._models[label]
        return self.runner.session(
            ("stage", label), lambda: model, f"stage {self.stage}'s {label} segment", profile=True
        )

    # ------------------------------------------------------------------ a step

    def train_step(self, microbatches: Sequence[Mapping[str, Any]]) -> StepResult:
        """One optimizer step over ``microbatches`` (as many as the program's micro-batches;
        each maps batch input names to arrays; a stage feeds the ones its segments read)."""
        if len(microbatches) != self.microbatches:
            raise GraphforgeError(
                f"a step of this pipeline takes {self.microbatches} micro-batches, got {len(microbatches)}"
            )
        started, started_at = time.perf_counter(), time.time()
        lr = self.state.learning_rate if self.state.learning_rate is not None else self.roles.default_lr
        if lr is None or not math.isfinite(lr):
            raise GraphforgeError("no learning rate: the program has none and the state sets none")
        values: list[dict[str, Any]] = [{} for _ in range(self.microbatches)]
        losses: list[float] = []
        times: list[ActionTime] = []
        parts, transport, last = self.parts, self.transport, self.microbatches - 1
        step = int(self.state.step)
        if self.replicas is not None and self._buffers:  # DDP's broadcast_buffers: replica 0's statistics
            self.replicas.broadcast(self.runner, self._buffers, f"broadcasting the buffers before step {step + 1}")
        if hasattr(transport, "expect"):  # the step's receives, posted ahead
            for kind, peer, dtypes in (
                (RECV_F, self.stage - 1, self._dtypes["receive_forward"]),
                (RECV_B, self.stage + 1, self._dtypes["receive_backward"]),
            ):
                transport.expect(peer, [dtypes] * sum(1 for a in self.actions if a.kind == kind))
        for action in self.actions:
            begun = time.perf_counter()
            m = action.microbatch
            what = f"step {step + 1} micro-batch {m}"
            if action.kind == RECV_F:
                got = transport.receive(self.stage - 1, self._dtypes["receive_forward"], f"{what}: activations")
                values[m].update(zip(parts.receive_forward, got, strict=True))
            elif action.kind == RECV_B:
                got = transport.receive(self.stage + 1, self._dtypes["receive_backward"], f"{what}: gradients")
                values[m].update(zip(parts.receive_backward, got, strict=True))
            elif action.kind == SEND_F:
                transport.send(self.stage + 1, [values[m][n] for n in parts.send_forward], f"{what}: activations")
            elif action.kind == SEND_B:
                transport.send(self.stage - 1, [values[m][n] for n in parts.send_backward], f"{what}: gradients")
            elif action.kind == FORWARD:
                feeds = {**microbatches[m], **values[m], **self._scalars(lr, step, m)}
                host = self._run("forward", feeds, values[m])
                if self.loss_name in host:
                    losses.append(float(host[self.loss_name]))
            elif action.kind == BACKWARD:
                self._run("backward", {**microbatches[m], **values[m], **self._scalars(lr, step, m)}, values[m])
            if action.kind in (BACKWARD, SEND_B) and m != last and self._done_with(action):
                values[m] = {}  # the stash of micro-batch m is not needed any more
            if self.timed:
                times.append(ActionTime(action, begun - started, time.perf_counter() - started))
        transport.flush()
        self._written = []
        grad_norm = self._update(values[last], lr, step)
        self.last_grad_norm = grad_norm
        loss = sum(losses) / len(losses) if losses else math.nan
        (loss,) = transport.broadcast([loss], self.stages - 1, f"step {step + 1}: the loss")
        if self.replicas is not None:
            loss = self.replicas.mean(loss, f"step {step + 1}: the loss over the replicas")
        self.state.step = step + 1
        self.state.micro_batch = 0
        return StepResult(loss, grad_norm, time.perf_counter() - started, times, started_at)

    def _done_with(self, action: Action) -> bool:
        """Whether ``action`` is the last one of its micro-batch on this stage."""
        return action.kind == SEND_B or self.stage == 0

    def _execute(self, label: str, bound: BoundSession, feeds: dict[str, Any], fetch: list[str], sends: list[str]):
        """One run of segment ``label``: as it is, or cut after its sums in a tensor group."""
        if self._chains is None:
            return self.runner.execute([SegmentRun(bound, fetch, sends)], feeds)
        model = self._models[label]
        where = f"stage {self.stage}'s {label} segment"
        keep = list(bound.outputs)
        runs, hook = self._chains.runs(("stage", label), lambda: model, where, keep, fetch, sends, static=False)
        return self.runner.execute(runs, feeds, hook=hook)

    def _run(self, label: str, feeds: dict[str, Any], into: dict[str, Any]) -> dict[str, np.ndarray]:
        if label not in self._models:
            return {}
        bound = self._session(label)
        loss = [self.loss_name] if self.loss_name in bound.outputs else []
        sends = [o for o in bound.outputs if o not in self.runner.by_output and o not in loss]
        done = self._execute(label, bound, feeds, loss, sends)
        into.update(done.device)
        return done.host

    def _update(self, last: dict[str, Any], lr: float, step: int) -> float | None:
        """The update segment(s): with partial norms, this stage's partial, the gathering
        (every stage takes part, one without parameters with 0), then the rest."""
        if self.replicas is not None:  # the accumulated gradients, averaged over the replicas
            boundary = self.roles.gradient_boundary
            names = [boundary[p] for p in self.parts.carried if p in boundary and boundary[p] in last]
            self.replicas.average([last[n] for n in names], f"step {step + 1}: the gradient allreduce")
        feeds = {**last, **self._scalars(lr, step, 0)}
        updates = [(label, self._session(label)) for label in self._update_labels]
        results: dict[str, np.ndarray] = {}
        if self.role.partial_norms:
            mine = 0.0
            if self.parts.partial_norm is not None:
                results.update(self._run_update(updates.pop(0), feeds))
                mine = float(results[self.parts.partial_norm])
            gathered = self.transport.gather(mine, f"step {step + 1}: the gradient norm")
            for s, name in self.role.partial_norms:
                feeds[name] = np.array(gathered[s], np.float32)
        for update in updates:
            results.update(self._run_update(update, feeds))
        name = self.roles.grad_norm
        if name in results:
            return float(results[name])
        if self.role.partial_norms:  # a stage without parameters: the norm from the gathered partials
            return float(np.sqrt(np.sum(np.array(gathered, np.float32), dtype=np.float32)))
        return None

    def _run_update(self, update: tuple[str, BoundSession], feeds: dict[str, Any]) -> dict[str, np.ndarray]:
        label, bound = update
        fetch = [n for n in (self.roles.grad_norm, self.parts.partial_norm) if n in bound.outputs]
        sends = [o for o in bound.outputs if o not in self.runner.by_output and o not in fetch]
        done = self._execute(label, bound, feeds, fetch, sends)
        self._written += done.written
        feeds.update(done.device)
        return done.host

    def _scalars(self, lr: float, step: int, microbatch: int) -> dict[str, np.ndarray]:
        roles = self.roles
        scalars = {roles.lr_input: np.array(lr, np.float32), roles.step_input: np.array(step, np.int64)}
        if roles.reset_input is not None:
            scalars[roles.reset_input] = np.array(microbatch == 0, np.bool_)
        if self._key is not None:
            seed = int(self.state.seeds.get("dropout", 0))
            scalars[self._key] = run_key(seed, step, microbatch, self.replica)
        return scalars

    def start_profiling(self, prefix) -> None:
        """Profile this stage's runs from now on (see Module.start_profiling)."""
        self.runner.start_profiling(prefix)

    def end_profiling(self):
        return self.runner.end_profiling()

    def undo_last_run(self) -> None:
        """Put this stage's parameters and states back as they were before the last step's
        update (the ping-pong buffers still hold them: nothing is copied), and the step count."""
        if not self._written:
            raise GraphforgeError("nothing to undo: no step since the stage was made or the last undo")
        Runner.restore(self._written)
        self._written = []
        self.state.step = int(self.state.step) - 1
        self.last_grad_norm = None

    # ------------------------------------------------------------------ what a training loop asks of it

    @property
    def device(self) -> str:
        return self.runner.device.name

    @property
    def learning_rate(self) -> float:
        lr = self.state.learning_rate
        return float(self.roles.default_lr if lr is None else lr)

    def get_learning_rate(self) -> float:
        return self.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """What an LR schedule calls (the stage is its own optimizer: the update is in the program)."""
        if isinstance(lr, bool) or not isinstance(lr, int | float | np.floating) or not math.isfinite(lr) or lr < 0:
            raise GraphforgeError(f"the learning rate must be a finite number ≥ 0, got {lr!r}")
        self.state.learning_rate = float(lr)

    # ------------------------------------------------------------------ state

    def tensors(self) -> dict[str, np.ndarray]:
        """This stage's carried tensors (copies), by name."""
        return self.runner.read_tensors()

    def gathered_tensors(self) -> dict[str, np.ndarray] | None:
        """Every stage's carried tensors on stage 0 (None on the others); every stage must call it."""
        mine = self.tensors()
        if self.stage != 0:
            self.transport.send(0, [ort.OrtValue.ortvalue_from_numpy(v) for v in mine.values()], "the state")
            self.transport.flush()
            return None
        gathered = dict(mine)
        for s in range(1, self.stages):
            names = [n for n, owner in self.parts.owners.items() if owner == s]
            dtypes = [np.dtype(self.roles.carried_spec(n).dtype) for n in names]
            got = self.transport.receive(s, dtypes, f"stage {s}'s state")
            gathered.update({n: to_numpy(v) for n, v in zip(names, got, strict=True)})
        return gathered


class StageReplicas:
    """One stage's copies in the data-parallel pipelines (DP × PP): the ranks holding the same
    stage in each pipeline, as a torch.distributed group. The world's ranks are laid out
    pipeline by pipeline, rank = replica × stages + stage (a pipeline's stages are neighbours,
    on one machine when a machine runs whole pipelines). Every rank makes every stage's group
    (torch requires it of all ranks, in the same order) and keeps its own."""

    def __init__(self, world, stages: int):
        import torch.distributed as dist

        if world.size % stages:
            raise GraphforgeError(f"{world.size} processes cannot run pipelines of {stages} stages")
        self.world, self.stages = world, stages
        self.count = world.size // stages
        self.index, self.stage = divmod(world.rank, stages)
        self.ranks = [d * stages + self.stage for d in range(self.count)]
        with world.collective("making the stages' data-parallel groups"):
            groups = [dist.new_group([d * stages + s for d in range(self.count)]) for s in range(stages)]
        self.group = groups[self.stage]

    @classmethod
    def of_mesh(cls, mesh) -> StageReplicas:
        """The replicas of this process's stage in a mesh's other pipelines (T × S × D): the
        same stage and tensor-group member of every data replica, the mesh's data group."""
        replicas = cls.__new__(cls)
        data = mesh.data
        replicas.world, replicas.stages = data, mesh.stages.size
        replicas.count, replicas.index, replicas.stage = data.size, data.rank, mesh.stages.rank
        replicas.ranks = [data.global_of(r) for r in range(data.size)]
        replicas.group = data.group
        return replicas

    def average(self, values: Sequence[ort.OrtValue], what: str) -> None:
        """Each of ``values`` replaced in place by its mean over the replicas (one flat all_reduce)."""
        import torch
        import torch.distributed as dist

        if not values:
            return
        tensors = [tensor_of(v) for v in values]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        with self.world.collective(what):
            dist.all_reduce(flat, group=self.group)
        flat.div_(self.count)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()

    def broadcast(self, runner: Runner, names: Sequence[str], what: str) -> None:
        """Replica 0's current values of the carried tensors ``names``, in place on every replica."""
        broadcast_carried(self.world, runner, names, self.ranks[0], what, group=self.group)

    def mean(self, value: float, what: str) -> float:
        """``value``'s mean over the replicas (every rank of a pipeline holds the same value)."""
        (total,) = self.world.sum([value], what)
        return total / self.world.size


class TorchTransport:
    """Messages between the stages of one pipeline over torch.distributed (gloo on the CPU,
    NCCL on CUDA): each is a header of the tensors' shapes and one flat byte buffer, sent
    with ``isend`` (waited for at :meth:`flush`) and received with ``irecv`` under the
    group's timeout. Stage s is rank ``first + s`` (``first``: 0 for a run of one pipeline)."""

    def __init__(self, world, *, first: int = 0, stages: int | None = None):
        self.world = world
        self.first = first
        self.stages = stages if stages is not None else world.size
        self.stage = world.rank - first
        if not 0 <= self.stage < self.stages:
            raise GraphforgeError(
                f"rank {world.rank} is not in the pipeline of ranks {first}..{first + self.stages - 1}"
            )
        # with several pipelines side by side, each pipeline's collectives (the partial norms,
        # the loss) stay among its stages: every rank makes every pipeline's group, in order;
        # a pipeline of a mesh (World.mesh(...).stages) is a group already
        self.group = world.group
        if world.ranks is None and self.stages < world.size:
            import torch.distributed as dist

            with world.collective("making the pipelines' groups"):
                groups = {
                    start: dist.new_group(list(range(start, start + self.stages)))
                    for start in range(0, world.size, self.stages)
                }
            self.group = groups[first]
        self._pending: list[tuple[Any, Any]] = []  # (work, buffer kept alive until sent)
        #: per peer: the prefetching receives under way (queue, messages still to take, thread)
        self._inboxes: dict[int, list[tuple[queue.Queue, int, threading.Thread]]] = {}

    def _rank(self, stage: int) -> int:
        """Stage ``stage``'s rank in the whole run."""
        return self.world.global_of(self.first + stage)

    def send(self, peer: int, values: Sequence[ort.OrtValue], what: str) -> None:
        import torch
        import torch.distributed as dist

        if not values:  # both sides know the message is empty: nothing goes
            return
        tensors = [tensor_of(v) for v in values]
        header = torch.tensor(_header([tuple(t.shape) for t in tensors]), dtype=torch.int64)
        payload = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
        device = self.world.device
        buffers = [header.to(device)] + ([payload.to(device)] if payload.numel() else [])
        with self.world.collective(f"sending {what} to stage {peer}"):
            for buffer in buffers:
                self._pending.append((dist.isend(buffer, self._rank(peer)), buffer))

    def expect(self, peer: int, messages: Sequence[Sequence[np.dtype]]) -> None:
        """Receive the next ``messages`` (their dtypes) from ``peer`` in a thread from now on,
        so each transfer runs while this stage computes: gloo moves a message only once its
        receive is posted. :meth:`receive` then takes them in order."""
        if not messages:
            return
        inbox: queue.Queue = queue.Queue()

        def fetch() -> None:
            for dtypes in messages:
                try:
                    inbox.put(self._receive_now(peer, dtypes, "a prefetched message"))
                except BaseException as exc:  # handed to the receive that wanted this message
                    inbox.put(exc)
                    return

        thread = threading.Thread(target=fetch, name=f"graphforge-receive-{peer}", daemon=True)
        self._inboxes.setdefault(peer, []).append((inbox, len(messages), thread))
        thread.start()

    def receive(self, peer: int, dtypes: Sequence[np.dtype], what: str) -> list[ort.OrtValue]:
        inboxes = self._inboxes.get(peer)
        if not inboxes:
            return self._receive_now(peer, dtypes, what)
        inbox, left, thread = inboxes[0]
        inboxes[0] = (inbox, left - 1, thread)
        if left == 1:
            inboxes.pop(0)
        try:
            got = inbox.get(timeout=self.world.timeout_s + self.world.check_in_s + 5)
        except queue.Empty:
            got = TimeoutError(f"no message within {self.world.timeout_s:g} s")
        if isinstance(got, BaseException):
            if isinstance(got, DistributedError):
                raise DistributedError(str(got).replace("a prefetched message", what)) from None
            waited = self.world.timeout_s if isinstance(got, TimeoutError) else None
            raise self.world.failure(f"receiving {what} from stage {peer}", got, waited=waited)
        return got

    def _receive_now(self, peer: int, dtypes: Sequence[np.dtype], what: str) -> list[ort.OrtValue]:
        import torch
        import torch.distributed as dist

        if not dtypes:
            return []
        device = self.world.device
        header = torch.empty(len(dtypes) * (MAX_RANK + 1), dtype=torch.int64, device=device)
        with self.world.collective(f"receiving {what} from stage {peer}"):
            dist.irecv(header, self._rank(peer)).wait(timeout=_timeout(self.world))
            shapes = _shapes(header.cpu().tolist(), len(dtypes))
            sizes = [math.prod(s) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes, strict=True)]
            payload = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            if payload.numel():
                dist.irecv(payload, self._rank(peer)).wait(timeout=_timeout(self.world))
        out, offset = [], 0
        for shape, dtype, size in zip(shapes, dtypes, sizes, strict=True):
            chunk = payload[offset : offset + size].view(torch_dtype(dtype)).reshape(shape)
            out.append(ortvalue_of(chunk))
            offset += size
        return out

    def gather(self, value: float, what: str) -> list[float]:
        import torch
        import torch.distributed as dist

        slots = torch.zeros(self.stages, dtype=torch.float32, device=self.world.device)
        slots[self.stage] = value  # every other slot is 0: the sum is exactly each stage's value
        with self.world.collective(what):
            dist.all_reduce(slots, group=self.group)
        return slots.cpu().tolist()

    def broadcast(self, values: Sequence[float], source: int, what: str) -> list[float]:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.world.device)
        with self.world.collective(what):
            dist.broadcast(tensor, self._rank(source), group=self.group)
        return tensor.cpu().tolist()

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        with self.world.collective("waiting for the messages sent to the next stages"):
            for work, _ in pending:
                work.wait(timeout=_timeout(self.world))


def _header(shapes: Sequence[tuple[int, ...]]) -> list[int]:
    out = []
    for shape in shapes:
        if len(shape) > MAX_RANK:
            raise GraphforgeError(f"a tensor of rank {len(shape)} crosses a pipeline stage; at most {MAX_RANK}")
        out += [len(shape), *shape, *[0] * (MAX_RANK - len(shape))]
    return out


def _shapes(header: list[int], count: int) -> list[tuple[int, ...]]:
    shapes = []
    for i in range(count):
        entry = header[i * (MAX_RANK + 1) : (i + 1) * (MAX_RANK + 1)]
        shapes.append(tuple(entry[1 : 1 + entry[0]]))
    return shapes


def _timeout(world):
    from datetime import timedelta

    return timedelta(seconds=world.timeout_s)
