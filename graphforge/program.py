"""One typed reader of a training program's roles: what each input and output of the one
``.onnx`` file is for.

The passes record roles in the model's metadata (``graphforge.roles``); everything that
runs, checks, checkpoints or shows a program reads them here, once, from the proto (never
importing it into onnx-graphsurgeon), instead of parsing ``metadata_props`` itself::

    roles = ProgramRoles.read("program.onnx")
    roles.batch_inputs        # what a batch feeds: x, labels (name, dtype, dims, default?)
    roles.carried             # parameters, optimizer states, accumulators, buffers: input -> output
    roles.gradient_boundary   # parameter -> its gradient where allreduce / unscaling insert themselves
    roles.forward_outputs     # what the forward model computes (not loss, gradients, updates)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from graphforge import roles
from graphforge.errors import GraphforgeError
from graphforge.graph import Model
from graphforge.ir import onnx_dtype
from graphforge.model_io import ModelSource, load

#: what a carried tensor is (``CarriedSpec.role``)
CARRIED_ROLES = ("parameter", "optimizer", "accumulator", "buffer")


@dataclass(frozen=True)
class CarriedSpec:
    """One tensor a program carries from step to step: the input that holds it, the output
    that replaces it after a step, and what it is.

    ``role``: "parameter" (trained), "optimizer" (a moment, a momentum buffer), "accumulator"
    (accumulated gradients) or "buffer" (BatchNorm running statistics). ``init``: its first
    value is the program's "initializer" of that name, or "zeros". ``like``: the parameter an
    optimizer state or accumulator belongs to."""

    input: str
    output: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    init: str = "zeros"
    like: str | None = None

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> CarriedSpec:
        return cls(
            entry["input"],
            entry["output"],
            entry["role"],
            entry["dtype"],
            tuple(entry["shape"]),
            entry.get("init", "zeros"),
            entry.get("like"),
        )

    def to_json(self) -> dict:
        """The ``graphforge.state`` entry (its key order is the file format's)."""
        return {
            "input": self.input,
            "output": self.output,
            "init": self.init,
            "role": self.role,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "like": self.like,
        }


@dataclass(frozen=True)
class AllReduceRole:
    """How the allreduce (or zero) pass reduces the gradients across replicas: averaged or
    summed, and the parameters of each bucket (in the order their gradients become ready in
    backward); ``reduced``: parameter -> the reduced gradient everything after the boundary
    reads. ``zero``: 0 for an all-reduce (every replica updates everything), else the ZeRO
    stage of the zero pass (the gradients reduce-scattered, each replica updating its shard,
    the updated parameters all-gathered: ``gathered``, parameter -> the gathered output)."""

    average: bool
    bucket_mb: float
    buckets: tuple[tuple[str, ...], ...]
    reduced: Mapping[str, str]
    zero: int = 0
    gathered: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> AllReduceRole:
        return cls(
            bool(entry["average"]),
            float(entry["bucket_mb"]),
            tuple(tuple(bucket) for bucket in entry["buckets"]),
            dict(entry["reduced"]),
            int(entry.get("zero", 0)),
            dict(entry.get("gathered", {})),
        )

    def to_json(self) -> dict:
        entry = {
            "average": self.average,
            "bucket_mb": self.bucket_mb,
            "buckets": [list(b) for b in self.buckets],
            "reduced": dict(self.reduced),
        }
        if self.zero:
            entry.update(zero=self.zero, gathered=dict(self.gathered))
        return entry


@dataclass(frozen=True)
class StagesRole:
    """How the pipeline pass split the program into stages: the forward tensor each cut
    follows (stage k computes what ``cuts[k]`` needs, the last stage the rest), the
    micro-batches per step and the schedule, each stage's share of the global gradient
    norm (``partial_norms``: (stage, tensor)), each stage's parameters, and the costs the
    pass reported."""

    stages: int
    microbatches: int
    schedule: str
    cuts: tuple[str, ...]
    partial_norms: tuple[tuple[int, str], ...]
    parameters: tuple[tuple[str, ...], ...]
    costs: Mapping[str, Any]

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> StagesRole:
        return cls(
            int(entry["stages"]),
            int(entry["microbatches"]),
            str(entry["schedule"]),
            tuple(entry["cuts"]),
            tuple((int(s), str(t)) for s, t in entry.get("partial_norms", [])),
            tuple(tuple(p) for p in entry.get("parameters", [])),
            dict(entry.get("costs", {})),
        )

    def to_json(self) -> dict:
        return {
            "stages": self.stages,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "cuts": list(self.cuts),
            "partial_norms": [list(p) for p in self.partial_norms],
            "parameters": [list(p) for p in self.parameters],
            "costs": dict(self.costs),
        }


@dataclass(frozen=True)
class TensorParallelRole:
    """How the tensor_parallel pass split the program among ``size`` processes: each split
    parameter's axis (``split``: parameter -> the axis each member holds 1/size of), the
    blocks it split, ``rank``: None in the whole program, the member's index in one member's
    program, ``sections``: a fused projection's parameters (a QKV weight) -> the sizes of
    its sections along the split axis, of each of which a member holds 1/size, and
    ``uneven``: parameters whose split axis ``size`` does not divide (a vocabulary of 50257)
    -> that axis's whole size, of which the first members hold one more row
    (``member_range``)."""

    size: int
    split: Mapping[str, int]
    blocks: tuple[Mapping[str, Any], ...] = ()
    rank: int | None = None
    sections: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    uneven: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> TensorParallelRole:
        rank = entry.get("rank")
        return cls(
            int(entry["size"]),
            {str(k): int(v) for k, v in entry["split"].items()},
            tuple(entry.get("blocks", [])),
            None if rank is None else int(rank),
            {str(k): tuple(int(x) for x in v) for k, v in entry.get("sections", {}).items()},
            {str(k): int(v) for k, v in entry.get("uneven", {}).items()},
        )

    def to_json(self) -> dict:
        entry = {"size": self.size, "blocks": [dict(b) for b in self.blocks], "split": dict(self.split)}
        if self.rank is not None:
            entry["rank"] = self.rank
        if self.sections:
            entry["sections"] = {k: list(v) for k, v in self.sections.items()}
        if self.uneven:
            entry["uneven"] = dict(self.uneven)
        return entry

    @property
    def split_outputs(self) -> dict[str, int]:
        """The model's outputs a member computes a slice of (the logits of an LM head split
        along the vocabulary) -> the axis it holds a part of."""
        return {name: int(axis) for block in self.blocks for name, axis in block.get("outputs", {}).items()}

    def member_slice(self, name: str, value: np.ndarray) -> np.ndarray:
        """Member ``rank``'s slice of the whole parameter ``name``."""
        return member_slice(value, self.split[name], self.rank, self.size, self.sections.get(name))

    def member_shape(self, name: str, shape: Sequence[int]) -> list[int]:
        """The shape of member ``rank``'s slice of the whole parameter ``name`` of ``shape``."""
        axis, sections = self.split[name], self.sections.get(name)
        out = list(shape)
        out[axis] = (
            sum(s // self.size for s in sections) if sections else member_range(out[axis], self.rank, self.size)[1]
        )
        return out


def member_range(whole: int, rank: int, size: int) -> tuple[int, int]:
    """The first index and the count of member ``rank``'s part of an axis of ``whole``: 1/size
    of it where ``size`` divides it, else the first ``whole % size`` members one more."""
    base, extra = divmod(whole, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def member_slice(value: np.ndarray, axis: int, rank: int, size: int, sections=None) -> np.ndarray:
    """Member ``rank``'s slice (of ``size``) of ``value`` along ``axis``: its part
    (``member_range``) of it, or 1/size of each of its ``sections`` (their sizes along the
    axis) side by side."""
    if not sections:
        first, count = member_range(value.shape[axis], rank, size)
        return np.ascontiguousarray(np.take(value, np.arange(first, first + count), axis=axis))
    parts = np.split(value, np.cumsum(sections)[:-1], axis=axis)
    return np.ascontiguousarray(np.concatenate([np.split(p, size, axis=axis)[rank] for p in parts], axis=axis))


def joined_slices(members, axis: int, sections=None) -> np.ndarray:
    """The whole tensor from every member's slice (``member_slice``'s inverse), in rank order."""
    if not sections:
        return np.concatenate(members, axis=axis)
    size = len(members)
    cuts = np.cumsum([s // size for s in sections])[:-1]
    pieces = [np.split(m, cuts, axis=axis) for m in members]
    return np.concatenate([p[i] for i in range(len(sections)) for p in pieces], axis=axis)


@dataclass(frozen=True)
class FrozenWeight:
    """A weight the program reads and never trains (``graphforge.frozen``): an initializer
    of the program, not a carried tensor, with no gradient, optimizer state or reduction.
    ``by``: what froze it: "autodiff" (its ``trainable``/``frozen`` patterns), "torch"
    (``requires_grad=False``), "lora" (an adapter's base weight) or "freeze" (the freeze pass:
    a backbone frozen by name or up to a tensor)."""

    name: str
    by: str

    @classmethod
    def from_json(cls, name: str, entry: Mapping[str, Any]) -> FrozenWeight:
        return cls(name, str(entry.get("by", "")))

    def to_json(self) -> dict:
        return {"by": self.by}


@dataclass(frozen=True)
class LoraAdapter:
    """One low-rank adapter of the lora pass (``graphforge.lora``), named and laid out as
    PEFT's: ``module``'s output gains ``scale · (dropout(x) · Aᵀ) · Bᵀ``, A (``a``) of shape
    [r, in] and B (``b``) of [out, r], parameters of type ``dtype``; ``weight`` is the frozen
    base weight, stored [in, out] where ``fan_in_fan_out`` (a TorchScript export's
    ``onnx::MatMul_…``, GPT-2's Conv1D) and [out, in] otherwise (torch's Linear); ``scale``
    is alpha / r, or alpha / √r with ``rslora``."""

    module: str
    weight: str
    a: str
    b: str
    r: int
    alpha: float
    scale: float
    rslora: bool
    dropout: float
    dtype: str
    fan_in_fan_out: bool

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> LoraAdapter:
        return cls(
            str(entry["module"]),
            str(entry["weight"]),
            str(entry["A"]),
            str(entry["B"]),
            int(entry["r"]),
            float(entry["alpha"]),
            float(entry["scale"]),
            bool(entry.get("rslora", False)),
            float(entry.get("dropout", 0.0)),
            str(entry.get("dtype", "float32")),
            bool(entry.get("fan_in_fan_out", False)),
        )

    def to_json(self) -> dict:
        entry = dataclasses.asdict(self)
        entry["A"], entry["B"] = entry.pop("a"), entry.pop("b")
        return entry


@dataclass(frozen=True)
class QuantizedWeight:
    """A frozen weight the quantize_frozen pass stored as integers (``graphforge.quantized``):
    ``data`` (int4 or int8, ``bits``) holds it [in, out], ``scale`` one float per ``block`` rows
    of it (DequantizeLinear's axis 0); ``shape`` is the float weight's, ``transposed`` where
    ``data`` is its transpose (a torch Linear's [out, in] weight)."""

    name: str
    data: str
    scale: str
    bits: int
    block: int
    shape: tuple[int, ...]
    transposed: bool

    @classmethod
    def from_json(cls, name: str, entry: Mapping[str, Any]) -> QuantizedWeight:
        return cls(
            name,
            str(entry["data"]),
            str(entry["scale"]),
            int(entry["bits"]),
            int(entry["block"]),
            tuple(int(d) for d in entry.get("shape", ())),
            bool(entry.get("transposed", False)),
        )

    def to_json(self) -> dict:
        entry = dataclasses.asdict(self)
        del entry["name"]
        entry["shape"] = list(self.shape)
        return entry


@dataclass(frozen=True)
class LossScaling:
    """The loss scaling of the mixed_precision pass: "dynamic" or "static", the carried
    scale, growth tracker and skipped-update count (inputs), the output saying whether this
    step's update was skipped, torch.amp.GradScaler's settings, and each parameter's
    gradient times 1/scale (what the update reads; {} in programs compiled before it was
    recorded)."""

    kind: str
    scale: str
    growth_tracker: str
    skipped: str
    update_skipped: str
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    unscaled: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> LossScaling | None:
        if entry.get("kind", "none") == "none":
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in entry.items() if name in known})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BatchInput:
    """A program input a batch feeds: name, dtype, dims (int, or a name for a dynamic one)
    and whether the program has a default for it (an initializer)."""

    name: str
    dtype: np.dtype
    dims: tuple[int | str | None, ...] | None
    has_default: bool

    def describe_dims(self) -> str:
        return "?" if self.dims is None else "[" + ", ".join("?" if d is None else str(d) for d in self.dims) + "]"


@dataclass(frozen=True)
class ProgramRoles:
    """The roles of a model's inputs and outputs, as its metadata records them.

    Works for any model: one that no pass touched has no loss, gradients or carried state,
    and all of its inputs and outputs are batch inputs and forward outputs."""

    #: every metadata_props entry, graphforge's keys and others
    metadata: Mapping[str, str]
    #: graph inputs and outputs, in order
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    loss: str | None
    labels: str | None
    parameters: tuple[str, ...]
    #: parameter (or differentiated input) -> its gradient output
    gradients: Mapping[str, str]
    #: parameter -> the tensor holding its gradient at the optimizer's gradient boundary
    gradient_boundary: Mapping[str, str]
    #: the gradients' reduction across data-parallel replicas (the allreduce pass), or None
    allreduce: AllReduceRole | None
    #: the pipeline stages (the pass users write ``pipeline(...)``), or None
    stages: StagesRole | None
    #: the split among tensor-parallel processes (the tensor_parallel pass), or None
    tensor_parallel: TensorParallelRole | None
    #: the mixed_precision pass's low type ("float16", "bfloat16") and the provider whose
    #: kernels it checked, or None; its loss scaling, or None
    mixed_precision: Mapping[str, Any] | None
    loss_scaling: LossScaling | None
    #: the channel block of onnxruntime's NCHWc kernels the fuse pass laid weights out for, or None
    nchwc_block: int | None
    #: the weights the program reads and never trains, by name
    frozen: Mapping[str, FrozenWeight]
    #: the lora pass's adapters, in the order it made them (none without it)
    lora: tuple[LoraAdapter, ...]
    #: the base the lora pass froze, by reference: weight -> the CRC-32 of its values as the
    #: pass found them ({} without it); a checkpoint of the program records it, so that one
    #: trained on another base is refused
    lora_base: Mapping[str, int]
    #: the frozen weights the quantize_frozen pass stored as integers, by the float weight's name
    quantized: Mapping[str, QuantizedWeight]
    #: the optimizer pass that made the update ("adamw", ...), and its hyperparameters
    optimizer: str | None
    hyperparameters: Mapping[str, Any]
    carried: tuple[CarriedSpec, ...]
    lr_input: str | None
    step_input: str | None
    reset_input: str | None
    default_lr: float | None
    #: the global gradient norm output, and the step count after the step (when present)
    grad_norm: str | None
    step_output: str | None
    batch_inputs: tuple[BatchInput, ...]
    forward_outputs: tuple[str, ...]
    _carried_by_input: dict[str, CarriedSpec] = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ reading

    @classmethod
    def read(cls, program: ModelSource | Model) -> ProgramRoles:
        """The roles of a path, bytes, ModelProto or Model (a Model is read from its
        onnx-graphsurgeon graph, without exporting it)."""
        if isinstance(program, Model):
            return cls.of_model(program)
        return cls.of_proto(program if isinstance(program, onnx.ModelProto) else load(program))

    @classmethod
    def of_proto(cls, proto: onnx.ModelProto) -> ProgramRoles:
        graph = proto.graph
        initializers = {t.name for t in graph.initializer}
        producers = {name: node.name for node in graph.node for name in node.output if name}
        inputs = [
            (v.name, *_value_type(v.type), v.name in initializers)
            for v in graph.input
            if v.type.HasField("tensor_type")
        ]
        return cls._build(
            roles.metadata_of(proto),
            inputs,
            [v.name for v in graph.input],
            [v.name for v in graph.output],
            producers,
        )

    @classmethod
    def of_model(cls, model: Model) -> ProgramRoles:
        graph = model.graph
        producers = {t.name: node.name or "" for node in graph.nodes for t in node.outputs}
        tensors = graph.tensors()
        initializer_inputs = [n for n in model.initializer_inputs if n in tensors]
        inputs = [(t.name, _np_dtype(t.dtype), _dims(t.shape), False) for t in graph.inputs]
        inputs += [(n, _np_dtype(tensors[n].dtype), _dims(tensors[n].shape), True) for n in initializer_inputs]
        names = [t.name for t in graph.inputs] + initializer_inputs
        return cls._build(dict(model.metadata), inputs, names, [t.name for t in graph.outputs], producers)

    @classmethod
    def _build(
        cls,
        metadata: dict[str, str],
        typed_inputs: Sequence[tuple[str, np.dtype | None, tuple | None, bool]],
        inputs: Sequence[str],
        outputs: Sequence[str],
        producers: Mapping[str, str],
    ) -> ProgramRoles:
        def json_value(key: str, default):
            text = metadata.get(key)
            if text is None:
                return default
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise GraphforgeError(f"the model's metadata {key!r} is not valid JSON: {text[:80]!r}") from None

        carried = tuple(CarriedSpec.from_json(entry) for entry in json_value(roles.STATE, []))
        mixed_precision = json_value(roles.MIXED_PRECISION, None)
        stages_key = roles.STAGES if roles.STAGES in metadata else roles.STAGES_BEFORE
        optimizer = json_value(roles.OPTIMIZER, None) or {}
        step_input = metadata.get(roles.STEP)
        output_set = set(outputs)
        loss = metadata.get(roles.LOSS)
        gradients = dict(json_value(roles.GRADIENTS, {}))
        grad_norm = roles.GRAD_NORM if roles.OPTIMIZER in metadata and roles.GRAD_NORM in output_set else None
        step_output = roles.next_name(step_input) if step_input and roles.next_name(step_input) in output_set else None
        scalars = {metadata.get(k) for k in (roles.LR, roles.STEP, roles.RESET_GRAD)} - {None}
        carried_inputs = {c.input for c in carried}
        not_forward = {loss, grad_norm, step_output, *gradients.values(), *(c.output for c in carried)}
        if mixed_precision:
            not_forward.add(mixed_precision.get("loss_scale", {}).get("update_skipped"))
        default_lr = metadata.get(roles.DEFAULT_LR)
        return cls(
            metadata=metadata,
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            loss=loss if loss in output_set else None,
            labels=metadata.get(roles.LABELS),
            parameters=tuple(json_value(roles.PARAMETERS, [])),
            gradients=gradients,
            gradient_boundary=dict(json_value(roles.GRADIENT_BOUNDARY, {})),
            allreduce=AllReduceRole.from_json(json_value(roles.ALLREDUCE, None))
            if roles.ALLREDUCE in metadata
            else None,
            stages=StagesRole.from_json(json_value(stages_key, None)) if stages_key in metadata else None,
            tensor_parallel=TensorParallelRole.from_json(json_value(roles.TENSOR_PARALLEL, None))
            if roles.TENSOR_PARALLEL in metadata
            else None,
            mixed_precision=mixed_precision,
            loss_scaling=LossScaling.from_json(mixed_precision.get("loss_scale", {})) if mixed_precision else None,
            nchwc_block=json_value(roles.FUSION, {}).get("nchwc_block"),
            frozen={name: FrozenWeight.from_json(name, e) for name, e in json_value(roles.FROZEN, {}).items()},
            lora=tuple(LoraAdapter.from_json(e) for e in json_value(roles.LORA, {}).get("adapters", [])),
            lora_base={str(k): int(v) for k, v in json_value(roles.LORA, {}).get("base", {}).items()},
            quantized={n: QuantizedWeight.from_json(n, e) for n, e in json_value(roles.QUANTIZED, {}).items()},
            optimizer=optimizer.get("kind"),
            hyperparameters=dict(optimizer.get("hyperparameters", {})),
            carried=carried,
            lr_input=metadata.get(roles.LR),
            step_input=step_input,
            reset_input=metadata.get(roles.RESET_GRAD),
            default_lr=float(default_lr) if default_lr is not None else None,
            grad_norm=grad_norm,
            step_output=step_output,
            batch_inputs=tuple(
                BatchInput(name, dtype, dims, has_default)
                for name, dtype, dims, has_default in typed_inputs
                if name not in carried_inputs and name not in scalars and dtype is not None
            ),
            forward_outputs=tuple(
                name
                for name in outputs
                if name not in not_forward and not producers.get(name, "").startswith(roles.GENERATED_PREFIXES)
            ),
            _carried_by_input={c.input: c for c in carried},
        )

    # ------------------------------------------------------------------ questions

    @property
    def is_training_program(self) -> bool:
        """Whether an optimizer pass made this a whole training step (it carries state)."""
        return roles.STATE in self.metadata

    def require_training_program(self) -> ProgramRoles:
        """``self``, or a GraphforgeError saying how to compile a training program."""
        if not self.is_training_program:
            raise GraphforgeError(
                "the model is not a training program (no graphforge.state metadata): compile it with "
                "an optimizer pass, e.g. 'loss(kind=..., output=...), autodiff, adamw(lr=...)'"
            )
        return self

    @property
    def class_axis(self) -> int:
        """The axis of the classes in the scores the loss reads: 1, or -1 (the last, as in a
        causal LM's [batch, seq, vocab] logits)."""
        return int(self.metadata.get(roles.LOSS_CLASS_AXIS, 1))

    @property
    def accumulates(self) -> bool:
        """Whether the program accumulates gradients over micro-batches (``accumulate=true``)."""
        return self.reset_input is not None

    @property
    def scalar_inputs(self) -> tuple[str, ...]:
        """The learning-rate, step and reset-flag inputs a runtime feeds (those present)."""
        return tuple(n for n in (self.lr_input, self.step_input, self.reset_input) if n is not None)

    def carried_spec(self, name: str) -> CarriedSpec | None:
        """The carried tensor whose input is ``name``, or None."""
        return self._carried_by_input.get(name)

    def carried_with_role(self, *wanted: str) -> list[CarriedSpec]:
        return [c for c in self.carried if c.role in wanted]

    @property
    def step_reports(self) -> list[str]:
        """The outputs a step hands back besides the loss, those the program has: the
        gradient norm, and whether loss scaling skipped the update."""
        skipped = self.loss_scaling.update_skipped if self.loss_scaling else None
        return [n for n in (self.grad_norm, skipped) if n is not None]

    @property
    def loss_scale_states(self) -> tuple[str, ...]:
        """The carried scalars of loss scaling (the scale, its growth tracker, the skipped-update
        count), or () without it."""
        s = self.loss_scaling
        return () if s is None else (s.scale, s.growth_tracker, s.skipped)

    @property
    def update_outputs(self) -> set[str]:
        """What the optimizer's update writes: the next parameters and optimizer states,
        the gradient norm, the step count and whether loss scaling skipped the update (not
        accumulators or buffers, which the forward/backward part writes)."""
        updated = {c.output for c in self.carried_with_role("parameter", "optimizer")}
        return updated | {*self.step_reports, *([self.step_output] if self.step_output else [])}

    def batch_input_names(self) -> list[str]:
        return [b.name for b in self.batch_inputs]


def program_proto(program: ModelSource | Model) -> onnx.ModelProto:
    """A program as a ModelProto, from a path, bytes, ModelProto (itself, not a copy) or Model."""
    if isinstance(program, Model):
        return program.to_proto()
    if isinstance(program, onnx.ModelProto):
        return program
    return load(program)


def _value_type(type_proto: onnx.TypeProto) -> tuple[np.dtype | None, tuple | None]:
    tensor_type = type_proto.tensor_type
    dims = None
    if tensor_type.HasField("shape"):
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim)
    return _np_dtype(tensor_type.elem_type), dims


def _np_dtype(dtype) -> np.dtype | None:
    code = onnx_dtype(dtype)
    if code is None:
        return None
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(code))
    except (KeyError, TypeError, ValueError):
        return None


def _dims(shape) -> tuple | None:
    return None if shape is None else tuple(d if isinstance(d, int | str) else None for d in shape)
