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

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.builder import Builder
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.pipeline import Pass, PassResult, check_number

NEXT = "_next"


@dataclass
class _Step:
    """What an update rule gets for one parameter."""

    b: Builder
    param: gs.Tensor
    grad: gs.Tensor
    lr: gs.Tensor  # float64 scalar
    t: gs.Tensor  # float64 scalar: the step number, 1 on the first step
    first: gs.Tensor  # bool scalar: this is the first step

    def scalar(self, value: float | gs.Tensor) -> gs.Tensor:
        """A float64 scalar (a Python number or an expression) cast to the parameter's type."""
        b = self.b
        t = b.constant(np.array(value, np.float64)) if not isinstance(value, gs.Tensor) else value
        return b.cast(t, self.param.dtype)


@dataclass(frozen=True)
class _Optimizer(Pass):
    """Shared machinery; subclasses define the state names and the update."""

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
        grads_by_param = roles.get_json(model, roles.GRADIENTS, None)
        if grads_by_param is None:
            raise PassError(f"{self.name} needs the gradients: put `autodiff` before it in the pipeline")
        if roles.OPTIMIZER in model.metadata:
            raise PassError("the model already has an optimizer step; apply one optimizer pass only")
        tensors = graph.tensors()
        params = [tensors[p] for p in roles.get_json(model, roles.PARAMETERS, []) if p in grads_by_param]
        b = Builder(graph, prefix="optim::")
        state_specs: list[dict] = []

        def add_input(name: str, dtype, shape, init: str, role: str, like: str | None = None) -> gs.Variable:
            if name in tensors:
                raise PassError(f"cannot add input {name!r}: the model already has a tensor with that name")
            var = gs.Variable(name, dtype=dtype, shape=list(shape))
            graph.inputs.append(var)
            state_specs.append({"input": name, "output": name + NEXT, "init": init, "role": role,
                                "dtype": np.dtype(dtype).name, "shape": list(shape), "like": like})  # fmt: skip
            return var

        outputs = list(graph.outputs)

        def add_output(tensor: gs.Tensor, name: str, like: gs.Tensor) -> None:
            out = b.op("Identity", tensor)
            out.name, out.dtype, out.shape = name, like.dtype, like.shape
            outputs.append(out)

        with b.scope("step"):
            lr = gs.Variable("lr", dtype=np.float32, shape=[])
            step = gs.Variable("step", dtype=np.int64, shape=[])
            graph.inputs += [lr, step]
            step_next = b.add(step, b.constant(np.array(1, np.int64)))
            add_output(step_next, "step" + NEXT, step)
            t = b.cast(step_next, np.float64)
            lr64 = b.cast(lr, np.float64)
            first = b.op("Equal", step, b.constant(np.array(0, np.int64)))

        grads = {}
        with b.scope("grads"):
            reset = None
            for p in params:
                g = tensors[grads_by_param[p.name]]
                if self.accumulate:
                    if reset is None:
                        reset = gs.Variable("lazy_reset_grad", dtype=np.bool_, shape=[])
                        graph.inputs.append(reset)
                    acc = add_input(f"{p.name}_grad_acc", p.dtype, p.shape, "zeros", "accumulator", p.name)
                    g = b.op("Where", reset, g, b.add(acc, g))
                    add_output(g, acc.name + NEXT, p)
                grads[p.name] = g
            norm = b.op("Sqrt", b.sum([b.axes_op("ReduceSumSquare", b.cast(g, np.float32), None, keepdims=0)
                                       for g in grads.values()]))  # fmt: skip
            add_output(norm, "grad_norm", gs.Variable("grad_norm", dtype=np.float32, shape=[]))
            if self.clip_grad_norm is not None:
                # torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6))
                coef = b.op("Min", b.div(b.constant(np.array(self.clip_grad_norm, np.float32)),
                                         b.add(norm, b.constant(np.array(1e-6, np.float32)))),
                            b.constant(np.array(1.0, np.float32)))  # fmt: skip
                grads = {n: b.mul(g, b.cast_like(coef, g)) for n, g in grads.items()}

        for p in params:
            with b.scope(p.name):
                states = {
                    s: add_input(f"{p.name}.{s}", p.dtype, p.shape, "zeros", "optimizer", p.name)
                    for s in self.state_names
                }
                new_p, new_states = self.update(_Step(b, p, grads[p.name], lr64, t, first), states)
                add_output(new_p, p.name + NEXT, p)
                for s, value in new_states.items():
                    add_output(value, f"{p.name}.{s}{NEXT}", p)
            if p.name not in model.initializer_inputs:
                model.initializer_inputs.append(p.name)
            state_specs.insert(0, {"input": p.name, "output": p.name + NEXT, "init": "initializer",
                                   "role": "parameter", "dtype": np.dtype(p.dtype).name, "shape": list(p.shape),
                                   "like": None})  # fmt: skip

        state_specs += self._buffers(graph, model, b, add_output)
        graph.outputs = outputs
        model.metadata[roles.LR] = "lr"
        model.metadata[roles.STEP] = "step"
        roles.set_json(model, roles.OPTIMIZER, {"kind": self.name, "hyperparameters": self.hyperparameters()})
        roles.set_json(model, roles.STATE, state_specs)
        if self.accumulate:
            model.metadata[roles.RESET_GRAD] = "lazy_reset_grad"
        model.metadata[roles.DEFAULT_LR] = repr(float(self.lr))
        return PassResult(model, True)

    def _buffers(self, graph: gs.Graph, model: Model, b: Builder, add_output) -> list[dict]:
        """Non-trainable state the forward pass updates: BatchNormalization's running mean
        and variance in training mode. The initializers become inputs; the node's running
        statistics outputs become their ``_next`` outputs (the variance made unbiased first
        unless ``batchnorm_variance="population"``)."""
        specs = []
        for node in list(graph.nodes):
            if node.op != "BatchNormalization" or len(node.outputs) < 3 or node.outputs[1].is_empty():
                continue
            for i, (stat, running) in enumerate(zip(node.inputs[3:5], node.outputs[1:3], strict=True)):
                if not isinstance(stat, gs.Constant) or any(spec["input"] == stat.name for spec in specs):
                    continue
                if i == 1 and self.batchnorm_variance == "unbiased":
                    with b.scope(stat.name):
                        running = _unbiased_running_var(b, node, stat, running)
                add_output(running, stat.name + NEXT, stat)
                if stat.name not in model.initializer_inputs:
                    model.initializer_inputs.append(stat.name)
                specs.append({"input": stat.name, "output": stat.name + NEXT, "init": "initializer", "role": "buffer",
                              "dtype": np.dtype(stat.dtype).name, "shape": list(stat.shape), "like": None})  # fmt: skip
        return specs


def _unbiased_running_var(b: Builder, node: gs.Node, previous: gs.Tensor, running: gs.Tensor) -> gs.Tensor:
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
            buf = b.add(
                b.mul(states["momentum_buffer"], s.scalar(self.momentum)), b.mul(d_p, s.scalar(1 - self.dampening))
            )
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
    """AdamW with decoupled weight decay (torch.optim.AdamW).
    State: ``<param>.exp_avg``, ``<param>.exp_avg_sq``."""

    name = "adamw"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    state_names = ("exp_avg", "exp_avg_sq")

    def __post_init__(self):
        super().__post_init__()
        _check_moments(self)

    def update(self, s, states):
        b = s.b
        decay = b.sub(b.constant(np.array(1.0)), b.mul(s.lr, b.constant(np.array(self.weight_decay))))
        param = b.mul(s.param, s.scalar(decay)) if self.weight_decay else s.param
        return _adam_update(self, s, param, s.grad, states)


def _check_moments(opt) -> None:
    """The ranges torch.optim.Adam checks: 0 ≤ beta < 1, eps > 0 (eps = 0 can divide by zero)."""
    check_number(opt, "beta1", at_least=0, below=1)
    check_number(opt, "beta2", at_least=0, below=1)
    check_number(opt, "eps", above=0)


def _moments(opt, s: _Step, grad, states):
    b = s.b
    m, v = states["exp_avg"], states["exp_avg_sq"]
    m = b.add(m, b.mul(b.sub(grad, m), s.scalar(1 - opt.beta1)))  # torch's lerp_(grad, 1 - beta1)
    v = b.add(b.mul(v, s.scalar(opt.beta2)), b.mul(b.mul(grad, grad), s.scalar(1 - opt.beta2)))
    return m, v


def _bias_corrections(opt, s: _Step):
    b = s.b
    one = b.constant(np.array(1.0))
    bc1 = b.sub(one, b.op("Pow", b.constant(np.array(opt.beta1)), s.t))
    bc2 = b.sub(one, b.op("Pow", b.constant(np.array(opt.beta2)), s.t))
    return bc1, bc2


def _adam_update(opt, s: _Step, param, grad, states):
    b = s.b
    m, v = _moments(opt, s, grad, states)
    bc1, bc2 = _bias_corrections(opt, s)
    step_size = b.div(s.lr, bc1)
    denom = b.add(b.div(b.op("Sqrt", v), s.scalar(b.op("Sqrt", bc2))), s.scalar(opt.eps))
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
        m, v = _moments(self, s, s.grad, states)
        bc1, bc2 = _bias_corrections(self, s)
        m_hat = b.div(m, s.scalar(bc1))
        v_hat = b.div(v, s.scalar(bc2))
        direction = b.div(m_hat, b.add(b.op("Sqrt", v_hat), s.scalar(self.eps)))
        if self.weight_decay:
            direction = b.add(direction, b.mul(s.param, s.scalar(self.weight_decay)))
        w_norm = _norm(b, s.param)
        d_norm = _norm(b, direction)
        zero = b.constant(np.array(0.0, np.float32))
        usable = b.op("And", b.op("Greater", w_norm, zero), b.op("Greater", d_norm, zero))
        trust = b.op("Where", usable, b.div(w_norm, d_norm), b.constant(np.array(1.0, np.float32)))
        scale = b.mul(b.cast(trust, np.float64), s.lr)
        return b.sub(s.param, b.mul(direction, s.scalar(scale))), {"exp_avg": m, "exp_avg_sq": v}


def _norm(b: Builder, t: gs.Tensor) -> gs.Tensor:
    return b.op("Sqrt", b.axes_op("ReduceSumSquare", b.cast(t, np.float32), None, keepdims=0))
