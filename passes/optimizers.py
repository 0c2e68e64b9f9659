"""Optimizer passes: turn a gradient graph into a training step, in standard ONNX ops.

After ``autodiff``, an optimizer pass makes the model one functional training step:
parameters, optimizer states, the learning rate ``lr`` and the step count ``step`` go in;
the loss, the updated parameters ``P_next``, updated states and ``step_next`` come out.
Parameters stay initializers *and* become graph inputs (their initial values are the
defaults), so the one file is the whole program. Everything the runtime needs to know
is in the metadata (graphforge.roles): which input each state is, its initial value, and
the output that replaces it after a step.

Each update follows torch.optim's arithmetic step for step (same operation order, scalar
factors computed in float64 and applied in the parameter's type), so parameters match
torch's after hundreds of steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.builder import Builder
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.placement.buckets import marker_call
from graphforge.program import CarriedSpec, ProgramRoles


@dataclass
class _Step:
    """What an update rule gets for one parameter."""

    b: Builder
    param: gs.Tensor
    grad: gs.Tensor
    lr: gs.Tensor  # float64 scalar
    t: gs.Tensor  # float64 scalar: the step number, 1 on the first step
    first: gs.Tensor  # bool scalar: this is the first step
    #: the step's scalars made so far, by key: each is made once for every parameter (made per
    #: parameter, they were 17 of the 35 nodes each AdamW parameter had in GPT-2 small's program;
    #: onnxruntime folded and shared them, so this shrinks the program, not the step time)
    shared: dict = field(default_factory=dict)

    def scalar(self, value: float | gs.Tensor) -> gs.Tensor:
        """A float64 scalar (a Python number or an expression) in the parameter's type: a
        constant of that type where NumPy has it (the value a Cast gives), else a Cast. Shaped
        [1, …, 1] to the parameter's rank where its last dim is 1 (a 1×1 convolution's weight):
        onnxruntime 1.31's CPU kernels broadcast a 0-d scalar over a tensor ending in a 1 element
        by element, 25× slower than over [1, …, 1] (6.3 against 0.25 ms for [1280, 320, 1, 1] at
        one thread; the same values), which made AdamW's update of a MobileNetV2's last blocks
        most of its step."""
        scalar = self._scalar(value)
        rank = _ones_rank(self.param)
        if rank is None:
            return scalar
        if isinstance(scalar, gs.Constant):
            return self.once(("ranked", scalar.name, rank), lambda: self.b.constant(scalar.values.reshape([1] * rank)))
        if not self._is_shared(scalar):
            return self.b.reshape(scalar, [1] * rank)
        return self.once(("ranked", scalar.name, rank), lambda: self.b.reshape(scalar, [1] * rank))

    def _scalar(self, value: float | gs.Tensor) -> gs.Tensor:
        dtype = self.param.dtype
        known = _numpy_dtype(dtype)
        if isinstance(value, gs.Tensor):
            if not self._is_shared(value):  # the parameter's own (LAMB's trust ratio)
                return self.b.cast(value, dtype)
            return self.once(("cast", value.name, str(known or dtype)), lambda: self.b.cast(value, dtype))
        key = ("constant", float(value), str(known or dtype))
        if known is not None:
            return self.once(key, lambda: self.b.constant(np.array(value, np.float64).astype(known)))
        return self.once(key, lambda: self.b.cast(self.b.constant(np.array(value, np.float64)), dtype))

    def once(self, key, make: Callable[[], Any]) -> Any:
        """``make()``'s tensor, made the first time ``key`` is asked for (by any parameter), in
        the step's scope rather than the parameter's."""
        if key not in self.shared:
            with self.b.scope("step"):
                self.shared[key] = make()
        return self.shared[key]

    def _is_shared(self, value: gs.Tensor) -> bool:
        """Whether ``value`` is the same for every parameter: a counter, or made by ``once``."""
        made = (t for v in self.shared.values() for t in (v if isinstance(v, tuple) else (v,)))
        return value is self.lr or value is self.t or any(value is t for t in made)


def _ones_rank(param: gs.Tensor) -> int | None:
    """The rank a scalar takes to broadcast over ``param`` fast (``_Step.scalar``): its own where
    its static shape has 2 dims or more, the last 1; else None (a 0-d scalar is as fast)."""
    shape = param.shape
    return len(shape) if shape is not None and len(shape) >= 2 and shape[-1] == 1 else None


@dataclass
class _Counters:
    """The step's scalars: the learning rate and step number in float64, and whether this is the first step."""

    lr: gs.Tensor
    t: gs.Tensor
    first: gs.Tensor


@dataclass
class _Program:
    """The training step being written: the graph, its builder, the outputs it will have,
    and the carried tensors (``graphforge.state`` entries) added so far."""

    model: Model
    b: Builder
    outputs: list[gs.Tensor]
    carried: list[CarriedSpec] = field(default_factory=list)
    #: parameter -> its gradient at the boundary (step 2)
    boundary: dict[str, gs.Tensor] = field(default_factory=dict)
    #: the step's scalars, shared by every parameter's update (``_Step.shared``)
    scalars: dict = field(default_factory=dict)
    #: the names the model's tensors had, and those added since: a new input's name is checked
    #: here, not against graph.tensors(), which walks the whole graph (once per state was
    #: quadratic: 4 of GPT-2 small's 6.5 s compile)
    names: set[str] = field(default_factory=set)

    def __post_init__(self):
        self.names.update(self.graph.tensors())

    @property
    def graph(self) -> gs.Graph:
        return self.model.graph

    def carried_input(self, name: str, like: gs.Tensor, role: str, owner: str | None) -> gs.Variable:
        """A new graph input for a zero-initialized carried tensor shaped like ``like``."""
        if name in self.names:
            raise PassError(f"cannot add input {name!r}: the model already has a tensor with that name")
        self.names.add(name)
        var = gs.Variable(name, dtype=like.dtype, shape=list(like.shape))
        self.graph.inputs.append(var)
        self.carried.append(_spec(name, like, role, "zeros", owner))
        return var

    def carry_initializer(self, tensor: gs.Tensor, role: str) -> None:
        """Carry an initializer (a parameter, a buffer): it becomes an overridable input too."""
        if tensor.name not in self.model.initializer_inputs:
            self.model.initializer_inputs.append(tensor.name)
        self.carried.append(_spec(tensor.name, tensor, role, "initializer", None))

    def output(self, tensor: gs.Tensor, name: str, like: gs.Tensor) -> gs.Tensor:
        """``name`` = Identity(``tensor``), a graph output typed like ``like``."""
        out = self.b.op("Identity", tensor)
        out.name, out.dtype, out.shape = name, like.dtype, like.shape
        self.names.add(name)
        self.outputs.append(out)
        return out


@dataclass(frozen=True)
class _Optimizer(Pass):
    """Shared machinery; subclasses define the state names and the update.

    The step is written in the order it runs, one function each: the counters, then per
    parameter 1. accumulate (``accumulate=true``), 2. the gradient boundary (recorded in
    ``graphforge.gradient_boundary``: where a pass that reduces or rescales gradients goes),
    3. the global norm and clipping, 4. the update; then the buffers the forward updates."""

    requires = (Fact.GRADIENTS,)
    refuses = (Fact.OPTIMIZER,)
    ensures = (Fact.OPTIMIZER, Fact.GRADIENT_BOUNDARY)

    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    accumulate: bool = False
    #: how a training-mode BatchNormalization's running variance takes the batch's variance:
    #: "unbiased" (divided by N - 1, as torch's BatchNorm) or "population" (divided by N, as
    #: the ONNX spec and onnxruntime's kernel)
    batchnorm_variance: Literal["unbiased", "population"] = "unbiased"

    state_names = ()  # per-parameter state tensors, named "<param>.<state>"

    def __post_init__(self):
        check_number(self, "lr", at_least=0)
        check_number(self, "weight_decay", at_least=0)
        check_number(self, "clip_grad_norm", above=0)  # none: no clipping

    def update(self, s: _Step, states: dict[str, gs.Tensor]) -> tuple[gs.Tensor, dict[str, gs.Tensor]]:
        raise NotImplementedError

    def hyperparameters(self) -> dict:
        return {p.name: getattr(self, p.name) for p in self.parameters()}

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        program = _Program(model, Builder(graph, prefix=roles.OPTIM_PREFIX), list(graph.outputs))
        tensors = graph.tensors()
        program_roles = ProgramRoles.of_model(model)
        grads_by_param = program_roles.gradients
        params = [tensors[p] for p in program_roles.parameters if p in grads_by_param]
        grads = {p.name: tensors[grads_by_param[p.name]] for p in params}
        counters = _counters(program)
        if self.accumulate:
            grads = _accumulate(program, params, grads)
        grads = _boundary(program, grads)
        grads = _norm_and_clip(program, grads, self.clip_grad_norm)
        for p in params:
            self._update_parameter(program, p, grads[p.name], counters)
        _carry_buffers(program, self.batchnorm_variance)
        self._record(program)
        return PassResult(model, True)

    def _update_parameter(self, program: _Program, p: gs.Tensor, grad: gs.Tensor, counters: _Counters) -> None:
        """Step 4 for one parameter: its optimizer states in, its update and theirs out."""
        with program.b.scope(p.name):
            states = {s: program.carried_input(f"{p.name}.{s}", p, "optimizer", p.name) for s in self.state_names}
            step = _Step(program.b, p, grad, counters.lr, counters.t, counters.first, program.scalars)
            new_p, new_states = self.update(step, states)
            program.output(new_p, roles.next_name(p.name), p)
            for s, value in new_states.items():
                program.output(value, roles.next_name(f"{p.name}.{s}"), p)
        program.carry_initializer(p, "parameter")

    def _record(self, program: _Program) -> None:
        model = program.model
        program.graph.outputs = program.outputs
        order = {"parameter": 0, "accumulator": 1, "optimizer": 2, "buffer": 3}
        carried = sorted(program.carried, key=lambda spec: order[spec.role])  # stable: parameters first, in order
        model.metadata[roles.LR] = "lr"
        model.metadata[roles.STEP] = "step"
        roles.set_json(model, roles.OPTIMIZER, {"kind": self.name, "hyperparameters": self.hyperparameters()})
        roles.set_json(model, roles.STATE, [spec.to_json() for spec in carried])
        boundary = {p: t.name for p, t in program.boundary.items()}
        roles.set_json(model, roles.GRADIENT_BOUNDARY, boundary)
        if self.accumulate:
            model.metadata[roles.RESET_GRAD] = "lazy_reset_grad"
        model.metadata[roles.DEFAULT_LR] = repr(float(self.lr))


def _spec(name: str, like: gs.Tensor, role: str, init: str, owner: str | None) -> CarriedSpec:
    try:
        dtype = np.dtype(like.dtype).name
    except TypeError:  # onnx-graphsurgeon keeps the types NumPy lacks as ONNX enums
        kind = onnx.helper.tensor_dtype_to_string(int(like.dtype)).removeprefix("TensorProto.").lower()
        raise PassError(
            f"parameter {like.name!r} is {kind}: the optimizers update float32, float16 and float64 parameters "
            "(to compute in bfloat16, keep float32 parameters and add mixed_precision(dtype=bfloat16))"
        ) from None
    return CarriedSpec(name, roles.next_name(name), role, dtype, tuple(like.shape), init, owner)


def _counters(program: _Program) -> _Counters:
    """The inputs ``lr`` and ``step`` (steps done before this one), and ``step_next``."""
    b = program.b
    with b.scope("step"):
        lr = gs.Variable("lr", dtype=np.float32, shape=[])
        step = gs.Variable("step", dtype=np.int64, shape=[])
        program.graph.inputs += [lr, step]
        step_next = b.add(step, b.constant(np.array(1, np.int64)))
        program.output(step_next, roles.next_name("step"), step)
        t = b.cast(step_next, np.float64)
        first = b.op("Equal", step, b.constant(np.array(0, np.int64)))
        return _Counters(b.cast(lr, np.float64), t, first)


def _accumulate(program: _Program, params: list[gs.Tensor], grads: dict[str, gs.Tensor]) -> dict[str, gs.Tensor]:
    """Step 1: each gradient added to its accumulator, or replacing it when the input
    ``lazy_reset_grad`` is set; the sum is both the accumulator's next value and the gradient."""
    b = program.b
    reset = gs.Variable("lazy_reset_grad", dtype=np.bool_, shape=[])
    program.graph.inputs.append(reset)
    summed = {}
    with b.scope("grads"):
        for p in params:
            acc = program.carried_input(f"{p.name}_grad_acc", p, "accumulator", p.name)
            summed[p.name] = b.op("Where", reset, grads[p.name], b.add(acc, grads[p.name]))
            program.output(summed[p.name], roles.next_name(acc.name), p)
    return summed


def _boundary(program: _Program, grads: dict[str, gs.Tensor]) -> dict[str, gs.Tensor]:
    """Step 2: one Identity per gradient, the tensor everything after reads (onnxruntime
    removes the Identity). A pass that reduces or rescales gradients replaces the readers'
    input; a runtime cuts the program here."""
    b = program.b
    for name, g in grads.items():
        with b.scope(f"boundary/{name}"):
            boundary = b.op("Identity", g)
        boundary.name = f"{roles.OPTIM_PREFIX}boundary/{name}"  # a stable name the roles point at
        boundary.dtype, boundary.shape = g.dtype, g.shape
        program.boundary[name] = boundary
    return dict(program.boundary)


def _norm_and_clip(program: _Program, grads: dict[str, gs.Tensor], max_norm: float | None) -> dict[str, gs.Tensor]:
    """Step 3: the output ``grad_norm`` (global L2 norm, in float32) and, with ``max_norm``,
    every gradient scaled as torch.nn.utils.clip_grad_norm_ does: by min(1, max_norm / (norm + 1e-6))."""
    b = program.b
    split = _tensor_parallel_split(program.model)
    with b.scope("grads"):
        squares = {n: b.axes_op("ReduceSumSquare", _float32(b, g), None, keepdims=0) for n, g in grads.items()}
        total = b.sum([v for n, v in squares.items() if n not in split] or [b.constant(np.array(0, np.float32))])
        sliced = [v for n, v in squares.items() if n in split]
        if sliced:  # a tensor-parallel member's slices: their squares summed across its group, once
            summed = gs.Variable(b.fresh_name("tensor_parallel_squares"), dtype=np.float32, shape=[])
            b.graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_REDUCE_OP, b.sum(sliced), summed, -1, "group"))
            total = b.add(total, summed)
        norm = b.op("Sqrt", total)
        program.output(norm, roles.GRAD_NORM, gs.Variable(roles.GRAD_NORM, dtype=np.float32, shape=[]))
        if max_norm is None:
            return grads
        ratio = b.div(b.constant(np.array(max_norm, np.float32)), b.add(norm, b.constant(np.array(1e-6, np.float32))))
        coef = b.op("Min", ratio, b.constant(np.array(1.0, np.float32)))
        return {n: b.mul(g, b.cast_like(coef, g)) for n, g in grads.items()}


def _tensor_parallel_split(model: Model) -> set[str]:
    """The parameters a tensor_parallel pass split (each member holds a slice of them), or none."""
    role = ProgramRoles.of_model(model).tensor_parallel
    return set(role.split) if role is not None else set()


def _carry_buffers(program: _Program, batchnorm_variance: str) -> None:
    """Non-trainable state the forward pass updates: BatchNormalization's running mean
    and variance in training mode. The initializers become carried inputs; the node's running
    statistics outputs become their ``_next`` outputs (the variance made unbiased first
    unless ``batchnorm_variance="population"``)."""
    b, done = program.b, set()
    for node in list(program.graph.nodes):
        if node.op != "BatchNormalization" or len(node.outputs) < 3 or node.outputs[1].is_empty():
            continue
        for i, (stat, running) in enumerate(zip(node.inputs[3:5], node.outputs[1:3], strict=True)):
            if not isinstance(stat, gs.Constant) or stat.name in done:
                continue
            done.add(stat.name)
            if i == 1 and batchnorm_variance == "unbiased":
                with b.scope(stat.name):
                    running = torch_running_variance(b, node, stat, running)
            program.output(running, roles.next_name(stat.name), stat)
            program.carry_initializer(stat, "buffer")


def torch_running_variance(b: Builder, node: gs.Node, previous: gs.Tensor, running: gs.Tensor) -> gs.Tensor:
    """torch's running variance from the ONNX one. ONNX: running = m * previous + (1 - m) * var
    with var divided by N (the elements per channel); torch divides by N - 1, which adds
    (1 - m) * var / (N - 1) = (running - m * previous) / (N - 1). N = 1 adds nothing (var is 0)."""
    x, momentum = node.inputs[0], float(node.attrs.get("momentum", 0.9))
    dtype = previous.dtype
    per_channel = b.div(b.op("Size", x), b.op("Gather", b.op("Shape", x), b.constant(np.array(1, np.int64))))
    one = b.constant(np.array(1, dtype))
    n_minus_1 = b.op("Max", b.sub(b.cast(per_channel, dtype), one), one)
    batch_share = b.sub(running, b.mul(previous, b.constant(np.array(momentum, dtype))))
    return b.add(running, b.div(batch_share, n_minus_1))


def _decayed(s: _Step, grad: gs.Tensor, weight_decay: float) -> gs.Tensor:
    """L2 regularisation as torch's SGD/Adam apply it: grad + weight_decay * param."""
    if not weight_decay:
        return grad
    return s.b.add(grad, s.b.mul(s.param, s.scalar(weight_decay)))


@dataclass(frozen=True)
class SGD(_Optimizer):
    """Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay
    (torch.optim.SGD). State: ``<param>.momentum_buffer`` when momentum is used."""

    name = "sgd"
    lr: float = 1e-2
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "momentum", at_least=0)
        check_number(self, "dampening", at_least=0, at_most=1)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")

    @property
    def state_names(self):
        return ("momentum_buffer",) if self.momentum else ()

    def update(self, s, states):
        b = s.b
        d_p = _decayed(s, s.grad, self.weight_decay)
        new_states = {}
        if self.momentum:
            # d_p * 1 is d_p: without dampening the sum reads it as it is, one parameter-sized
            # temporary fewer
            damped = b.mul(d_p, s.scalar(1 - self.dampening)) if self.dampening else d_p
            buf = b.add(b.mul(states["momentum_buffer"], s.scalar(self.momentum)), damped)
            buf = b.op("Where", s.first, d_p, buf)  # torch starts the buffer at the first gradient
            new_states["momentum_buffer"] = buf
            d_p = b.add(d_p, b.mul(buf, s.scalar(self.momentum))) if self.nesterov else buf
        return b.sub(s.param, b.mul(d_p, s.scalar(s.lr))), new_states


@dataclass(frozen=True)
class Adam(_Optimizer):
    """Adam (torch.optim.Adam; weight_decay is L2 added to the gradient).
    State: ``<param>.exp_avg``, ``<param>.exp_avg_sq``."""

    name = "adam"
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    state_names = ("exp_avg", "exp_avg_sq")

    def __post_init__(self):
        super().__post_init__()
        _check_moments(self)

    def update(self, s, states):
        grad = _decayed(s, s.grad, self.weight_decay)
        return _adam_update(self, s, s.param, grad, states)


@dataclass(frozen=True)
class AdamW(_Optimizer):
    """AdamW with decoupled weight decay. State: ``<param>.exp_avg``, ``<param>.exp_avg_sq``.

    1. ``mode=torch`` (the default): torch.optim.AdamW. The weight decays first, then each
       moment is bias-corrected: ``p -= lr / (1 - b1^t) · m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
    2. ``mode=hf``: HuggingFace's AdamW, which onnxruntime-training's on-device AdamW
       computes (its AdamWOptimizer, adam_mode 1): the correction is folded into the rate,
       eps is added to the uncorrected ``sqrt(v)``, and the weight decays after the update,
       from the updated weight: ``p -= lr · sqrt(1 - b2^t) / (1 - b1^t) · m / (sqrt(v) + eps)``,
       then ``p -= lr · weight_decay · p``. What ``graphforge.artifacts``' OptimType.AdamW
       writes, so a script written for onnxruntime-training computes its updates.
    """

    name = "adamw"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    mode: Literal["torch", "hf"] = "torch"
    state_names = ("exp_avg", "exp_avg_sq")

    def __post_init__(self):
        super().__post_init__()
        _check_moments(self)

    def update(self, s, states):
        if self.mode == "hf":
            return _hf_adamw_update(self, s, states)
        b = s.b
        if not self.weight_decay:
            return _adam_update(self, s, s.param, s.grad, states)
        decay = s.once(
            ("decay", self.weight_decay),
            lambda: b.sub(b.constant(np.array(1.0)), b.mul(s.lr, b.constant(np.array(self.weight_decay)))),
        )
        param = b.mul(s.param, s.scalar(decay))
        return _adam_update(self, s, param, s.grad, states)


def _hf_adamw_update(opt: AdamW, s: _Step, states):
    """Case 2 of AdamW: moments as ``b · m + (1 - b) · g`` (not torch's lerp), the corrected
    rate once for every parameter, the decay last."""
    b = s.b
    m = b.add(b.mul(states["exp_avg"], s.scalar(opt.beta1)), b.mul(s.grad, s.scalar(1 - opt.beta1)))
    v = b.add(b.mul(states["exp_avg_sq"], s.scalar(opt.beta2)), b.mul(b.mul(s.grad, s.grad), s.scalar(1 - opt.beta2)))
    bc1, bc2 = _bias_corrections(opt, s)
    rate = s.once(("hf_rate", bc1.name), lambda: b.div(b.mul(s.lr, b.op("Sqrt", bc2)), bc1))
    updated = b.sub(s.param, b.div(b.mul(m, s.scalar(rate)), b.add(b.op("Sqrt", v), s.scalar(opt.eps))))
    if opt.weight_decay:
        decay = s.once(("hf_decay", opt.weight_decay), lambda: b.mul(s.lr, b.constant(np.array(opt.weight_decay))))
        updated = b.sub(updated, b.mul(updated, s.scalar(decay)))
    return updated, {"exp_avg": m, "exp_avg_sq": v}


def _check_moments(opt) -> None:
    """The ranges torch.optim.Adam checks: 0 ≤ beta < 1, eps > 0 (eps = 0 can divide by zero)."""
    check_number(opt, "beta1", at_least=0, below=1)
    check_number(opt, "beta2", at_least=0, below=1)
    check_number(opt, "eps", above=0)


def _first_moment(opt, s: _Step, grad, states):
    b = s.b
    m = states["exp_avg"]
    return b.add(m, b.mul(b.sub(grad, m), s.scalar(1 - opt.beta1)))  # torch's lerp_(grad, 1 - beta1)


def _second_moment(opt, s: _Step, grad, states):
    b = s.b
    v = states["exp_avg_sq"]
    return b.add(b.mul(v, s.scalar(opt.beta2)), b.mul(b.mul(grad, grad), s.scalar(1 - opt.beta2)))


def _bias_corrections(opt, s: _Step):
    """1 - beta1^t and 1 - beta2^t, in float64, once for every parameter."""
    b = s.b

    def make():
        one = b.constant(np.array(1.0))
        return (
            b.sub(one, b.op("Pow", b.constant(np.array(opt.beta1)), s.t)),
            b.sub(one, b.op("Pow", b.constant(np.array(opt.beta2)), s.t)),
        )

    return s.once(("bias_corrections", opt.beta1, opt.beta2), make)


def _adam_update(opt, s: _Step, param, grad, states):
    b = s.b
    bc1, bc2 = _bias_corrections(opt, s)
    step_size = s.once(("step_size", bc1.name), lambda: b.div(s.lr, bc1))
    sqrt_bc2 = s.once(("sqrt", bc2.name), lambda: b.op("Sqrt", bc2))
    v = _second_moment(opt, s, grad, states)
    denom = b.add(b.div(b.op("Sqrt", v), s.scalar(sqrt_bc2)), s.scalar(opt.eps))
    # written after the denominator so that onnxruntime, which runs the later-written input of a
    # node first (analysis.memory.execution_order), makes the first moment before the
    # denominator: then two parameter-sized temporaries are live at most, not three
    m = _first_moment(opt, s, grad, states)
    new_param = b.sub(param, b.mul(b.div(m, denom), s.scalar(step_size)))
    return new_param, {"exp_avg": m, "exp_avg_sq": v}


@dataclass(frozen=True)
class Lamb(_Optimizer):
    """LAMB (You et al., 2019): Adam's bias-corrected direction plus decoupled weight decay,
    scaled per parameter by the trust ratio ||param|| / ||direction|| (1 where either is 0).
    State: ``<param>.exp_avg``, ``<param>.exp_avg_sq``."""

    name = "lamb"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6

    state_names = ("exp_avg", "exp_avg_sq")

    def __post_init__(self):
        super().__post_init__()
        _check_moments(self)

    def update(self, s, states):
        b = s.b
        # written first so that it runs last, just before the sum that reads it (see _adam_update)
        decay = b.mul(s.param, s.scalar(self.weight_decay)) if self.weight_decay else None
        bc1, bc2 = _bias_corrections(self, s)
        v = _second_moment(self, s, s.grad, states)
        denom = b.add(b.op("Sqrt", b.div(v, s.scalar(bc2))), s.scalar(self.eps))
        m = _first_moment(self, s, s.grad, states)  # after the denominator: see _adam_update
        direction = b.div(b.div(m, s.scalar(bc1)), denom)
        if decay is not None:
            direction = b.add(direction, decay)
        w_norm = _norm(b, s.param)
        d_norm = _norm(b, direction)
        zero = b.constant(np.array(0.0, np.float32))
        usable = b.op("And", b.op("Greater", w_norm, zero), b.op("Greater", d_norm, zero))
        trust = b.op("Where", usable, b.div(w_norm, d_norm), b.constant(np.array(1.0, np.float32)))
        scale = b.mul(b.cast(trust, np.float64), s.lr)
        return b.sub(s.param, b.mul(direction, s.scalar(scale))), {"exp_avg": m, "exp_avg_sq": v}


def _norm(b: Builder, t: gs.Tensor) -> gs.Tensor:
    return b.op("Sqrt", b.axes_op("ReduceSumSquare", _float32(b, t), None, keepdims=0))


def _float32(b: Builder, t: gs.Tensor) -> gs.Tensor:
    """``t`` in float32: a Cast only where it has another type (or one not known)."""
    return t if _numpy_dtype(t.dtype) == np.float32 else b.cast(t, np.float32)


def _numpy_dtype(dtype) -> np.dtype | None:
    """``dtype`` as NumPy's, or None where it is unknown or one NumPy lacks (onnx-graphsurgeon
    keeps bfloat16 as ONNX's type number)."""
    return np.dtype(dtype) if isinstance(dtype, np.dtype | type) else None


#: the optimizer passes by the kind a program records (``graphforge.optimizer``)
OPTIMIZERS = {cls.name: cls for cls in (SGD, Adam, AdamW, Lamb)}


def state_names(kind: str, hyperparameters: Mapping[str, Any]) -> tuple[str, ...]:
    """The states the optimizer ``kind`` keeps per parameter (``<parameter>.<state>``) with the
    hyperparameters a program recorded: what its pass carries, for the runtime's update
    kernels to keep the same."""
    cls = OPTIMIZERS[kind]
    known = {p.name for p in cls.parameters()}
    return tuple(cls(**{k: v for k, v in hyperparameters.items() if k in known}).state_names)
