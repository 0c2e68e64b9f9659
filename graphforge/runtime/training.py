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

How it runs. The program is one functional training step (passes/optimizers.py). Every
carried tensor (parameter, optimizer state, accumulator, buffer) lives in two
preallocated OrtValues on the device; a run reads one and writes the other, bound with
IOBinding, and the two swap roles (ping-pong). So parameters and states never leave
onnxruntime between steps and nothing is copied per step; they come back to numpy only
when asked (``state.tensors``, ``module.parameters``, ``state.save``).

The split path (``module(...)`` then ``optimizer.step()``) cuts the program
(graphforge.cut) into segment 0, forward + backward (+ accumulate), and segment 1, the
optimizer; the gradients (or accumulated gradients) cross between them as device
OrtValues. Eval mode runs ``eval_model(program, ...)`` (dropout off, BatchNorm on its
running statistics) with the current parameters bound.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from graphforge import roles
from graphforge.errors import DeviceError, GraphforgeError
from graphforge.graph import Model, ModelSource, one_line
from graphforge.runtime.checkpoint import CheckpointState, carried_specs, program_proto
from graphforge.runtime.dropout import KEY_INPUT, run_key, seeded_dropout
from graphforge.runtime.sessions import (
    CPU,
    CUDA,
    _node_reads,
    _provider_works,
    available_providers,
    create_session,
    lean_model,
    session_options,
)

_NEXT = "_next"
#: Module(dropout=...): counter-based masks, or onnxruntime's own Dropout
DROPOUT_MODES = ("seeded", "onnxruntime")
#: host outputs of a fixed shape up to this many elements get a preallocated buffer
_PREALLOCATED_MAX = 4096


@dataclass
class _Carried:
    """One carried tensor: two device buffers, and which one holds the current value."""

    name: str
    output: str
    role: str
    dtype: np.dtype
    shape: tuple[int, ...]
    slots: list[ort.OrtValue]
    current: int = 0


@dataclass
class _Runner:
    """A session for one model (the whole program, a segment, or the eval model) and its
    IOBindings, cached by which buffer each carried tensor is bound to and what is fetched."""

    session: ort.InferenceSession
    inputs: list[str]
    input_dtypes: dict[str, np.dtype]
    defaults: set[str]  # inputs with an initializer default
    outputs: list[str]
    output_shapes: dict[str, tuple[int, ...]]  # the outputs of fixed shape
    output_dtypes: dict[str, np.dtype]
    bindings: dict[tuple, _Binding] = field(default_factory=dict)
    # filled by the first run: the carried tensors it reads and writes, and its other inputs
    carried_in: list[_Carried] | None = None
    carried_out: list[_Carried] | None = None
    free_inputs: list[str] | None = None


@dataclass
class _Binding:
    """An IOBinding and the host outputs it fetches: bound once to preallocated buffers
    (small outputs of fixed shape), or bound afresh each run (the others)."""

    binding: ort.IOBinding
    preallocated: dict[str, ort.OrtValue]
    allocated: list[str]
    #: host outputs that also go on to the next segment: bound once, on the device, and
    #: copied to the host from there (onnxruntime keeps only the last binding of a name)
    via_device: list[str]


@dataclass
class _Undo:
    """What the last training run changed: the carried tensors it wrote (their other buffer
    still holds the value before it), and the step count, reset flag, gradients and gradient
    norm before it."""

    written: list[_Carried]
    step: int
    micro_batch: int
    grad_reset_pending: bool
    received: dict[str, ort.OrtValue] | None
    grad_norm: float | None


@dataclass
class _Profiling:
    """start_profiling(): where traces go, and the profiled twin sessions by what they compute."""

    prefix: str
    runners: dict[tuple, _Runner]


@dataclass
class _Segments:
    """The program cut for the split path: the two segment models, what segment 0 can
    output, and what it sends to segment 1."""

    grad: onnx.ModelProto
    optim: onnx.ModelProto
    grad_outputs: list[str]
    sends: list[str]


class Module:
    """A training program with its state, ready to run.

    ``program``: a compiled training program (path, bytes, ModelProto or Model).
    ``state``: a CheckpointState (default: the program's initial state); the Module
    trains on it in place, so ``state.save(path)`` saves the current values.
    ``device``: "cpu", "cuda", "cuda:N", or None for the best working one.
    ``dropout``: "seeded" (default) gives training-mode Dropout masks that are a pure
    function of (``state.seeds["dropout"]``, step, micro-batch, node, element), so runs
    repeat and resume bit-identically (graphforge/runtime/dropout.py); "onnxruntime" keeps
    onnxruntime's own Dropout, whose generator is unseeded and cannot be checkpointed.
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
    ):
        if dropout not in DROPOUT_MODES:
            raise GraphforgeError(f"dropout={dropout!r}: use one of {', '.join(map(repr, DROPOUT_MODES))}")
        self._program = program_proto(program)
        specs = carried_specs(self._program)
        meta = {p.key: p.value for p in self._program.metadata_props}
        self._lr_input = meta.get(roles.LR, "lr")
        self._step_input = meta.get(roles.STEP, "step")
        self._reset_input = meta.get(roles.RESET_GRAD)
        self.default_lr = float(meta.get(roles.DEFAULT_LR, "nan"))
        self.loss_name = meta.get(roles.LOSS, "loss")
        grads = json.loads(meta.get(roles.GRADIENTS, "{}"))

        state = state if state is not None else CheckpointState.from_program(self._program)
        state._check_free()  # a state trains in one Module at a time
        state.check(specs)
        self._device_type, self._device_id, self._providers = _resolve_device(device)
        # what training runs: the program with reproducible dropout masks (eval and export use
        # the program), without the initial values of the carried tensors, which are always bound
        self._train_program, seeded = (
            seeded_dropout(
                self._program,
                "div" if self._device_type == "cuda" else "bitshift",
                bound={spec["input"] for spec in specs},
            )
            if dropout == "seeded"
            else (self._program, 0)
        )
        self._key_input = KEY_INPUT if seeded else None
        self._threads = {"intra_op_threads": intra_op_threads, "inter_op_threads": inter_op_threads}

        values = state.tensors  # not yet attached: the state's own arrays
        self._carried: dict[str, _Carried] = {}
        for spec in specs:
            dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
            slot = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, self._device_type, self._device_id)
            slot.update_inplace(np.ascontiguousarray(values[spec["input"]]))
            self._carried[spec["input"]] = _Carried(spec["input"], spec["output"], spec["role"], dtype, shape, [slot])
        self._by_output = {c.output: c for c in self._carried.values()}
        state._attach(self)
        self.state = state

        special = {self._lr_input, self._step_input, self._reset_input}
        self.input_names = [
            i.name for i in self._program.graph.input if i.name not in self._carried and i.name not in special
        ]
        not_forward = {self.loss_name, "grad_norm", self._step_input + _NEXT, *self._by_output, *grads.values()}
        self._program_outputs = [o.name for o in self._program.graph.output]
        self.output_names = [o for o in self._program_outputs if o not in not_forward]

        self.training = True
        self._received: dict[str, ort.OrtValue] | None = None  # what segment 1 needs from segment 0
        self._fused: _Runner | None = None  # train_step's session, without extra outputs
        self._extra_runners: dict[tuple, _Runner] = {}  # the other sessions, by what they compute
        self._segments: _Segments | None = None
        self._eval: _Runner | None = None
        self._eval_model: onnx.ModelProto | None = None
        self._optimizer: Optimizer | None = None
        self.last_grad_norm: float | None = None
        self._undo: _Undo | None = None  # what undo_last_run() restores
        self._profiling: _Profiling | None = None  # the profiled sessions, while start_profiling() is in effect

    # ------------------------------------------------------------------ modes

    def train(self, mode: bool = True) -> Module:
        self.training = bool(mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    @property
    def device(self) -> str:
        return self._device_type if self._device_type == "cpu" else f"{self._device_type}:{self._device_id}"

    @property
    def accumulates(self) -> bool:
        """Whether the program accumulates gradients (compiled with accumulate=true)."""
        return self._reset_input is not None

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
            runner = self._eval_runner()
            self._check_outputs(outputs, runner.outputs, "in eval mode")
            if outputs and any(n not in feeds and n not in runner.defaults for n in self.input_names):
                runner = self._eval_runner(tuple(outputs))  # no loss: labels (and what else it reads) not needed
                host, _ = self._run(runner, feeds, outputs, [], undoable=False)
                return (None, *(host[n] for n in outputs))
            host, _ = self._run(runner, feeds, [self.loss_name, *outputs], [], undoable=False)
            return _result(host, self.loss_name, outputs)
        segments = self._segment_models()
        self._check_outputs(outputs, segments.grad_outputs, "from module(...) (the forward/backward segment)")
        grad = self._segment_runner(0, outputs)
        host, device = self._run(grad, feeds, [self.loss_name, *outputs], segments.sends)
        self.state.grad_reset_pending = False
        self.state.micro_batch += 1  # the next forward of this step draws other dropout masks
        self._received = device
        return _result(host, self.loss_name, outputs)

    def train_step(self, *batch: Any, outputs: Sequence[str] = (), **feeds: Any):
        """One whole training step in one session.run: forward, backward, (accumulate,) and
        the optimizer update. Returns the loss (or ``(loss, *outputs)``; ``grad_norm`` and
        gradients may be requested too). With an accumulating program, the gradients
        accumulated by earlier ``module(...)`` calls are included, and reset afterwards.
        """
        feeds = self._batch(batch, feeds)
        outputs = list(outputs)
        if outputs:
            self._check_outputs(outputs, self._program_outputs, "from train_step")
        runner = self._fused_runner(outputs)
        fetch = [self.loss_name, *outputs]
        if "grad_norm" in runner.outputs and "grad_norm" not in fetch:
            fetch.append("grad_norm")
        host, _ = self._run(runner, feeds, fetch, [])
        self._after_update(host)
        self._received = None
        self.state.grad_reset_pending = True
        return _result(host, self.loss_name, outputs)

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
        if self._profiling is not None:
            raise GraphforgeError("profiling is already on: call end_profiling() first")
        self._profiling = _Profiling(str(prefix), {})

    def end_profiling(self) -> list[tuple[Path, int]]:
        """Stop profiling: (trace file, profiling start in ns since the epoch) of each
        session that ran meanwhile, in the order first run; the sessions go."""
        profiling, self._profiling = self._profiling, None
        if profiling is None:
            return []
        traces = []
        for runner in profiling.runners.values():
            start = runner.session.get_profiling_start_time_ns()
            traces.append((Path(runner.session.end_profiling()), start))
        return traces

    def undo_last_run(self) -> None:
        """Put the state back as it was before the last training run (``train_step``,
        ``module(...)`` or ``optimizer.step()``; eval runs change nothing and do not count):
        carried tensors, step count, micro-batch count, the reset-grad flag and the gradient
        norm. The ping-pong buffers still hold the values the run read, so nothing is copied;
        only the last run can be undone. ``graphforge train`` uses it to keep the last finite
        state when a step's loss is not finite."""
        undo = self._undo
        if undo is None:
            raise GraphforgeError("nothing to undo: no run since the module was made or the last undo")
        for c in undo.written:
            c.current = 1 - c.current
        self.state.step = undo.step
        self.state.micro_batch = undo.micro_batch
        self.state.grad_reset_pending = undo.grad_reset_pending
        self._received = undo.received
        self.last_grad_norm = undo.grad_norm
        self._undo = None

    def _optimizer_step(self) -> None:
        if not self.training:
            raise GraphforgeError("optimizer.step() in eval mode: call module.train() first")
        if self._received is None:
            raise GraphforgeError("no gradients to apply: call the module on a batch (in train mode) first")
        optim = self._segment_runner(1)
        fetch = ["grad_norm"] if "grad_norm" in optim.outputs else []
        host, _ = self._run(optim, dict(self._received), fetch, [])
        self._after_update(host)

    def _after_update(self, host: dict[str, np.ndarray]) -> None:
        self.state.step = int(self.state.step) + 1
        self.state.micro_batch = 0
        if "grad_norm" in host:
            self.last_grad_norm = float(host["grad_norm"])

    # ------------------------------------------------------------------ state

    def _read_carried(self) -> dict[str, np.ndarray]:
        return {name: _to_numpy(c.slots[c.current]) for name, c in self._carried.items()}

    def _read_role(self, *roles_wanted: str) -> dict[str, np.ndarray]:
        return {n: _to_numpy(c.slots[c.current]) for n, c in self._carried.items() if c.role in roles_wanted}

    @property
    def parameters(self) -> dict[str, np.ndarray]:
        """The current parameter values (copies), by name."""
        return self._read_role("parameter")

    @property
    def buffers(self) -> dict[str, np.ndarray]:
        """The current buffers (BatchNorm running statistics; copies), by name."""
        return self._read_role("buffer")

    def export_model_for_inferencing(self, path: str | os.PathLike, output_names: Sequence[str]) -> Path:
        """Write a plain inference model computing ``output_names`` with the current
        parameter and buffer values embedded (atomic write)."""
        from graphforge.graph import save
        from graphforge.inference import export_inference_model

        values = self._read_role("parameter", "buffer")
        model = export_inference_model(self._program, values, list(output_names))
        return save(model, path)

    # ------------------------------------------------------------------ sessions

    def _runner(
        self,
        model: onnx.ModelProto,
        where: str,
        keep: Sequence[str] | None = None,
        *,
        only_read_inputs: bool = False,
        profile: bool = False,
    ) -> _Runner:
        """A session for ``model`` computing only the outputs in ``keep`` (None: all of them);
        ``only_read_inputs``: without the graph inputs no node reads then (the labels when
        only forward outputs are kept); ``profile``: with onnxruntime's profiling on while
        ``start_profiling`` is in effect."""
        model = lean_model(model, keep, bound=self._carried)
        if only_read_inputs:
            read = {n for node in model.graph.node for n in _node_reads(node)} | {o.name for o in model.graph.output}
            kept = [i for i in model.graph.input if i.name in read]
            del model.graph.input[:]
            model.graph.input.extend(kept)
        options = session_options(**self._threads)
        # onnxruntime plans a memory pattern after the first run and then allocates it as one
        # more block beside the arena that the first run filled: for a training step that
        # nearly doubles the peak memory (GPT-2 2x256: 1.8 GiB instead of 1.2), for no speed
        options.enable_mem_pattern = False
        if profile and self._profiling is not None:
            options.enable_profiling = True
            options.profile_file_prefix = self._profiling.prefix
        session = create_session(model, providers=self._providers, options=options, where=where)
        initializers = {t.name for t in model.graph.initializer}
        dtypes = {
            i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
            for i in model.graph.input
            if i.type.HasField("tensor_type")
        }
        shapes, output_dtypes = {}, {}
        for o in model.graph.output:
            if not o.type.HasField("tensor_type"):
                continue
            output_dtypes[o.name] = helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type)
            dims = o.type.tensor_type.shape.dim
            if o.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
                shapes[o.name] = tuple(d.dim_value for d in dims)
        return _Runner(
            session=session,
            inputs=[i.name for i in model.graph.input],
            input_dtypes=dtypes,
            defaults={i.name for i in model.graph.input if i.name in initializers},
            outputs=[o.name for o in model.graph.output],
            output_shapes=shapes,
            output_dtypes=output_dtypes,
        )

    def _fused_runner(self, outputs: Sequence[str] = ()) -> _Runner:
        """The whole program, computing what train_step hands back: the loss, grad_norm, the
        carried tensors' updates and ``outputs`` (one session per set of requested outputs)."""
        extra = tuple(sorted({o for o in outputs if o not in (self.loss_name, "grad_norm")}))
        if self._profiling is not None:
            runner = self._profiling.runners.get(("fused", extra))
        else:
            runner = self._fused if not extra else self._extra_runners.get(("fused", extra))
        if runner is None:
            produced = {o.name for o in self._train_program.graph.output}
            keep = [self.loss_name, *(["grad_norm"] if "grad_norm" in produced else []), *extra]
            keep += [c.output for c in self._carried.values() if c.output in produced]
            runner = self._runner(self._train_program, "the training program", keep, profile=True)
            if self._profiling is not None:
                self._profiling.runners[("fused", extra)] = runner
            elif extra:
                self._extra_runners[("fused", extra)] = runner
            else:
                self._fused = runner
        return runner

    def _segment_models(self) -> _Segments:
        """Segment 0 (forward + backward + accumulate) and segment 1 (the optimizer update)."""
        if self._segments is None:
            from graphforge.cut import cut

            update = {c.output for c in self._carried.values() if c.role in ("parameter", "optimizer")}
            update |= {"grad_norm", self._step_input + _NEXT}
            boundary = [o.name for o in self._train_program.graph.output if o.name not in update]
            grad, optim = cut(self._train_program, [boundary])
            for name in optim.inputs:
                c = self._carried.get(name)
                if c is not None and c.output in grad.outputs:
                    raise GraphforgeError(
                        f"cannot split this program: its optimizer segment reads {name!r}, which the "
                        f"forward/backward segment already updates; use module.train_step(...)"
                    )
            produced = [o.name for o in grad.model.graph.output]
            self._segments = _Segments(
                grad=grad.model,
                optim=optim.model,
                grad_outputs=produced,
                sends=[n for n in optim.inputs if n in produced and n not in self._carried],
            )
        return self._segments

    def _segment_runner(self, index: int, outputs: Sequence[str] = ()) -> _Runner:
        """Segment ``index``'s session, computing only what the run hands on: the loss,
        ``outputs`` and the gradients (segment 0), grad_norm (segment 1), and the carried
        tensors' updates."""
        extra = tuple(sorted({o for o in outputs if o != self.loss_name})) if index == 0 else ()
        key = ("segment", index, extra)
        cache = self._profiling.runners if self._profiling is not None else self._extra_runners
        runner = cache.get(key)
        if runner is None:
            segments = self._segment_models()
            model = segments.grad if index == 0 else segments.optim
            produced = {o.name for o in model.graph.output}
            keep = [self.loss_name, *extra, *segments.sends] if index == 0 else ["grad_norm"]
            keep = [o for o in keep if o in produced]
            keep += [c.output for c in self._carried.values() if c.output in produced]
            where = "the forward/backward segment" if index == 0 else "the optimizer segment"
            runner = cache[key] = self._runner(model, where, keep, profile=True)
        return runner

    def _eval_runner(self, outputs: tuple[str, ...] = ()) -> _Runner:
        """The eval model's session (loss and forward outputs), or one computing only ``outputs``."""
        if self._eval_model is None:
            from graphforge.inference import eval_model

            self._eval_model = eval_model(self._program, [self.loss_name, *self.output_names])
        if outputs:
            key = ("eval", outputs)
            if key not in self._extra_runners:
                self._extra_runners[key] = self._runner(
                    self._eval_model, "the eval model", list(outputs), only_read_inputs=True
                )
            return self._extra_runners[key]
        if self._eval is None:
            self._eval = self._runner(self._eval_model, "the eval model")
        return self._eval

    # ------------------------------------------------------------------ binding

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
        for name in outputs:
            if name not in produced or name in self._by_output:
                available = [o for o in produced if o not in self._by_output and o != self.loss_name]
                raise GraphforgeError(
                    f"output {name!r} is not available {where}; available: {', '.join(available) or 'none'}"
                )

    def _scalars(self) -> dict[str, np.ndarray]:
        lr = self.learning_rate
        if not math.isfinite(lr):
            raise GraphforgeError("no learning rate: the program has none; call optimizer.set_learning_rate(lr)")
        scalars = {
            self._lr_input: np.array(lr, np.float32),
            self._step_input: np.array(self.state.step, np.int64),
        }
        if self._reset_input is not None:
            scalars[self._reset_input] = np.array(self.state.grad_reset_pending, np.bool_)
        if self._key_input is not None:
            state = self.state
            scalars[self._key_input] = run_key(int(state.seeds.get("dropout", 0)), state.step, state.micro_batch)
        return scalars

    def _run(
        self,
        runner: _Runner,
        feeds: dict[str, Any],
        fetch_host: list[str],
        fetch_device: list[str],
        *,
        undoable: bool = True,
    ) -> tuple[dict[str, np.ndarray], dict[str, ort.OrtValue]]:
        """One run: carried inputs bound to their current buffers, carried outputs to the
        other ones (which then become current), feeds and scalars bound as given.
        ``undoable``: a training run, which undo_last_run() can take back."""
        if runner.carried_in is None:
            runner.carried_in = [self._carried[n] for n in runner.inputs if n in self._carried]
            runner.carried_out = [self._by_output[o] for o in runner.outputs if o in self._by_output]
            runner.free_inputs = [n for n in runner.inputs if n not in self._carried]
        carried_in, carried_out = runner.carried_in, runner.carried_out
        for c in carried_out:
            if len(c.slots) == 1:
                c.slots.append(
                    ort.OrtValue.ortvalue_from_shape_and_type(c.shape, c.dtype, self._device_type, self._device_id)
                )
        key = (
            tuple(c.current for c in carried_in),
            tuple(c.current for c in carried_out),
            tuple(fetch_host),
            tuple(fetch_device),
        )
        bound = runner.bindings.get(key)
        if bound is None:
            bound = runner.bindings[key] = self._binding(runner, carried_in, carried_out, fetch_host, fetch_device)
        binding = bound.binding

        scalars = self._scalars()
        for name in runner.free_inputs:
            if name in scalars:
                binding.bind_cpu_input(name, scalars[name])
            elif name in feeds:
                self._bind_feed(binding, runner, name, feeds[name])
            elif name not in runner.defaults:
                raise GraphforgeError(f"missing batch input {name!r}; the program takes: {', '.join(self.input_names)}")
        # outputs of unknown shape are bound afresh each run, so onnxruntime allocates them
        for name in bound.allocated:
            binding.bind_output(name, "cpu")
        for name in fetch_device:
            binding.bind_output(name, self._device_type, self._device_id)
        try:
            runner.session.run_with_iobinding(binding)
        except Exception as exc:
            raise GraphforgeError(f"onnxruntime failed to run the program: {one_line(exc)}") from None
        host = {name: np.array(value.numpy(), copy=True) for name, value in bound.preallocated.items()}
        device = {}
        if bound.allocated or fetch_device:
            values = binding.get_outputs()  # in the order bound
            offset = len(carried_out) + len(bound.preallocated)
            host.update({n: values[offset + i].numpy() for i, n in enumerate(bound.allocated)})
            offset += len(bound.allocated)
            device = {n: values[offset + i] for i, n in enumerate(fetch_device)}
            host.update({n: _to_numpy(device[n]) for n in bound.via_device})
        for c in carried_out:
            c.current = 1 - c.current
        if undoable:  # the counters, flag and gradients are the callers' to change, after this
            state = self.state
            self._undo = _Undo(
                carried_out,
                state.step,
                state.micro_batch,
                state.grad_reset_pending,
                self._received,
                self.last_grad_norm,
            )
        return host, device

    def _binding(
        self,
        runner: _Runner,
        carried_in: list[_Carried],
        carried_out: list[_Carried],
        fetch_host: list[str],
        fetch_device: list[str],
    ) -> _Binding:
        """An IOBinding with the carried tensors bound to their buffers, and the small host
        outputs of fixed shape (the loss, grad_norm) bound to preallocated ones: none of
        them is bound again, and only outputs of other shapes are read back per run. A host
        output also in ``fetch_device`` is read from its device value (``via_device``)."""
        binding = runner.session.io_binding()
        for c in carried_in:
            binding.bind_ortvalue_input(c.name, c.slots[c.current])
        for c in carried_out:
            binding.bind_ortvalue_output(c.output, c.slots[1 - c.current])
        preallocated, allocated = {}, []
        via_device = [n for n in dict.fromkeys(fetch_host) if n in fetch_device]
        for name in dict.fromkeys(n for n in fetch_host if n not in via_device):
            shape = runner.output_shapes.get(name)
            if shape is not None and math.prod(shape) <= _PREALLOCATED_MAX:
                value = ort.OrtValue.ortvalue_from_shape_and_type(shape, runner.output_dtypes[name], "cpu", 0)
                binding.bind_ortvalue_output(name, value)
                preallocated[name] = value
            else:
                allocated.append(name)
        return _Binding(binding, preallocated, allocated, via_device)

    def _bind_feed(self, binding: ort.IOBinding, runner: _Runner, name: str, value: Any) -> None:
        if isinstance(value, ort.OrtValue):
            binding.bind_ortvalue_input(name, value)
            return
        array = np.ascontiguousarray(np.asarray(value))
        expected = runner.input_dtypes.get(name)
        if expected is not None and array.dtype != expected:
            if not np.can_cast(array.dtype, expected, casting="safe"):  # int32 labels → int64: no value changes
                raise GraphforgeError(
                    f"batch input {name!r} must be {np.dtype(expected).name} (or a type that converts to it "
                    f"without loss), got {array.dtype.name}"
                )
            array = array.astype(expected)
        binding.bind_cpu_input(name, array)


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


# --------------------------------------------------------------------------- helpers


def _result(host: dict[str, np.ndarray], loss_name: str, outputs: list[str]):
    loss = host[loss_name]
    return loss if not outputs else (loss, *(host[n] for n in outputs))


def _to_numpy(value: ort.OrtValue) -> np.ndarray:
    # on the CPU numpy() may share the buffer, which the next step overwrites: always copy
    return np.array(value.numpy(), copy=True)


def _resolve_device(device: str | None) -> tuple[str, int, list]:
    """(OrtValue device type, device id, providers) for "cpu", "cuda", "cuda:N" or None (best)."""
    if device is None:
        providers = available_providers()
        device = "cuda" if providers[0] == CUDA else "cpu"
        if device == "cpu":
            return "cpu", 0, providers
    text = str(device).strip().lower()
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return "cpu", 0, [CPU]
    if kind in ("cuda", "gpu") and (not index or index.isdigit()):
        device_id = int(index or 0)
        if not _provider_works(CUDA):
            why = (
                "this onnxruntime build has no CUDA provider (install onnxruntime-gpu)"
                if CUDA not in ort.get_available_providers()
                else "no CUDA device is usable on this machine"
            )
            raise DeviceError(f"device {device!r} asks for CUDA, but {why}; use device 'cpu'")
        return "cuda", device_id, [(CUDA, {"device_id": str(device_id)}), CPU]
    raise DeviceError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
