"""The runner: everything that executes a program goes through here.

A :class:`Runner` holds, for one program on one device, the tensors the program carries
from step to step (parameters, optimizer states, accumulators, buffers) and the sessions
that run it or its segments. Every carried tensor lives in two preallocated OrtValues on
the device; a run reads one and writes the other, bound with IOBinding, and the two swap
roles (ping-pong), so nothing is copied per step and nothing leaves onnxruntime between
steps. Feeds may be host arrays or device OrtValues; fetches come back to the host, or stay
on the device to go on to another segment.

:meth:`Runner.execute` is the one executor of N segments: it runs them in order, hands the
device values that segment k sends to the segments after it, and between segments calls a
hook that may replace those values (an all-reduce of the gradients, a send to the next
pipeline stage, a callback under autograd), or hand back a pending result (an asynchronous
collective) that is waited on only when a later segment reads one of its values. The
Module (training.py) is one client: its fused step is one segment, its split step two.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from graphforge.analysis.memory import in_place_safety
from graphforge.errors import GraphforgeError, one_line
from graphforge.ir import node_reads
from graphforge.passes.specialize import specialized
from graphforge.placement.cut import Segment
from graphforge.placement.lean import lean_model
from graphforge.program import CarriedSpec
from graphforge.runtime.capture import (
    captured_providers,
    copy_feed,
    feed_array,
    fixed_shape_refusal,
    run_options,
    shape_and_dtype,
)
from graphforge.runtime.devices import Device
from graphforge.runtime.dlpack import synchronize
from graphforge.runtime.sessions import create_session, session_options, share_arena

#: host outputs of a fixed shape up to this many elements get a preallocated buffer
PREALLOCATED_MAX = 4096


@dataclass
class Carried:
    """One carried tensor: two device buffers, and which one holds the current value."""

    spec: CarriedSpec
    dtype: np.dtype
    shape: tuple[int, ...]
    slots: list[ort.OrtValue]
    current: int = 0

    @property
    def name(self) -> str:
        return self.spec.input

    @property
    def output(self) -> str:
        return self.spec.output

    @property
    def value(self) -> ort.OrtValue:
        return self.slots[self.current]


@dataclass
class _Binding:
    """An IOBinding and the host outputs it fetches: bound once to preallocated buffers
    (small outputs of fixed shape), or bound afresh each run (the others)."""

    binding: ort.IOBinding
    preallocated: dict[str, ort.OrtValue]
    allocated: list[str]
    #: host outputs that also go on to another segment: bound once, on the device, and
    #: copied to the host from there (onnxruntime keeps only the last binding of a name)
    via_device: list[str]
    #: the outputs bound once (carried tensors' buffers, the preallocated host outputs), in
    #: the order bound: bound again after a run whose outputs onnxruntime allocated
    fixed: list[tuple[str, ort.OrtValue]] = field(default_factory=list)
    #: the inputs bound once (the carried tensors' buffers): bound again after each run
    fixed_inputs: list[tuple[str, ort.OrtValue]] = field(default_factory=list)
    #: whether the binding's outputs were cleared after the last run (and must be bound again)
    cleared: bool = False
    #: whether its inputs were (the values another segment sent it)
    inputs_cleared: bool = True
    #: capture-ready (capture.py): every output it writes, by name, in a buffer of its own
    #: (the carried tensors' and the caller's ``into`` ones included), bound once
    static_outputs: dict[str, ort.OrtValue] | None = None
    #: the captured graph its runs replay (onnxruntime's gpu_graph_id), where the session is captured
    graph_id: int | None = None


@dataclass(frozen=True)
class _RunPlan:
    """One run's binding and what it fetches: to the host, to the device (``bound_device``:
    those onnxruntime allocates there), from the carried buffers (``in_buffers``, by output
    name), or into the caller's values (``into``)."""

    cached: _Binding
    fetch_host: list[str]
    fetch_device: list[str]
    bound_device: list[str]
    in_buffers: dict[str, Carried]
    into: dict[str, ort.OrtValue]


@dataclass
class BoundSession:
    """A session for one model (a whole program, a segment of one, an eval model) and its
    IOBindings, cached by which buffer each carried tensor is bound to and what is fetched.
    ``in_place``: the carried tensors this model writes into the buffer it reads them from
    (see Runner: proven safe for this model)."""

    session: ort.InferenceSession
    where: str
    inputs: list[str]
    input_dtypes: dict[str, np.dtype]
    #: inputs with an initializer default, as device values bound when no feed names them
    #: (IOBinding cannot bind an input that is also an initializer, so the model has none)
    defaults: dict[str, ort.OrtValue]
    outputs: list[str]
    output_shapes: dict[str, tuple[int, ...]]  # the outputs of fixed shape
    output_dtypes: dict[str, np.dtype]
    carried_in: list[Carried]
    carried_out: list[Carried]
    free_inputs: list[str]
    in_place: frozenset[str] = frozenset()
    bindings: dict[tuple, _Binding] = field(default_factory=dict)
    #: capture-ready (Runner(static=True), every input and output of a fixed shape): each fed
    #: input's own buffer, which every run's value is copied into; None: bound as fed
    static_inputs: dict[str, ort.OrtValue] | None = None
    #: the fed inputs whose buffer holds a fed value, not the input's default
    fed: set[str] = field(default_factory=set)
    #: where onnxruntime captures its runs as CUDA graphs (one per binding): how to make its
    #: session again without capture, should a captured run fail (model, dims); else None
    uncaptured: tuple[onnx.ModelProto, Mapping[str, int] | None] | None = None
    #: the fixed output buffers of its bindings, by name (shared: one binding runs at a time)
    output_buffers: dict[str, ort.OrtValue] = field(default_factory=dict)

    @property
    def captured(self) -> bool:
        return self.uncaptured is not None

    def writes_in_place(self, c: Carried) -> bool:
        return c.name in self.in_place


#: sessions specialized to the dims of a batch, per session key; batches of other dims run
#: the session for any dims (a data set of many sequence lengths compiles a few sessions, not one each)
MAX_SPECIALIZED = 4


def batch_dims(model: onnx.ModelProto, feeds: Mapping[str, Any]) -> dict[str, int] | None:
    """The sizes the fed arrays give ``model``'s symbolic input dims (``{"batch": 8}``), or
    None when there are none or two feeds disagree on one."""
    dims: dict[str, int] = {}
    for value in model.graph.input:
        fed = feeds.get(value.name)
        if fed is None or not value.type.HasField("tensor_type"):
            continue
        shape = tuple(fed.shape()) if isinstance(fed, ort.OrtValue) else np.shape(fed)
        declared = value.type.tensor_type.shape.dim
        if len(declared) != len(shape):
            return None
        for dim, size in zip(declared, shape, strict=True):
            if dim.dim_param and dims.setdefault(dim.dim_param, int(size)) != int(size):
                return None
    return dims or None


@dataclass(frozen=True)
class SegmentRun:
    """One segment of an execution: its session, the outputs fetched to the host, and the
    outputs it sends on as device values (to later segments, or out of the execution).
    ``into``: sent outputs written into buffers the caller owns (views of a flat bucket a
    collective reduces in place, say) instead of ones onnxruntime allocates."""

    session: BoundSession
    fetch: Sequence[str] = ()
    sends: Sequence[str] = ()
    into: Mapping[str, ort.OrtValue] = field(default_factory=dict)


class Pending(Protocol):
    """What a hook hands back for work still in flight (an asynchronous collective):
    ``covers`` names the sent values it is working on (a later segment reading one of them
    waits for it; one reading only the others does not)."""

    covers: Collection[str]

    def wait(self) -> Mapping[str, ort.OrtValue] | None:
        """Block until done; returns replacements for the values sent, or None to keep them."""
        ...


#: called after segment k with the device values it sends; returns replacements (a mapping,
#: possibly of fewer names), a Pending to wait on before a later segment reads them, or None
Hook = Callable[[int, dict[str, ort.OrtValue]], "Mapping[str, ort.OrtValue] | Pending | None"]


@dataclass
class Execution:
    """What an execution produced: the host outputs fetched, the device values the segments
    sent (after the hook), the carried tensors it wrote into their other buffer (which
    still holds the value before: ``Runner.restore`` brings it back), and those it
    ``overwritten`` in place (the value before is gone)."""

    host: dict[str, np.ndarray]
    device: dict[str, ort.OrtValue]
    written: list[Carried]
    overwritten: list[Carried] = field(default_factory=list)


class Runner:
    """Carried ping-pong buffers, sessions and bindings for one program on one device.

    ``carried``: the tensors the program carries; ``batch_inputs``: the inputs a caller
    feeds, named when one is missing. ``threads``: intra/inter-op thread counts for every
    session. Values come in with :meth:`write_tensors` and go out with :meth:`read_tensors`
    (a CheckpointState reads through that, see checkpoint.TensorHolder).

    ``in_place``: carried tensors (by input name) that may be updated in place, in one buffer
    instead of two: a session writes one of them into the buffer it reads it from wherever
    its model proves that safe (``in_place_safety``: every other node that reads the old
    value runs before the node that writes the new one, in any order onnxruntime may choose,
    and that node is elementwise), and into the other buffer where it does not. A run that
    wrote a tensor in place cannot be taken back (``Execution.overwritten``).

    ``static``: the capture-ready mode (runtime/capture.py): each session whose inputs and
    outputs all have fixed shapes runs against buffers of its own, bound once, and on CUDA
    is captured as CUDA graphs (onnxruntime's ``enable_cuda_graph``); ``capture_refused``
    says why a session is not (on the CPU nothing is captured: the mode computes what the
    normal mode does, bit for bit).

    ``spin``: whether a session's threads spin for work after each of its runs (onnxruntime's
    default). Default: only where a step is one run (no carried tensor updated in place). Each
    session has its own threads, so in a step of two sessions (the forward/backward, then the
    update in place; a pipeline stage's segments) the first's spinning threads take the cores
    the second runs on: on 2 cores the MLP and CNN of the Training step section trained at
    half speed (MLP 38-40 ms a step against 17-22 ms without spinning; one session with
    spinning, the two-buffer step, 16-22 ms).
    """

    def __init__(
        self,
        carried: Sequence[CarriedSpec],
        device: Device,
        *,
        batch_inputs: Sequence[str] = (),
        intra_op_threads: int | None = None,
        inter_op_threads: int | None = None,
        in_place: Collection[str] = (),
        spin: bool | None = None,
        static: bool = False,
    ):
        self.device = device
        self.static = bool(static)
        #: session (its ``where``) -> why it runs without fixed buffers or uncaptured (static mode)
        self.capture_refused: dict[str, str] = {}
        self.batch_inputs = list(batch_inputs)
        self._threads = {"intra_op_threads": intra_op_threads, "inter_op_threads": inter_op_threads}
        self.carried: dict[str, Carried] = {}
        for spec in carried:
            dtype, shape = np.dtype(spec.dtype), tuple(spec.shape)
            slot = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device.type, device.id)
            self.carried[spec.input] = Carried(spec, dtype, shape, [slot])
        self.by_output = {c.output: c for c in self.carried.values()}
        unknown = sorted(set(in_place) - set(self.carried))
        if unknown:
            raise GraphforgeError(f"in_place names {unknown[0]!r}, which is not a carried tensor")
        self.in_place = frozenset(in_place)
        self._spin = spin
        #: carried tensor -> why a session's model could not update it in place (the last reason)
        self.in_place_refused: dict[str, str] = {}
        #: work in flight that writes carried buffers (wait_before_reads)
        self._awaiting: Callable[[], None] | None = None
        #: session (its ``where``) -> why its model runs unspecialized at a batch's dims
        self.specialize_refused: dict[str, str] = {}
        self._sessions: dict[Any, BoundSession] = {}
        #: (profiled, key) -> the sets of dims a session of that key was specialized to
        self._specialized: dict[Any, set[tuple[tuple[str, int], ...]]] = {}
        #: while profiling: where traces go, and the profiled twin sessions by key
        self._profile_prefix: str | None = None
        self._profiled: dict[Any, BoundSession] = {}

    @property
    def spin(self) -> bool:
        return not self.in_place if self._spin is None else self._spin

    def disable_in_place(self) -> None:
        """From now on every carried tensor is written into its other buffer (sessions made
        before are made again, without in-place writes)."""
        if self.in_place:
            self.in_place = frozenset()
            self._forget_sessions()

    def release(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Stop holding the carried tensors ``names`` (their buffers are freed): another holder
        keeps them from now on (ZeroDataParallel, this process's shard of the optimizer
        states), and no session made from now on binds them. Returns their current values."""
        names = [n for n in names if n in self.carried]
        values = self.read_tensors(names)
        for name in names:
            c = self.carried.pop(name)
            self.by_output.pop(c.output, None)
        self.in_place = self.in_place - set(names)
        self._forget_sessions()
        return values

    def share(self, values: Mapping[str, ort.OrtValue]) -> None:
        """Hold each carried tensor named in ``values`` in that one buffer from now on, memory the
        caller owns (a view of the flat buffer ZeroDataParallel gathers parameters into); its
        current value is copied there. No run may write it into another buffer: only a caller
        that updates it itself shares it."""
        for name, value in values.items():
            c = self.carried[name]
            value.update_inplace(to_numpy(c.value))
            c.slots, c.current = [value], 0
        self._forget_sessions()

    def wait_before_reads(self, wait: Callable[[], None] | None) -> None:
        """Call ``wait`` before any run reads the carried buffers and before they are read back:
        the holder of work in flight that writes them (ZeroDataParallel's gather of the updated
        parameters, overlapping what the host does between steps) finishes it there."""
        self._awaiting = wait

    def _forget_sessions(self) -> None:
        """Sessions and bindings made before go (they bind buffers that changed)."""
        self._sessions.clear()
        self._profiled.clear()
        self._specialized.clear()

    # ------------------------------------------------------------------ carried values

    def write_tensors(self, values: Mapping[str, np.ndarray]) -> None:
        """Set the current value of every carried tensor (host arrays, by input name)."""
        for name, c in self.carried.items():
            c.value.update_inplace(np.asarray(values[name], order="C"))

    def read_tensors(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """The current values of the carried tensors (``names``, default all), as host copies."""
        if self._awaiting is not None:
            self._awaiting()
        chosen = self.carried if names is None else {n: self.carried[n] for n in names}
        return {name: to_numpy(c.value) for name, c in chosen.items()}

    def read_role(self, *wanted: str) -> dict[str, np.ndarray]:
        return self.read_tensors(n for n, c in self.carried.items() if c.spec.role in wanted)

    @staticmethod
    def restore(written: Iterable[Carried]) -> None:
        """Make the buffers a run wrote from current again (undo it): nothing is copied."""
        for c in written:
            c.current = 1 - c.current

    # ------------------------------------------------------------------ sessions

    def session(
        self,
        key: Any,
        model: Callable[[], onnx.ModelProto],
        where: str,
        keep: Sequence[str] | None = None,
        *,
        only_read_inputs: bool = False,
        profile: bool = False,
        dims: Mapping[str, int] | None = None,
        input_buffers: Mapping[str, ort.OrtValue] | None = None,
        static: bool = True,
    ) -> BoundSession:
        """The session cached under ``key``, made on first use from ``model()`` computing only
        the outputs in ``keep`` (None: all). ``only_read_inputs``: without the graph inputs no
        node reads (the labels when only forward outputs are kept). ``profile``: while
        profiling, a twin session with onnxruntime's profiling on, bound to the same buffers.
        ``dims``: the sizes of the inputs' symbolic dims this run has (``batch_dims``): a
        session specialized to them (onnxruntime's free-dimension overrides), up to
        MAX_SPECIALIZED sets of dims per key, then the session for any dims. The specialized
        model is graphforge's own (the ``specialize`` pass: every value that depends only on
        shapes folded into a constant, so no node waits for the host on a GPU), with
        onnxruntime's free-dimension overrides besides. A Shape that the backward takes of a
        forward activation (a Reshape's gradient, say) then no longer keeps that activation
        alive until the backward reaches it (GPT-2 small: 120 MiB less). ``input_buffers``: in
        the capture-ready mode, the buffers (of the inputs' shapes and dtypes) that inputs of
        these names read, instead of buffers of their own: the ones an earlier segment writes
        what it sends this one into, so that nothing is copied between them. ``static=False``:
        this session runs as fed even in the capture-ready mode (one off the hot path, an
        evaluation's, whose batches come in any dims)."""
        profiled = profile and self._profile_prefix is not None
        cache = self._profiled if profiled else self._sessions
        if dims:
            variants = self._specialized.setdefault((profiled, key), set())
            signature = tuple(sorted(dims.items()))
            if signature in variants or len(variants) < MAX_SPECIALIZED:
                variants.add(signature)
                key = (key, signature)
            else:
                dims = None  # a batch of yet other dims: the session for any dims
        bound = cache.get(key)
        if bound is None:
            bound = cache[key] = self._create(
                model(), where, keep, only_read_inputs, profiled, dims, input_buffers, static=self.static and static
            )
        return bound

    def segment(
        self,
        segment: Segment,
        *,
        key: Any = None,
        fetch: Sequence[str] | None = None,
        dims: Mapping[str, int] | None = None,
    ) -> SegmentRun:
        """A segment of a cut (graphforge.placement.cut) ready to execute: its session (cached under
        ``key``, default its index; specialized to ``dims``, see ``session``), fetching ``fetch``
        (default: the program outputs it makes) and sending on what the cut says crosses after it."""
        where = f"segment {segment.index}"
        key = ("segment", segment.index) if key is None else key
        bound = self.session(key, lambda: segment.model, where, profile=True, dims=dims)
        return SegmentRun(bound, list(segment.outputs if fetch is None else fetch), list(segment.sends))

    def _create(
        self,
        model: onnx.ModelProto,
        where: str,
        keep: Sequence[str] | None,
        only_read_inputs: bool,
        profiled: bool,
        dims: Mapping[str, int] | None = None,
        input_buffers: Mapping[str, ort.OrtValue] | None = None,
        *,
        static: bool = False,
    ) -> BoundSession:
        if dims:
            model = self.specialize(model, dims, where)
        model = lean_model(model, keep, bound=self.carried)
        if only_read_inputs:
            read = {n for node in model.graph.node for n in node_reads(node)} | {o.name for o in model.graph.output}
            kept = [i for i in model.graph.input if i.name in read]
            del model.graph.input[:]
            model.graph.input.extend(kept)
        defaults = self._take_defaults(model)
        static_inputs = self._static_inputs(model, where, defaults, input_buffers or {}) if static else None
        session, captured = None, False
        if static_inputs is not None and self._captures() and not profiled:
            try:  # a captured session keeps its own arena: the shared one would hand its graph's blocks on
                session = create_session(
                    model,
                    providers=captured_providers(self.device.providers),
                    options=self._options(dims, profiled, shared_arena=False),
                    where=where,
                )
                captured = True
            except GraphforgeError as exc:  # a node on the host, control flow: runs uncaptured
                self._refuse_capture(where, f"onnxruntime does not capture it: {one_line(exc)}")
        if session is None:
            options = self._options(dims, profiled, shared_arena=True)
            session = create_session(model, providers=list(self.device.providers), options=options, where=where)
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
            declared = o.type.tensor_type.shape.dim
            if o.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in declared):
                shapes[o.name] = tuple(d.dim_value for d in declared)
        inputs = [i.name for i in model.graph.input]
        outputs = [o.name for o in model.graph.output]
        in_place = set()
        if self.in_place:
            pairs = {
                c.name: c.output for n in inputs if n in self.in_place and (c := self.carried[n]).output in outputs
            }
            refused = in_place_safety(model, pairs)
            in_place = set(pairs) - set(refused)
            self.in_place_refused.update(refused)
        return BoundSession(
            session=session,
            where=where,
            inputs=inputs,
            input_dtypes=dtypes,
            defaults=defaults,
            outputs=outputs,
            output_shapes=shapes,
            output_dtypes=output_dtypes,
            carried_in=[self.carried[n] for n in inputs if n in self.carried],
            carried_out=[self.by_output[o] for o in outputs if o in self.by_output],
            free_inputs=[n for n in inputs if n not in self.carried],
            in_place=frozenset(in_place),
            static_inputs=static_inputs,
            uncaptured=(model, dims) if captured else None,
        )

    def _options(self, dims: Mapping[str, int] | None, profiled: bool, *, shared_arena: bool) -> ort.SessionOptions:
        options = session_options(**self._threads, spin=self.spin)
        # onnxruntime plans a memory pattern after the first run and then allocates it as one
        # more block beside the arena that the first run filled: for a training step that
        # nearly doubles the peak memory (GPT-2 2x256: 1.8 GiB instead of 1.2), for no speed
        options.enable_mem_pattern = False
        for name, size in (dims or {}).items():
            options.add_free_dimension_override_by_name(name, int(size))
        if shared_arena:
            share_arena(options, self.device.type, self.device.id)
        if profiled:
            options.enable_profiling = True
            options.profile_file_prefix = self._profile_prefix
        return options

    def _static_inputs(
        self,
        model: onnx.ModelProto,
        where: str,
        defaults: Mapping[str, ort.OrtValue],
        given: Mapping[str, ort.OrtValue],
    ) -> dict[str, ort.OrtValue] | None:
        """The capture-ready mode's buffer for each input a caller feeds (``given``'s where it
        names one of that shape; else its own, holding its default where it has one), or None
        where an input or output has no fixed shape (the reason kept in ``capture_refused``)."""
        fed = [i.name for i in model.graph.input if i.name not in self.carried]
        why = fixed_shape_refusal(model, [*fed, *(o.name for o in model.graph.output)])
        if why is not None:
            self._refuse_capture(where, f"no fixed buffers: {why}")
            return None
        buffers = {}
        for name in fed:
            shape, dtype = shape_and_dtype(model, name)
            value = given.get(name)
            if value is not None and tuple(value.shape()) == shape and name not in defaults:
                buffers[name] = value
                continue
            buffers[name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, self.device.type, self.device.id)
            if name in defaults:
                copy_feed(buffers[name], defaults[name], name, dtype)
        return buffers

    def _refuse_capture(self, where: str, reason: str) -> None:
        """Keep why ``where`` is not captured; on CUDA, where capture is what the mode is for, say it once."""
        if self.device.type == "cuda" and where not in self.capture_refused:
            warnings.warn(f"{where} runs without CUDA graph capture: {reason}", stacklevel=3)
        self.capture_refused[where] = reason

    def specialize(self, model: onnx.ModelProto, dims: Mapping[str, int], where: str) -> onnx.ModelProto:
        """``model`` specialized to ``dims`` (passes/specialize.py: its shape computations folded,
        so that no node waits for the host), or as it is where that fails: an optimization never
        stops a step; the reason is kept and said once."""
        try:
            return specialized(model, dims)
        except Exception as exc:  # a model the shape inference or the folding cannot take
            reason = one_line(exc) if isinstance(exc, GraphforgeError) else f"{type(exc).__name__}: {one_line(exc)}"
            if where not in self.specialize_refused:
                warnings.warn(f"{where} runs unspecialized at {dict(dims)}: {reason}", stacklevel=2)
            self.specialize_refused[where] = reason
            return model

    def _take_defaults(self, model: onnx.ModelProto) -> dict[str, ort.OrtValue]:
        """Move the initializers that are graph inputs too out of ``model``, as device values."""
        inputs = {i.name for i in model.graph.input}
        kept, defaults = [], {}
        for tensor in model.graph.initializer:
            if tensor.name in inputs:
                value = np.asarray(numpy_helper.to_array(tensor), order="C")
                defaults[tensor.name] = ort.OrtValue.ortvalue_from_numpy(value, self.device.type, self.device.id)
            else:
                kept.append(tensor)
        if defaults:
            del model.graph.initializer[:]
            model.graph.initializer.extend(kept)
        return defaults

    # ------------------------------------------------------------------ profiling

    @property
    def profiling(self) -> bool:
        return self._profile_prefix is not None

    def start_profiling(self, prefix: str | os.PathLike) -> None:
        """Sessions asked for with ``profile=True`` are twins with onnxruntime's profiling on
        from now on (same models, same buffers), until :meth:`end_profiling`."""
        if self._profile_prefix is not None:
            raise GraphforgeError("profiling is already on: call end_profiling() first")
        self._profile_prefix = str(prefix)

    def end_profiling(self) -> list[tuple[Path, int]]:
        """Stop profiling: (trace file, profiling start in ns since the epoch) of each twin
        session that ran meanwhile, in the order first run; the twins go."""
        if self._profile_prefix is None:
            return []
        twins, self._profiled, self._profile_prefix = self._profiled, {}, None
        traces = []
        for bound in twins.values():
            start = bound.session.get_profiling_start_time_ns()
            traces.append((Path(bound.session.end_profiling()), start))
        return traces

    # ------------------------------------------------------------------ running

    def execute(
        self, segments: Sequence[SegmentRun], feeds: Mapping[str, Any], *, hook: Hook | None = None
    ) -> Execution:
        """Run ``segments`` in order. Each reads the feeds (host arrays or OrtValues by
        name; an input left out keeps its initializer default) and what earlier segments
        sent; after segment k, ``hook(k, sent)`` may replace what it sent or return a
        Pending, waited on before the first later segment that reads one of those values
        (or at the end). Returns every fetch, the final sent values, and what was written.
        Should a segment, the hook or a pending result fail, what the segments before wrote
        is taken back, so the carried state is as before the execution."""
        available: dict[str, Any] = dict(feeds)
        sent: dict[str, ort.OrtValue] = {}
        pending: list[tuple[set[str], Pending]] = []
        host: dict[str, np.ndarray] = {}
        written: list[Carried] = []
        overwritten: list[Carried] = []

        def settle(handle: Pending, names: set[str]) -> None:
            replaced = handle.wait()
            if replaced is not None:
                _check_replacement(replaced, names)
                available.update(replaced)
                sent.update(replaced)

        try:
            for k, segment in enumerate(segments):
                stale = [c.name for c in segment.session.carried_in if any(c is w for w in [*written, *overwritten])]
                if stale:  # its buffer flipped: the segment would read the value after the update
                    raise GraphforgeError(
                        f"segment {k} ({segment.session.where}) reads {stale[0]!r}, which an earlier segment of "
                        "this execution already updated; cut the program so that its update comes last"
                    )
                reads = set(segment.session.inputs)
                for entry in [p for p in pending if p[0] & reads]:
                    pending.remove(entry)
                    settle(entry[1], entry[0])
                fetched, out = self.run(segment.session, available, segment.fetch, segment.sends, segment.into)
                host.update(fetched)
                for c in segment.session.carried_out:
                    (overwritten if segment.session.writes_in_place(c) else written).append(c)
                available.update(out)
                sent.update(out)
                if hook is None or not out:
                    continue
                result = hook(k, dict(out))
                if result is None:
                    continue
                if isinstance(result, Mapping):
                    _check_replacement(result, set(out))
                    available.update(result)
                    sent.update(result)
                else:
                    pending.append((set(result.covers) & set(out), result))
            for names, handle in pending:
                settle(handle, names)
        except BaseException:  # nothing half-done: the carried state is as before the execution
            Runner.restore(written)
            raise
        return Execution(host, sent, written, overwritten)

    def run(
        self,
        bound: BoundSession,
        feeds: Mapping[str, Any],
        fetch_host: Sequence[str] = (),
        fetch_device: Sequence[str] = (),
        into: Mapping[str, ort.OrtValue] | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, ort.OrtValue]]:
        """One run of one session: carried inputs bound to their current buffers, carried
        outputs to the other ones (which then become current), feeds bound as given. Returns
        the host fetches and the device ones. A carried output fetched to the device is its
        new current buffer (valid until the run after next writes it again); one in ``into``
        is written into the value given there. A carried tensor the session writes in place is
        read and written in its current buffer.

        In four steps: the binding for this buffer assignment and these fetches (made once,
        then cached), what changes each run bound on it, the run, and its outputs collected."""
        if self._awaiting is not None:
            self._awaiting()
        plan = self._plan(bound, fetch_host, fetch_device, into)
        self._bind_run(bound, plan, feeds)
        try:
            self._launch(bound, plan, feeds)
        except GraphforgeError as exc:
            if not bound.captured:
                raise
            # a capture onnxruntime could not make (a kernel that waits for the host while the
            # stream records): the session runs uncaptured from now on, against the same buffers
            self._stop_capture(bound, f"its capture failed: {one_line(exc)}")
            plan = self._plan(bound, fetch_host, fetch_device, into)
            self._bind_run(bound, plan, feeds)
            self._launch(bound, plan, feeds)
        return self._collect(bound, plan)

    def _captures(self) -> bool:
        """Whether capture-ready sessions are captured: on CUDA (onnxruntime's CUDA graphs)."""
        return self.device.type == "cuda"

    def _stop_capture(self, bound: BoundSession, reason: str) -> None:
        """Make ``bound``'s session again without capture (its bindings too: they were the
        captured session's), keeping its input and output buffers; the reason is kept."""
        model, dims = bound.uncaptured
        options = self._options(dims, False, shared_arena=True)
        bound.session = create_session(model, providers=list(self.device.providers), options=options, where=bound.where)
        bound.uncaptured = None
        bound.bindings.clear()
        self._refuse_capture(bound.where, reason)

    def _plan(
        self,
        bound: BoundSession,
        fetch_host: Sequence[str],
        fetch_device: Sequence[str],
        into: Mapping[str, ort.OrtValue] | None,
    ) -> _RunPlan:
        """Step 1: the second buffer of each carried output that has none yet, and the cached
        binding for the buffers this run reads and writes and what it fetches."""
        into = {n: v for n, v in (into or {}).items() if n in fetch_device}
        for c in bound.carried_out:
            if len(c.slots) == 1 and not bound.writes_in_place(c):
                c.slots.append(
                    ort.OrtValue.ortvalue_from_shape_and_type(c.shape, c.dtype, self.device.type, self.device.id)
                )
        fetch_host, fetch_device = list(dict.fromkeys(fetch_host)), list(dict.fromkeys(fetch_device))
        key = (
            tuple(c.current for c in bound.carried_in),
            tuple(_write_slot(bound, c) for c in bound.carried_out),
            tuple(fetch_host),
            tuple(fetch_device),
            # a binding of a capture-ready session binds the caller's buffers once: theirs are part of its key
            tuple((n, into[n].data_ptr() if bound.static_inputs is not None else 0) for n in fetch_device if n in into),
        )
        in_buffers = {c.output: c for c in bound.carried_out}  # read from the buffers after the run
        bound_host = [n for n in fetch_host if n not in in_buffers and n not in into]
        bound_device = [n for n in fetch_device if n not in in_buffers and n not in into]
        cached = bound.bindings.get(key)
        if cached is None:
            if bound.static_inputs is not None:
                cached = self._static_binding(bound, bound_host, bound_device, into)
            else:
                cached = self._binding(bound, bound_host, bound_device)
            bound.bindings[key] = cached
        return _RunPlan(cached, fetch_host, fetch_device, bound_device, in_buffers, into)

    def _bind_run(self, bound: BoundSession, plan: _RunPlan, feeds: Mapping[str, Any]) -> None:
        """Step 2: what a run binds afresh: the fixed buffers a run before cleared, the feeds
        (or the inputs' defaults), and the outputs of unknown shape or sent on."""
        cached, binding = plan.cached, plan.cached.binding
        if cached.static_outputs is not None:
            self._copy_feeds(bound, feeds)
            return
        if cached.cleared:
            for name, value in cached.fixed:
                binding.bind_ortvalue_output(name, value)
            cached.cleared = False
        if cached.inputs_cleared:
            for name, value in cached.fixed_inputs:
                binding.bind_ortvalue_input(name, value)
            cached.inputs_cleared = False
        for name in bound.free_inputs:
            if name in feeds:
                self._bind_feed(binding, bound, name, feeds[name])
            elif name in bound.defaults:
                binding.bind_ortvalue_input(name, bound.defaults[name])
            else:
                takes = ", ".join(self.batch_inputs or bound.free_inputs)
                raise GraphforgeError(f"missing batch input {name!r}; the program takes: {takes}")
        # outputs of unknown shape are bound afresh each run, so onnxruntime allocates them
        for name in cached.allocated:
            binding.bind_output(name, "cpu")
        for name in plan.bound_device:
            binding.bind_output(name, self.device.type, self.device.id)
        for name in plan.fetch_device:
            if name in plan.into:
                binding.bind_ortvalue_output(name, plan.into[name])

    @staticmethod
    def _launch(bound: BoundSession, plan: _RunPlan, feeds: Mapping[str, Any]) -> None:
        """Step 3: the run (on a captured session: the capture of its binding's graph, or its replay)."""
        binding = plan.cached.binding
        options = run_options(plan.cached.graph_id) if plan.cached.graph_id is not None else None
        try:
            bound.session.run_with_iobinding(binding, options)
        except Exception as exc:
            raise GraphforgeError(f"onnxruntime failed to run {bound.where}: {one_line(exc)}") from None
        finally:
            # the binding holds on to its inputs until they are bound again: the activations an
            # earlier segment sent this one would live on through the next step's runs of the
            # segments before (with the outputs below: GPT-2 2x256's data-parallel step on 2
            # processes, 1282 MiB resident from the second step on, 1066 MiB with both cleared;
            # either alone left it at 1282). A capture-ready binding's inputs are its own buffers.
            if plan.cached.static_outputs is None and any(
                isinstance(feeds.get(name), ort.OrtValue) for name in bound.free_inputs
            ):
                binding.clear_binding_inputs()
                plan.cached.inputs_cleared = True

    @staticmethod
    def _collect(bound: BoundSession, plan: _RunPlan) -> tuple[dict[str, np.ndarray], dict[str, ort.OrtValue]]:
        """Step 4: the host and device fetches; the buffers written become current."""
        cached, binding, into, in_buffers = plan.cached, plan.cached.binding, plan.into, plan.in_buffers
        host = {name: np.array(value.numpy(), copy=True) for name, value in cached.preallocated.items()}
        device = {}
        if cached.static_outputs is not None:
            fixed = cached.static_outputs
            host = {n: to_numpy(fixed[n]) for n in plan.fetch_host if n in fixed and n not in in_buffers}
            device = {n: fixed[n] for n in plan.bound_device}
        elif cached.allocated or plan.bound_device:
            values = binding.get_outputs()  # in the order bound
            offset = len(bound.carried_out) + len(cached.preallocated)
            host.update({n: values[offset + i].numpy() for i, n in enumerate(cached.allocated)})
            offset += len(cached.allocated)
            device = {n: values[offset + i] for i, n in enumerate(plan.bound_device)}
            host.update({n: to_numpy(device[n]) for n in cached.via_device})
            # and to the outputs onnxruntime allocated: cleared, they live as long as the caller keeps them
            del values
            binding.clear_binding_outputs()
            cached.cleared = True
        for c in bound.carried_out:
            c.current = _write_slot(bound, c)
        host.update({n: to_numpy(in_buffers[n].value) for n in plan.fetch_host if n in in_buffers})
        device.update({n: in_buffers[n].value for n in plan.fetch_device if n in in_buffers})
        device.update({n: into[n] for n in plan.fetch_device if n in into and n not in in_buffers})
        host.update({n: to_numpy(into[n]) for n in plan.fetch_host if n in into and n not in in_buffers})
        return host, device

    def _binding(self, bound: BoundSession, fetch_host: list[str], fetch_device: list[str]) -> _Binding:
        """An IOBinding with the carried tensors bound to their buffers, and the small host
        outputs of fixed shape (the loss, grad_norm) bound to preallocated ones: none of
        them is bound again, and only outputs of other shapes are read back per run. A host
        output also in ``fetch_device`` is read from its device value (``via_device``)."""
        unknown = [n for n in [*fetch_host, *fetch_device] if n not in bound.outputs]
        if unknown:
            raise GraphforgeError(f"{bound.where} has no output {unknown[0]!r}")
        binding = bound.session.io_binding()
        fixed_inputs = [(c.name, c.slots[c.current]) for c in bound.carried_in]
        fixed = [(c.output, c.slots[_write_slot(bound, c)]) for c in bound.carried_out]
        for name, value in fixed:
            binding.bind_ortvalue_output(name, value)
        preallocated, allocated = {}, []
        via_device = [n for n in dict.fromkeys(fetch_host) if n in fetch_device]
        for name in dict.fromkeys(n for n in fetch_host if n not in via_device):
            shape = bound.output_shapes.get(name)
            if shape is not None and math.prod(shape) <= PREALLOCATED_MAX:
                value = ort.OrtValue.ortvalue_from_shape_and_type(shape, bound.output_dtypes[name], "cpu", 0)
                binding.bind_ortvalue_output(name, value)
                preallocated[name] = value
                fixed.append((name, value))
            else:
                allocated.append(name)
        return _Binding(binding, preallocated, allocated, via_device, fixed, fixed_inputs)

    def _static_binding(
        self, bound: BoundSession, fetch_host: list[str], fetch_device: list[str], into: Mapping[str, ort.OrtValue]
    ) -> _Binding:
        """A capture-ready session's binding: every input and output bound once, to the carried
        buffers, the session's input buffers, the caller's ``into`` buffers and the session's
        output buffers (made on first use; host fetches are copied from them after each run).
        On a captured session each binding is a graph of its own."""
        unknown = [n for n in [*fetch_host, *fetch_device] if n not in bound.outputs]
        if unknown:
            raise GraphforgeError(f"{bound.where} has no output {unknown[0]!r}")
        binding = bound.session.io_binding()
        fixed_inputs = [(c.name, c.slots[c.current]) for c in bound.carried_in] + list(bound.static_inputs.items())
        fixed = [(c.output, c.slots[_write_slot(bound, c)]) for c in bound.carried_out]
        outputs = {}
        for name in dict.fromkeys([*fetch_host, *fetch_device]):
            if name not in bound.output_buffers:
                shape, dtype = bound.output_shapes[name], bound.output_dtypes[name]
                bound.output_buffers[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                    shape, dtype, self.device.type, self.device.id
                )
            outputs[name] = bound.output_buffers[name]
        fixed += [*outputs.items(), *into.items()]
        for name, value in fixed:
            binding.bind_ortvalue_output(name, value)
        for name, value in fixed_inputs:
            binding.bind_ortvalue_input(name, value)
        graph_id = len(bound.bindings) if bound.captured else None
        return _Binding(binding, {}, [], [], fixed, fixed_inputs, inputs_cleared=False, static_outputs=outputs,
                        graph_id=graph_id)  # fmt: skip

    def _copy_feeds(self, bound: BoundSession, feeds: Mapping[str, Any]) -> None:
        """A capture-ready run's inputs: each fed value copied into its input's buffer (none
        where it is that buffer); an input not fed holds its default again."""
        queued = False
        for name, buffer in bound.static_inputs.items():
            expected = bound.input_dtypes.get(name)
            if name in feeds:
                queued |= copy_feed(buffer, feeds[name], name, expected)
                bound.fed.add(name)
            elif name in bound.defaults:
                if name in bound.fed:
                    copy_feed(buffer, bound.defaults[name], name, expected)
                    bound.fed.discard(name)
            else:
                takes = ", ".join(self.batch_inputs or bound.free_inputs)
                raise GraphforgeError(f"missing batch input {name!r}; the program takes: {takes}")
        if queued:
            synchronize(self.device)

    @staticmethod
    def _bind_feed(binding: ort.IOBinding, bound: BoundSession, name: str, value: Any) -> None:
        if isinstance(value, ort.OrtValue):
            binding.bind_ortvalue_input(name, value)
            return
        binding.bind_cpu_input(name, feed_array(name, value, bound.input_dtypes.get(name)))


def _write_slot(bound: BoundSession, c: Carried) -> int:
    """The buffer a run of ``bound`` writes ``c``'s new value into."""
    return c.current if bound.writes_in_place(c) else 1 - c.current


def to_numpy(value: ort.OrtValue) -> np.ndarray:
    """A host copy of an OrtValue: on the CPU numpy() may share the buffer, which the next
    step overwrites."""
    return np.array(value.numpy(), copy=True)


def _check_replacement(replaced: Mapping[str, Any], sent: set[str]) -> None:
    unknown = sorted(set(replaced) - sent)
    if unknown:
        raise GraphforgeError(f"a hook replaced {unknown[0]!r}, which the segment before it did not send")
