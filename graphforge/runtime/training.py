"""The training API: Module and Optimizer over a compiled training program, on stock onnxruntime.

Familiar to users of ONNX Runtime's on-device training API::

    state = CheckpointState.from_program("program.onnx")    # or CheckpointState.load(path)
    module = Module("program.onnx", state, device="cuda")
    optimizer = Optimizer(module)
    for x, labels in batches:
        loss = module(x, labels)          # forward + backward (+ accumulate)
        optimizer.step()                  # apply the update
        module.lazy_reset_grad()          # the next call overwrites the accumulated gradients
    state.save("ckpt.safetensors")

or, without gradient accumulation, the fused fast path ``loss = module.train_step(x, labels)``:
one ``session.run`` of the whole program.

How it runs. The program is one functional training step (passes/optimizers.py). The
Module is a client of the runner (runner.py), which keeps every carried tensor (parameter,
optimizer state, accumulator, buffer) on the device, so parameters and states never leave
onnxruntime between steps and nothing is copied per step; they come back to numpy only
when asked (``state.tensors``, ``module.parameters``, ``state.save``).

The program is cut (graphforge.placement.cut) at the optimizer's gradient boundary into segment 0,
forward + backward (+ accumulate, + the gradient norm), and segment 1, the update; the
gradients (or accumulated gradients) cross between them as device OrtValues. ``module(...)``
runs segment 0, ``optimizer.step()`` segment 1, and ``train_step`` both in turn.

In place (``in_place=True``, the default): segment 1 writes the parameters and optimizer
states into the buffers it reads them from (the runner proves each safe), so they are held
once, as torch holds them. Such an update cannot be taken back, so it is applied only when
the step's loss and gradient norm are finite: otherwise the step is skipped
(``module.last_update_skipped``) and ``undo_last_run()`` puts back what segment 0 changed.
Accumulators and buffers stay in two buffers each. With ``in_place=False`` every carried
tensor lives in two buffers that runs write in turn (ping-pong), ``train_step`` is one
``session.run`` of the whole program, and any last run can be undone. Eval mode runs
``eval_model(program, ...)`` (dropout off, BatchNorm on its running statistics) with the
current parameters bound.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
import onnxruntime as ort

from graphforge.errors import GraphforgeError
from graphforge.graph import Model
from graphforge.model_io import ModelSource, save
from graphforge.passes.steps import STEPS, steps_model
from graphforge.placement.lean import lean_model
from graphforge.placement.step import IN_PLACE_ROLES, StepSplit, fused_outputs, segment_outputs, split_program
from graphforge.program import CarriedSpec, ProgramRoles, program_proto
from graphforge.runtime.chain import Chains, GroupMember
from graphforge.runtime.checkpoint import CheckpointState
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.dropout import KEY_INPUT, run_key, seeded_dropout
from graphforge.runtime.fused_update import FusedUpdate, Refused
from graphforge.runtime.inference import eval_model, export_inference_model
from graphforge.runtime.runner import (
    BoundSession,
    Carried,
    Execution,
    Hook,
    Runner,
    SegmentRun,
    batch_dims,
)
from graphforge.stand_ins import without_values

#: Module(dropout=...): counter-based masks, or onnxruntime's own Dropout
DROPOUT_MODES = ("seeded", "onnxruntime")
#: Module(update=...): the fastest correct update (torch's kernels where they compute the
#: program's update, else the program's own), torch's kernels or an error, the program's own
UPDATES = ("auto", "torch", "onnx")


class GradientReducer(Protocol):
    """What reduces a Module's gradients across data-parallel replicas
    (graphforge.distributed.DataParallel); the Module calls it around its training runs."""

    def before_forward(self) -> None:
        """Before each training forward (DDP broadcasts the buffers from rank 0 here)."""

    def step_segments(
        self, key: Any, keep: list[str], fetch: list[str], dims: dict[str, int] | None = None
    ) -> tuple[list[SegmentRun], Hook]:
        """The whole training step as segments (cut where gradients become ready) and the
        hook that reduces them between segments; ``keep``: what the step computes,
        ``fetch``: what it hands back to the host; ``key`` names the set of outputs; ``dims``:
        the batch's symbolic dims, which the segments' sessions are specialized to."""

    def reduce(self, gradients: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        """The (accumulated) gradients a forward/backward run sent, reduced: what the update reads."""

    def mean(self, value: np.ndarray) -> np.ndarray:
        """``value`` (a loss) averaged over the replicas."""

    #: whether the reducer runs the update itself (apply_update) instead of the program's
    #: update segment (ZeroDataParallel: each replica its shard); its step segments then end
    #: with the gradients
    shards_update: bool

    def apply_update(self, lr: float, step: int, loss: float | None) -> tuple[bool, dict[str, np.ndarray]]:
        """After the gradients were reduced (shards_update only): the update at ``lr`` with
        ``step`` steps done, unless a replica's loss or the gradient norm is not finite.
        Returns whether it was applied (the same on every replica; a program that scales its
        loss skips by its own rule, which counts as applied: the scale moved, the step counts)
        and what the step reports."""


class UpdateKernel(Protocol):
    """What runs a Module's update in place of its ONNX segment (graphforge.runtime.fused_update:
    torch's fused multi-tensor kernels over the runner's buffers). The ONNX update stays the
    definition: a kernel computes the same arithmetic, for the programs it says it takes."""

    #: one line: which kernel, for which optimizer
    description: str

    def apply(self, gradients: Mapping[str, ort.OrtValue], lr: float, step: int, checks: Mapping[str, float]) -> None:
        """Update every parameter and optimizer state in place from ``gradients`` (the values
        segment 0 sent, by name) at learning rate ``lr``, ``step`` steps done before this one;
        ``checks``: what segment 0 computed for the update, by name (the loss, the global
        gradient norm for clipping, loss scaling's ``update_skipped``)."""


@dataclass
class _Undo:
    """What the last training run changed: the carried tensors it wrote (their other buffer
    still holds the value before it), and the step count, reset flag, gradients and gradient
    norm before it."""

    written: list[Carried]
    overwritten: list[Carried]
    step: int
    micro_batch: int
    grad_reset_pending: bool
    received: dict[str, ort.OrtValue] | None
    grad_norm: float | None


class Module(GroupMember):
    """A training program with its state, ready to run.

    ``program``: a compiled training program (path, bytes, ModelProto or Model).
    ``state``: a CheckpointState (default: the program's initial state); the Module
    trains on it in place, so ``state.save(path)`` saves the current values.
    ``device``: "cpu", "cuda", "cuda:N", or None for the best working one.
    ``dropout``: "seeded" (default) gives training-mode Dropout masks that are a pure
    function of (``state.seeds["dropout"]``, step, micro-batch, node, element), so runs
    repeat and resume bit-identically (graphforge/runtime/dropout.py); "onnxruntime" keeps
    onnxruntime's own Dropout, whose generator is unseeded and cannot be checkpointed.
    ``in_place``: update parameters and optimizer states in place (see the module docstring).
    ``shard_optimizer_states``: leave the optimizer's states of each parameter out of the
    Module's buffers, for a graphforge.distributed.ZeroDataParallel that keeps this process's
    shard of them (it takes them with ``take_unheld_states``): so that no process ever holds them
    all (the loss scale's scalars stay).
    ``update``: what runs the optimizer update. "auto" (default): torch's fused multi-tensor
    kernels on the runner's buffers (runtime/fused_update.py) where they compute what the
    program's update does, else the program's ONNX update; ``update_note`` says which and why.
    "torch": those kernels (LAMB in foreach kernels too), or an error saying why not. "onnx":
    the program's update segment, the definition the kernels are held to.
    ``capture``: the runner's capture-ready mode (runtime/capture.py): every training session
    of fixed shapes (specialized to a batch's dims) runs against buffers of its own, and on
    CUDA is captured as CUDA graphs, replayed from then on. None (default): on CUDA; True:
    on the CPU too, where nothing is captured and the results are the normal mode's, bit for
    bit; False: never. ``module.runner.capture_refused`` says which sessions are not captured, and why.
    """

    def __init__(
        self,
        program: ModelSource | Model,
        state: CheckpointState | None = None,
        device: str | None = None,
        *,
        intra_op_threads: int | None = None,
        inter_op_threads: int | None = None,
        dropout: str = "seeded",
        in_place: bool = True,
        shard_optimizer_states: bool = False,
        update: str = "auto",
        capture: bool | None = None,
    ):
        check_choice("dropout", dropout, DROPOUT_MODES)
        check_choice("update", update, UPDATES)
        self._program = program_proto(program)
        self.roles = ProgramRoles.of_proto(self._program).require_training_program()
        roles = self.roles
        _refuse_steps_program(roles)
        self.default_lr = roles.default_lr if roles.default_lr is not None else math.nan
        self.loss_name = roles.loss or "loss"

        # a state made here is attached at once: the runner's buffers are the copy of its arrays
        state = state if state is not None else CheckpointState.from_program(self._program, writable=False)
        state.check(roles.carried)
        # the runner holds the carried tensors: the Module's copy of the program keeps their
        # types and shapes only (else a second copy of every weight, for good)
        self._program = without_values(self._program, {s.input for s in roles.carried})
        device_ = resolve_device(device)
        self._train_program, self._key_input = training_program(self._program, roles, device_.type, dropout)
        self.input_names = roles.batch_input_names()
        self.output_names = list(roles.forward_outputs)
        held = _held(roles, shard_optimizer_states)
        self.runner = Runner(
            held,
            device_,
            batch_inputs=self.input_names,
            intra_op_threads=intra_op_threads,
            inter_op_threads=inter_op_threads,
            in_place=[s.input for s in held if s.role in IN_PLACE_ROLES] if in_place else (),
            static=device_.type == "cuda" if capture is None else bool(capture),
        )
        # a state trains in one Module at a time: attach refuses one another Module holds
        tensors = state.attach(self.runner)
        self.runner.write_tensors(tensors)
        #: the carried tensors the runner does not hold, until their holder takes them
        self._unheld = {n: v for n, v in tensors.items() if n not in self.runner.carried}
        del tensors
        self.state = state

        self.training = True
        self._received: dict[str, ort.OrtValue] | None = None  # what segment 1 needs from segment 0
        self._split: StepSplit | None = None
        self._eval_model: onnx.ModelProto | None = None
        self._optimizer: Optimizer | None = None
        self.last_grad_norm: float | None = None
        #: the gradient norm of each step of the last train_steps run ([k]), or None
        self.last_grad_norms: np.ndarray | None = None
        #: whether the last training run's update was skipped (in place, not finite)
        self.last_update_skipped = False
        self._checked: dict[str, np.ndarray] = {}  # segment 0's loss and grad_norm, for the update
        self._grad_buffers: dict[str, ort.OrtValue] | None = None
        self._undo: _Undo | None = None  # what undo_last_run() restores
        #: data parallelism: this replica's index (its dropout masks) and what reduces its gradients
        self.replica = 0
        self.reducer: GradientReducer | None = None
        #: tensor parallelism: its runs cut after each collective its program marks (runtime/chain.py)
        self._chains: Chains | None = None
        self._kernel: UpdateKernel | None = None
        self._update_choice = update
        self._onnx_update_why = "update='onnx'"
        # "auto" picks at the first use (importing torch takes 2 s: not for a Module that never
        # updates); "torch" at once, so that a refusal comes where it was asked for
        self._update_pending = update == "auto"
        if update == "torch":
            self._pick_update_kernel()

    def _pick_update_kernel(self) -> None:
        """torch's kernels where they run this program's update (LAMB's foreach kernels only
        when insisted on: no measured winner over its ONNX update), else the ONNX update."""
        self._update_pending = False
        try:
            self._kernel = FusedUpdate(self, foreach=self._update_choice == "torch")
        except Refused as exc:
            if self._update_choice == "torch":
                raise
            self._onnx_update_why = exc.why

    @property
    def update_kernel(self) -> UpdateKernel | None:
        """What runs the update instead of the program's update segment (``use_update_kernel``),
        or None: the ONNX segment."""
        if self._update_pending:
            self._pick_update_kernel()
        return self._kernel

    @property
    def update_note(self) -> str:
        """One line: which update runs, and why not torch's kernels where they do not."""
        if self.update_kernel is not None:
            return f"update: {self.update_kernel.description}"
        return f"update: the program's ONNX update ({self._onnx_update_why})"

    # ------------------------------------------------------------------ data parallelism

    def attach_reducer(self, reducer: GradientReducer, replica: int) -> None:
        """Make this Module a data-parallel replica: ``reducer`` reduces its gradients (and with
        ``shards_update`` runs the update), ``replica`` is its index (its dropout masks)."""
        if self.reducer is not None:
            raise GraphforgeError("this Module is already data-parallel")
        if self._kernel is not None and self._update_choice == "torch" and not reducer.shards_update:
            raise GraphforgeError(
                "this Module was made with update='torch', but a data-parallel update reads the reduced "
                "gradients in the program's ONNX update: make it with update='auto' or 'onnx'"
            )
        self.reducer, self.replica = reducer, replica
        if self._kernel is not None or self._update_pending:  # the reducer's update (or the program's) runs now
            self.use_update_kernel(None, "a data-parallel program: its update reads the reduced gradients")

    def take_unheld_states(self) -> dict[str, np.ndarray]:
        """The carried tensors this Module's runner does not hold (``shard_optimizer_states``),
        handed to their holder once: the Module keeps no reference to them."""
        unheld, self._unheld = self._unheld, {}
        return unheld

    # ------------------------------------------------------------------ modes

    def train(self, mode: bool = True) -> Module:
        self.training = bool(mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    @property
    def device(self) -> str:
        return self.runner.device.name

    @property
    def accumulates(self) -> bool:
        """Whether the program accumulates gradients (compiled with accumulate=true)."""
        return self.roles.accumulates

    @property
    def learning_rate(self) -> float:
        lr = self.state.learning_rate
        return self.default_lr if lr is None else float(lr)

    # ------------------------------------------------------------------ running

    def __call__(self, *batch: Any, outputs: Sequence[str] = (), **feeds: Any):
        """Train mode: forward + backward (+ accumulate into the gradient accumulators); the
        update waits for ``Optimizer.step()``. Eval mode: forward + loss of the eval model.

        Batch inputs go by position (``module.input_names`` order, labels included) or by
        name. Returns the loss, or ``(loss, *outputs)`` when forward outputs are requested.
        In eval mode the labels may be left out when outputs are requested: only what
        they need runs, and the loss is None.
        """
        feeds = self._batch(batch, feeds)
        outputs = list(outputs)
        if not self.training:
            return self._eval_call(feeds, outputs)
        split = self._split_models()
        self._check_outputs(outputs, split.grad_outputs, "from module(...) (the forward/backward segment)")
        extra = tuple(sorted({o for o in outputs if o != self.loss_name}))
        if self.reducer is not None:
            self.reducer.before_forward()
        done = self._forward_backward(feeds, extra, outputs)
        return self._reported(done.host, outputs)

    def _forward_backward(
        self, feeds: dict[str, Any], extra: tuple[str, ...], outputs: list[str], into: dict | None = None
    ):
        """Segment 0 on a batch: forward, backward, accumulate (and the gradient norm);
        ``into``: buffers to write the gradients it sends into (capture-ready: always, the
        buffers the update segment reads)."""
        split = self._split_models()
        if into is None and self.runner.static:
            into = self._gradient_buffers(split)
        dims = batch_dims(split.grad, feeds)
        fetch = list(dict.fromkeys([self.loss_name, *split.checks, *outputs]))
        if self._chains is None:
            grad = self._segment_session(0, extra, dims)
            done = self._execute([SegmentRun(grad, fetch, split.sends, into or {})], feeds)
        else:
            keep = segment_outputs(split, 0, self.roles, extra)
            where = "the program's forward/backward segment"
            key = ("segment", 0, extra)
            runs, hook = self._chains.runs(key, lambda: split.grad, where, keep, fetch, split.sends, into, dims)
            done = self._execute(runs, feeds, hook)
        self.state.grad_reset_pending = False
        self.state.micro_batch += 1  # the next forward of this step draws other dropout masks
        self._received = done.device
        self._checked = {n: done.host[n] for n in split.checks}
        return done

    def train_step(self, *batch: Any, outputs: Sequence[str] = (), **feeds: Any):
        """One whole training step: forward, backward, (accumulate,) and the optimizer update
        (segment 0 then the update in place; with ``in_place=False``, one session.run). Returns the loss (or ``(loss, *outputs)``; ``grad_norm`` and
        gradients may be requested too). With an accumulating program, the gradients
        accumulated by earlier ``module(...)`` calls are included, and reset afterwards.
        """
        feeds = self._batch(batch, feeds)
        outputs = list(outputs)
        if outputs:
            self._check_outputs(outputs, self.roles.outputs, "from train_step")
        if (self.runner.in_place and self.reducer is None) or (self._chains is not None and self.reducer is not None):
            return self._train_step_in_two(feeds, outputs)
        extra, keep = self._fused_outputs(outputs)
        fetch = [self.loss_name, *outputs]
        for name in self.roles.step_reports:
            if name in keep and name not in fetch:
                fetch.append(name)
        if self._chains is not None:
            dims = batch_dims(self._train_program, feeds)
            program = self._train_program
            runs, hook = self._chains.runs(("fused", extra), lambda: program, "the program", keep, fetch, dims=dims)
            done = self._execute(runs, feeds, hook)
        elif self.reducer is None:
            bound = self.runner.session(
                ("fused", extra),
                lambda: self._train_program,
                "the program",
                keep,
                profile=True,
                dims=batch_dims(self._train_program, feeds),
            )
            done = self._execute([SegmentRun(bound, fetch)], feeds)
        else:
            self.reducer.before_forward()
            dims = batch_dims(self._train_program, feeds)
            segments, hook = self.reducer.step_segments(("fused", extra), keep, fetch, dims)
            done = self._execute(segments, feeds, hook)
        host = done.host
        if self.reducer is not None and self.reducer.shards_update:
            host = self._reducer_update(host, host.get(self.loss_name))
        else:
            self._after_update(host)
        self._received = None
        self.state.grad_reset_pending = True
        return self._reported(host, outputs)

    def train_steps(self, *batches: Any, lr: Sequence[float] | None = None, **feeds: Any) -> np.ndarray:
        """k whole training steps in one ``session.run``: the program's step in an ONNX ``Loop``
        (the ``steps`` pass, passes/steps.py). Each batch input comes stacked on a new leading
        axis of size k (by position or by name, as ``train_step`` takes them), step i training on
        slice i; ``lr``: the k steps' learning rates (default: the current one for each; a
        schedule's next k: ``schedule.next_rates(k)``). The step count advances by k and each
        step draws its own dropout masks, so the k losses returned ([k]) and the state after
        them are those of k ``train_step`` calls with the program's ONNX update, bit for bit.
        The update is the program's even where ``train_step`` runs torch's kernels, and a step
        whose loss is not finite is not skipped: ``undo_last_run()`` takes back all k steps."""
        feeds = self._batch(batches, feeds)
        k = self._steps_count(feeds)
        lrs = self._steps_rates(k, lr)
        wrapped = self._steps_session(k)
        state, roles = self.state, self.roles
        scalars = {roles.lr_input: lrs, roles.step_input: np.arange(state.step, state.step + k, dtype=np.int64)}
        if roles.reset_input is not None:
            scalars[roles.reset_input] = np.ones(k, np.bool_)
        if self._key_input is not None:
            seed = int(state.seeds.get("dropout", 0))
            keys = [run_key(seed, state.step + i, 0, self.replica) for i in range(k)]
            scalars[self._key_input] = np.stack(keys)
        before = self._undo_record()
        fetch = [self.loss_name, *self.roles.step_reports]
        done = self.runner.execute([SegmentRun(wrapped, fetch)], {**feeds, **scalars})
        before.written, before.overwritten = list(done.written), list(done.overwritten)
        self._undo = before
        self.state.step = int(state.step) + k
        self.state.micro_batch = 0
        self.last_update_skipped = False
        self.last_grad_norms = done.host.get(self.roles.grad_norm)
        if self.last_grad_norms is not None:
            self.last_grad_norm = float(self.last_grad_norms[-1])
        self._received = None
        self.state.grad_reset_pending = True
        return done.host[self.loss_name]

    def _steps_count(self, feeds: dict[str, Any]) -> int:
        """k, the stacked batch's leading axis; or an error saying why k steps cannot run here."""
        if not self.training:
            raise GraphforgeError("train_steps in eval mode (evaluation every step): call module.train() first")
        if self.reducer is not None or self._chains is not None:
            raise GraphforgeError(
                "train_steps runs on one process: a data-parallel or tensor-parallel Module cuts each step at its "
                "collectives; call train_step"
            )
        if not self.state.grad_reset_pending or self.state.micro_batch:
            raise GraphforgeError(
                "train_steps after module(...) accumulated gradients (accumulation across runs): call "
                "optimizer.step() first; each of the k steps starts from no gradients"
            )
        if self._update_choice == "torch":
            raise GraphforgeError(
                "this Module was made with update='torch'; train_steps runs the program's ONNX update "
                "inside its loop: make it with update='auto' or 'onnx'"
            )
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise GraphforgeError(f"train_steps needs every batch input stacked; missing {missing[0]!r}")
        sizes = {n: np.shape(v)[0] if np.ndim(v) else None for n, v in feeds.items()}
        k = next(iter(sizes.values()))
        if k is None or k < 1 or any(s != k for s in sizes.values()):
            shown = ", ".join(f"{n} {np.shape(v)}" for n, v in feeds.items())
            raise GraphforgeError(
                f"train_steps takes each batch input stacked on a new leading axis of k steps, the same k for "
                f"all (data that is not stacked): got {shown}"
            )
        return int(k)

    def _steps_rates(self, k: int, lr: Sequence[float] | None) -> np.ndarray:
        if lr is None:
            self._scalars()  # the error when there is no learning rate
            return np.full(k, self.learning_rate, np.float32)
        rates = np.asarray(lr, np.float64)
        if rates.shape != (k,) or not np.all(np.isfinite(rates)) or np.any(rates < 0):
            raise GraphforgeError(f"lr= takes the {k} steps' learning rates, finite and ≥ 0; got {list(np.ravel(lr))}")
        # each rate rounded to float32 from its Python float, as train_step feeds it
        return np.array([np.float32(float(r)) for r in rates], np.float32)

    def _steps_session(self, k: int) -> BoundSession:
        """The session of k steps in one run (the lean step in a Loop), made on first use per k."""

        def wrapped() -> onnx.ModelProto:
            carried = {s.input: s.output for s in self.roles.carried}
            scans = [self.loss_name, *self.roles.step_reports]
            lean = lean_model(self._train_program, [*scans, *carried.values()], bound=set(carried))
            initializers = {t.name for t in lean.graph.initializer}
            fixed = [i.name for i in lean.graph.input if i.name in initializers and i.name not in carried]
            return steps_model(lean, k, carried=carried, fixed=fixed, scans=scans)

        return self.runner.session(("steps", k), wrapped, f"the program's {k} steps in one run", profile=True)

    def _train_step_in_two(self, feeds: dict[str, Any], outputs: list[str]):
        """train_step as segment 0, then the update unless it is skipped: in place, or for a
        tensor-parallel member that is a data-parallel replica too (a mesh of both), its
        forward/backward cut after the tensor group's sums, the gradients reduced across the
        replicas (the reducer's hooks), then the update, cut after its sums as well."""
        split = self._split_models()
        replica = self.reducer is not None
        if replica:
            self.reducer.before_forward()
        first = [o for o in outputs if o in split.grad_outputs]
        extra = tuple(sorted(o for o in first if o != self.loss_name))
        # (a replica's gradients go to its reducer's buckets, not to buffers of the Module's)
        done = self._forward_backward(feeds, extra, first, None if replica else self._gradient_buffers(split))
        host = dict(done.host)
        undo = self._undo
        self.state.micro_batch -= 1  # one step, not a micro-batch: the update resets it, a skip keeps it
        update = self._update([o for o in outputs if o not in split.grad_outputs])
        if update is not None:
            host.update(update.host)
            undo.written += update.written
            undo.overwritten += update.overwritten
        self._undo = undo
        self._received = None  # the gradients go now, not when the next step's replace them
        self.state.grad_reset_pending = True
        return self._reported(host, outputs)

    def _gradient_buffers(self, split: StepSplit) -> dict[str, ort.OrtValue]:
        """One buffer for each gradient train_step hands from segment 0 to the update (those
        of a fixed shape), made on first use and written by every step, as a torch module's
        ``.grad``: the same memory each step, so that the allocator's pattern repeats."""
        if self._grad_buffers is None:
            shapes = {}
            for value in split.grad.graph.output:
                dims = value.type.tensor_type.shape.dim
                if value.name in split.sends and all(d.HasField("dim_value") for d in dims):
                    dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
                    shapes[value.name] = (tuple(d.dim_value for d in dims), dtype)
            device = self.runner.device
            self._grad_buffers = {
                name: ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device.type, device.id)
                for name, (shape, dtype) in shapes.items()
            }
        return self._grad_buffers

    def lazy_reset_grad(self) -> None:
        """Make the next ``module(...)`` call overwrite the accumulated gradients instead of adding to them."""
        self.state.grad_reset_pending = True

    def start_profiling(self, prefix: str | os.PathLike) -> None:
        """Profile the training runs from now on (``train_step``, ``module(...)``,
        ``optimizer.step()``): they run in twin sessions of the same lean models, made with
        onnxruntime's profiling on, bound to the same buffers, so the trace shows the very
        runs that train (every micro-batch and the update, with accumulation). The twins
        hold their own memory arena until ``end_profiling()``. ``prefix``: where
        onnxruntime writes the traces (``<prefix>_<time>.json``)."""
        self.runner.start_profiling(prefix)

    def end_profiling(self) -> list[tuple[Path, int]]:
        """Stop profiling: (trace file, profiling start in ns since the epoch) of each
        session that ran meanwhile, in the order first run; the sessions go."""
        return self.runner.end_profiling()

    def undo_last_run(self) -> None:
        """Put the state back as it was before the last training run (``train_step``,
        ``module(...)`` or ``optimizer.step()``; eval runs change nothing and do not count):
        carried tensors, step count, micro-batch count, the reset-grad flag and the gradient
        norm. The other buffer of each tensor the run wrote still holds the value it read, so
        nothing is copied; only the last run can be undone, and not one that updated
        parameters in place (a skipped update can). ``graphforge train`` uses it to keep the
        last finite state when a step's loss is not finite."""
        undo = self._undo
        if undo is None:
            raise GraphforgeError("nothing to undo: no run since the module was made or the last undo")
        if undo.overwritten:
            raise GraphforgeError(
                f"the last run updated {len(undo.overwritten)} tensors in place (e.g. {undo.overwritten[0].name!r}), "
                "so it cannot be undone; make the Module with in_place=False to keep every state until the next run"
            )
        Runner.restore(undo.written)
        self.state.step = undo.step
        self.state.micro_batch = undo.micro_batch
        self.state.grad_reset_pending = undo.grad_reset_pending
        self._received = undo.received if self._still_held(undo.received) else None
        self.last_grad_norm = undo.grad_norm
        self._undo = None

    def _still_held(self, received: dict[str, ort.OrtValue] | None) -> bool:
        """Whether the values a run sent still hold what it sent: always in the normal mode;
        in the capture-ready mode only those in carried buffers (accumulated gradients): the
        run undone wrote its own into the same output buffers."""
        if received is None or not self.runner.static:
            return True
        slots = {id(slot) for c in self.runner.carried.values() for slot in c.slots}
        return all(id(value) in slots for value in received.values())

    def _optimizer_step(self) -> None:
        if not self.training:
            raise GraphforgeError("optimizer.step() in eval mode: call module.train() first")
        if self._received is None:
            raise GraphforgeError("no gradients to apply: call the module on a batch (in train mode) first")
        self._update([])

    def use_update_kernel(self, kernel: UpdateKernel | None, why: str = "asked for") -> None:
        """Run the update with ``kernel`` from now on (None: the program's ONNX update segment,
        ``why`` saying why in ``update_note``). Only a Module that updates in place, on one
        process, runs one: its update is the last thing a step does, into the buffers segment
        0 does not write."""
        if kernel is not None and (not self.runner.in_place or self.reducer is not None):
            why = "updates with two buffers (in_place=False)" if not self.runner.in_place else "is data-parallel"
            raise GraphforgeError(f"this Module {why}: its update runs as the program's ONNX segment")
        self._kernel, self._update_pending = kernel, False
        if kernel is None:
            self._onnx_update_why = why

    def _update(self, outputs: list[str]):
        """Segment 1 with the gradients segment 0 sent (reduced across replicas when
        data-parallel), or the update kernel in its place; returns its execution, or None when
        the update is skipped: in place, a loss or gradient norm that is not finite leaves the
        state as it is."""
        self.last_update_skipped = False
        checked = {n: float(np.asarray(v)) for n, v in self._checked.items()}
        # a program that scales its loss skips an update whose gradients are not finite
        # itself (and lowers the scale): only a loss that is not finite is the runtime's to skip
        guarded = [self.loss_name] if self.roles.loss_scaling is not None else list(checked)
        if self.runner.in_place and not all(math.isfinite(checked[n]) for n in guarded if n in checked):
            self.last_update_skipped = True
            self.last_grad_norm = checked.get(self.roles.grad_norm, self.last_grad_norm)
            return None
        if self.update_kernel is not None and not outputs:  # the segment's own outputs need the segment
            return self._kernel_update(checked)
        if self.reducer is not None and self.reducer.shards_update:
            self._undo = self._undo_record()
            self.reducer.reduce(dict(self._received))
            host = self._reducer_update(
                {n: np.asarray(v) for n, v in self._checked.items()}, checked.get(self.loss_name)
            )
            return Execution(host, {}, [], list(self._undo.overwritten))
        received = dict(self._received)
        if self.reducer is not None:
            received = self.reducer.reduce(received)
        if self._chains is not None:  # the update may sum across the group too (the global gradient norm)
            split, extra = self._split_models(), tuple(sorted(outputs))
            keep = segment_outputs(split, 1, self.roles, extra)
            fetch = [n for n in [*self.roles.step_reports, *outputs] if n in keep]
            where = "the program's optimizer segment"
            runs, hook = self._chains.runs(("segment", 1, extra), lambda: split.optim, where, keep, fetch)
            done = self._execute(runs, received, hook)
        else:
            optim = self._segment_session(1, tuple(sorted(outputs)), buffers=self._grad_buffers)
            fetch = [n for n in [*self.roles.step_reports, *outputs] if n in optim.outputs]
            done = self._execute([SegmentRun(optim, fetch)], received)
        self._after_update({**{n: np.asarray(v) for n, v in self._checked.items()}, **done.host})
        return done

    def _kernel_update(self, checked: dict[str, float]) -> Execution:
        """The update by ``update_kernel``, in place (it cannot be undone, as segment 1's in place)."""
        state = self.state
        before = self._undo_record()
        self.update_kernel.apply(self._received, self.learning_rate, int(state.step), checked)
        before.overwritten = [c for c in self.runner.carried.values() if c.name in self.runner.in_place]
        self._undo = before
        host = {n: np.asarray(v) for n, v in self._checked.items()}
        self._after_update(host)
        return Execution(host, {}, [], list(before.overwritten))

    def _reducer_update(self, host: dict[str, np.ndarray], loss) -> dict[str, np.ndarray]:
        """The update the reducer runs itself (ZeroDataParallel: this replica's shard, then the
        gather), or none when a replica's loss or the global gradient norm is not finite
        (``last_update_skipped``; the state stays as before it, undo_last_run takes back the rest)."""
        applied, reports = self.reducer.apply_update(
            self.learning_rate, int(self.state.step), None if loss is None else float(np.asarray(loss))
        )
        host = {**host, **reports}
        self.last_update_skipped = not applied
        if applied:
            self._after_update(host)
            # the parameters it gathered in place: the run cannot be undone
            self._undo.overwritten += [c for c in self.runner.carried.values() if c.spec.role == "parameter"]
        elif self.roles.grad_norm in host:
            self.last_grad_norm = float(host[self.roles.grad_norm])
        return host

    def _undo_record(self) -> _Undo:
        """What undo_last_run needs of now, before a run (the carried tensors it writes: after)."""
        state = self.state
        return _Undo(
            [], [], state.step, state.micro_batch, state.grad_reset_pending, self._received, self.last_grad_norm
        )

    def _after_update(self, host: dict[str, np.ndarray]) -> None:
        self.state.step = int(self.state.step) + 1
        self.state.micro_batch = 0
        if self.roles.grad_norm in host:
            self.last_grad_norm = float(host[self.roles.grad_norm])
        scaling = self.roles.loss_scaling
        if scaling is not None and scaling.update_skipped in host:
            self.last_update_skipped = bool(host[scaling.update_skipped])

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the next step uses (a program compiled with mixed_precision's loss
        scaling), or None."""
        scaling = self.roles.loss_scaling
        return None if scaling is None else float(self.runner.read_tensors([scaling.scale])[scaling.scale])

    @property
    def skipped_updates(self) -> int | None:
        """How many updates the program's loss scaling has skipped so far, or None."""
        scaling = self.roles.loss_scaling
        return None if scaling is None else int(self.runner.read_tensors([scaling.skipped])[scaling.skipped])

    def _execute(self, segments: list[SegmentRun], feeds: dict[str, Any], hook: Hook | None = None):
        """One training execution, with the step's scalars fed, recorded for undo_last_run."""
        before = self._undo_record()
        done = self.runner.execute(segments, {**feeds, **self._scalars()}, hook=hook)
        before.written, before.overwritten = list(done.written), list(done.overwritten)
        self._undo = before  # the counters, flag and gradients are the callers' to change, after this
        return done

    def _reported(self, host: dict[str, np.ndarray], outputs: list[str]):
        """What a training run hands back: the loss (the mean over replicas when data-parallel) and ``outputs``."""
        if self.reducer is not None:
            host = {**host, self.loss_name: self.reducer.mean(host[self.loss_name])}
        return _result(host, self.loss_name, outputs)

    def _eval_call(self, feeds: dict[str, Any], outputs: list[str]):
        if self._chains is not None:
            return self._eval_chained(feeds, outputs)
        bound = self._eval_session()
        self._check_outputs(outputs, bound.outputs, "in eval mode")
        if outputs and any(n not in feeds and n not in bound.defaults for n in self.input_names):
            bound = self._eval_session(tuple(outputs))  # no loss: labels (and what else it reads) not needed
            host, _ = self.runner.run(bound, {**feeds, **self._scalars()}, outputs)
            return (None, *(host[n] for n in outputs))
        host, _ = self.runner.run(bound, {**feeds, **self._scalars()}, [self.loss_name, *outputs])
        return _result(host, self.loss_name, outputs)

    def _eval_chained(self, feeds: dict[str, Any], outputs: list[str]):
        """An eval run of a tensor-parallel member: the eval model cut after its collectives
        (the loss too where the labels are fed)."""
        model = self._eval_model_proto()
        self._check_outputs(outputs, [o.name for o in model.graph.output], "in eval mode")
        loss = self.loss_name if self.roles.labels is None or self.roles.labels in feeds else None
        keep = [*([loss] if loss else []), *outputs]
        runs, hook = self._chains.runs(("eval",), lambda: model, "the eval model", keep, keep, static=False)
        host = self.runner.execute(runs, {**feeds, **self._scalars()}, hook=hook).host
        return (host[loss] if loss else None) if not outputs else (host.get(loss), *(host[n] for n in outputs))

    # ------------------------------------------------------------------ state

    @property
    def parameters(self) -> dict[str, np.ndarray]:
        """The current parameter values (copies), by name."""
        return self.runner.read_role("parameter")

    @property
    def buffers(self) -> dict[str, np.ndarray]:
        """The current buffers (BatchNorm running statistics; copies), by name."""
        return self.runner.read_role("buffer")

    def export_model_for_inferencing(self, path: str | os.PathLike, output_names: Sequence[str]) -> Path:
        """Write a plain inference model computing ``output_names`` with the current
        parameter and buffer values embedded (atomic write)."""
        if self._is_member:
            raise GraphforgeError(
                "this is one tensor-parallel member's program, which holds slices of the weights: export the whole "
                "program (compiled without rank) with the joined state (TensorParallel.whole_state())"
            )
        values = self.runner.read_role("parameter", "buffer")
        model = export_inference_model(self._program, values, list(output_names))
        return save(model, path)

    # ------------------------------------------------------------------ sessions

    def _fused_outputs(self, outputs: Sequence[str] = ()) -> tuple[tuple[str, ...], list[str]]:
        """What train_step computes: the loss, grad_norm, the carried tensors' updates and
        ``outputs``; returns the requested outputs beyond the loss and grad_norm (a key: one
        session per set), and the whole list."""
        extra = tuple(sorted({o for o in outputs if o not in (self.loss_name, self.roles.grad_norm)}))
        return extra, fused_outputs(self.roles, extra)

    @property
    def train_program(self) -> onnx.ModelProto:
        """The program training runs: with reproducible dropout masks when seeded (not a copy: do not change it)."""
        return self._train_program

    def _split_models(self) -> StepSplit:
        if self._split is None:
            self._split = split_program(self._train_program, self.roles, norm_first=bool(self.runner.in_place))
        return self._split

    def _segment_session(
        self,
        index: int,
        extra: tuple[str, ...] = (),
        dims: dict[str, int] | None = None,
        buffers: dict[str, ort.OrtValue] | None = None,
    ) -> BoundSession:
        """Segment ``index``'s session, computing what ``segment_outputs`` says (specialized
        to the batch's ``dims``, see Runner.session; capture-ready, its inputs named in
        ``buffers`` read those)."""
        split = self._split_models()
        model = split.grad if index == 0 else split.optim
        keep = segment_outputs(split, index, self.roles, extra)
        where = "the program's forward/backward segment" if index == 0 else "the program's optimizer segment"
        return self.runner.session(
            ("segment", index, extra), lambda: model, where, keep, profile=True, dims=dims, input_buffers=buffers
        )

    @property
    def _is_member(self) -> bool:
        """Whether the program is one tensor-parallel member's (its runs sum across a group)."""
        role = self.roles.tensor_parallel
        return role is not None and role.rank is not None

    def _eval_model_proto(self) -> onnx.ModelProto:
        if self._eval_model is None:
            self._eval_model = eval_model(
                self._program,
                [self.loss_name, *self.output_names],
                verify=False,
                keep_markers=self._is_member,
            )
        return self._eval_model

    def _eval_session(self, outputs: tuple[str, ...] = ()) -> BoundSession:
        """The eval model's session (loss and forward outputs), or one computing only ``outputs``."""
        self._eval_model_proto()
        # (off the hot path, in batches of any dims: run as fed in the capture-ready mode too)
        if outputs:
            return self.runner.session(
                ("eval", outputs),
                lambda: self._eval_model,
                "the eval model",
                list(outputs),
                only_read_inputs=True,
                static=False,
            )
        return self.runner.session(("eval",), lambda: self._eval_model, "the eval model", static=False)

    # ------------------------------------------------------------------ feeds

    def _batch(self, batch: tuple, named: dict[str, Any]) -> dict[str, Any]:
        if len(batch) > len(self.input_names):
            raise GraphforgeError(
                f"{len(batch)} batch inputs given, the program takes {len(self.input_names)}: "
                f"{', '.join(self.input_names)}"
            )
        feeds = dict(zip(self.input_names, batch, strict=False))
        for name, value in named.items():
            if name in feeds:
                raise GraphforgeError(f"batch input {name!r} given twice (by position and by name)")
            feeds[name] = value
        unknown = [n for n in feeds if n not in self.input_names]
        if unknown:
            raise GraphforgeError(
                f"unknown batch input {unknown[0]!r}; the program takes: {', '.join(self.input_names)}"
            )
        return feeds

    def _check_outputs(self, outputs: list[str], produced: Sequence[str], where: str) -> None:
        carried_outputs = self.runner.by_output
        for name in outputs:
            if name not in produced or name in carried_outputs:
                available = [o for o in produced if o not in carried_outputs and o != self.loss_name]
                raise GraphforgeError(
                    f"output {name!r} is not available {where}; available: {', '.join(available) or 'none'}"
                )

    def _scalars(self) -> dict[str, np.ndarray]:
        """The step's inputs besides the batch: learning rate, step count, reset flag, dropout key."""
        lr = self.learning_rate
        if not math.isfinite(lr):
            raise GraphforgeError("no learning rate: the program has none; call optimizer.set_learning_rate(lr)")
        roles, state = self.roles, self.state
        scalars = {roles.lr_input: np.array(lr, np.float32), roles.step_input: np.array(state.step, np.int64)}
        if roles.reset_input is not None:
            scalars[roles.reset_input] = np.array(state.grad_reset_pending, np.bool_)
        if self._key_input is not None:
            seed = int(state.seeds.get("dropout", 0))
            scalars[self._key_input] = run_key(seed, state.step, state.micro_batch, self.replica)
        return scalars


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Refuse ``name=value`` unless it is one of ``choices`` (Module's and Stage's options)."""
    if value not in choices:
        raise GraphforgeError(f"{name}={value!r}: use one of {', '.join(map(repr, choices))}")


def training_program(
    program: onnx.ModelProto, roles: ProgramRoles, device_type: str, dropout: str
) -> tuple[onnx.ModelProto, str | None]:
    """What training runs: ``program`` with reproducible dropout masks (``dropout="seeded"``;
    eval and export use the program), without the initial values of the carried tensors,
    which are always bound; and the input of the masks' key, if they have one."""
    if dropout != "seeded":
        return program, None
    seeded_program, seeded = seeded_dropout(
        program, "div" if device_type == "cuda" else "bitshift", bound={spec.input for spec in roles.carried}
    )
    return seeded_program, KEY_INPUT if seeded else None


def _refuse_steps_program(roles: ProgramRoles) -> None:
    """A Module runs one step a run of a program: a program the steps pass wrapped is refused."""
    if STEPS in roles.metadata:
        raise GraphforgeError(
            "the program runs several steps per run (the steps pass ran on it): give Module the program "
            "before steps, and call module.train_steps on stacked batches"
        )


def _held(roles: ProgramRoles, shard_optimizer_states: bool) -> list[CarriedSpec]:
    """The carried tensors a Module's runner holds: all of them, but for a sharded update,
    which keeps the optimizer's states per parameter elsewhere (the loss scale's scalars stay)."""
    return [
        s
        for s in roles.carried
        if not (shard_optimizer_states and s.role == "optimizer" and s.input not in roles.loss_scale_states)
    ]


class Optimizer:
    """The optimizer step of a Module's program: ``step()`` applies the update with the
    gradients of the last ``module(...)`` call (accumulated ones with an accumulating
    program); the learning rate is the state's (default: the program's)."""

    def __init__(self, module: Module):
        if module._optimizer is not None:
            raise GraphforgeError("this Module already has an Optimizer")
        module._optimizer = self
        self.module = module
        if module.state.learning_rate is None:
            module.state.learning_rate = module.default_lr

    def step(self) -> None:
        self.module._optimizer_step()

    def set_learning_rate(self, lr: float) -> None:
        if isinstance(lr, bool) or not isinstance(lr, int | float | np.floating) or not math.isfinite(lr) or lr < 0:
            raise GraphforgeError(f"the learning rate must be a finite number ≥ 0, got {lr!r}")
        self.module.state.learning_rate = float(lr)

    def get_learning_rate(self) -> float:
        return self.module.learning_rate

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (before clipping), or None."""
        return self.module.last_grad_norm


def _result(host: dict[str, np.ndarray], loss_name: str, outputs: list[str]):
    loss = host[loss_name]
    return loss if not outputs else (loss, *(host[n] for n in outputs))
