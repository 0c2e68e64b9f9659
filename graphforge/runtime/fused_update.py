"""A Module's update run by torch's fused multi-tensor kernels, on the runner's own buffers.

The program's ONNX update is one small kernel per operation per parameter (about eleven for
AdamW): several times slower on the CPU than torch's fused kernel over the same tensors
(docs/benchmarks.md, "Optimizer update"), and on a GPU thousands of launches against a few.
ORTModule hands its optimizer to torch for the same reason. Here the kernels work on the very
memory onnxruntime binds (DLPack views of the runner's OrtValues: parameters, optimizer states,
and the gradient buffers segment 0 writes), so nothing is copied, and the ONNX update stays the
definition: what a program's update does is read from its roles (the optimizer and its
hyperparameters), the kernel computes the same arithmetic, and the tests hold the two equal
over 20 steps. A program whose update does more than the kernels know (a data-parallel
reduction, an optimizer without a kernel) keeps its ONNX update, and ``refusal`` says why.

1. SGD (momentum, Nesterov, L2 weight decay): ``torch._fused_sgd_``; with dampening, foreach
   kernels in the program's own order of operations.
2. Adam (L2 weight decay) and AdamW (decoupled): ``torch._fused_adam_``, ``torch._fused_adamw_``.
3. LAMB: torch's foreach kernels (no fused LAMB exists), one trust ratio per tensor.
4. Global-norm clipping multiplies the gradients by the program's own coefficient (from the
   norm segment 0 computed) first; accumulation needs nothing (segment 0 sends the sums).
5. Loss scaling (mixed_precision): segment 0 sends the gradients times 1/scale (it computes
   them for the norm and the finite check); a step whose gradients are not finite (segment 0
   says so: ``update_skipped``) updates nothing; the optimizer's step count is the step less
   the skipped updates; and the scale, its growth tracker and the skipped count move as the
   program moves them (torch.amp.GradScaler's rule), in torch ops on their own buffers.

On the device, the fused kernels read the learning rate, the step count and the clipping
factor from device tensors, written before each update. So on CUDA the kernels of an update
(one launch per dtype and kernel) are captured once as a CUDA graph (``torch.cuda.CUDAGraph``,
after WARMUP eager updates) and replayed from then on, for as long as the tensors they read
stay at the same addresses (the runner's buffers do; gradients do where the Module binds
buffers of its own for them); LAMB and damped SGD, whose kernels take Python numbers, run
eagerly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnx
import onnxruntime as ort

from graphforge import roles as role_names
from graphforge.errors import GraphforgeError
from graphforge.passes.optimizers import state_names
from graphforge.program import LossScaling, ProgramRoles
from graphforge.runtime.dlpack import tensor_of, torch_device
from graphforge.runtime.runner import Runner

#: the optimizer kinds (passes/optimizers.py names) and the hyperparameters each reads
KNOWN = {
    "sgd": {"momentum", "dampening", "nesterov"},
    "adam": {"beta1", "beta2", "eps"},
    "adamw": {"beta1", "beta2", "eps", "mode"},
    "lamb": {"beta1", "beta2", "eps"},
}
#: what every optimizer pass records besides its own (passes/optimizers.py, _Optimizer)
COMMON = {"lr", "weight_decay", "clip_grad_norm", "accumulate", "batchnorm_variance"}
#: the fused kernel of each optimizer (LAMB has none: foreach kernels)
KERNELS = {"sgd": "_fused_sgd_", "adam": "_fused_adam_", "adamw": "_fused_adamw_"}
#: the dtypes torch's fused kernels update
FLOATS = (np.float16, np.float32, np.float64)
#: eager updates on CUDA before the kernels are captured (torch's own lazy set-up runs in them)
WARMUP = 3


class Module(Protocol):
    """What the update reads of a graphforge Module (runtime/training.py, which picks its update
    here and so sits above this module)."""

    roles: ProgramRoles
    runner: Runner
    reducer: object | None
    train_program: onnx.ModelProto

    def use_update_kernel(self, kernel: Any, why: str = ...) -> None: ...


def refusal(module: Module, *, foreach: bool = True) -> str | None:
    """Why ``module``'s update must stay its ONNX segment, or None when FusedUpdate runs it.
    ``foreach=False``: not an optimizer torch has no fused kernel for (LAMB), whose foreach
    kernels measured slower than the ONNX update on GPT-2 2×256 and faster on GPT-2 small, on the
    CPU (docs/benchmarks.md, Optimizer update): no measured winner to make the default."""
    roles = module.roles
    why = kernel_refusal(roles, foreach=foreach)
    if why is not None:
        return why
    if roles.allreduce is not None or module.reducer is not None:
        return "a data-parallel program: its update reads the reduced gradients"
    if roles.stages is not None:
        return "a pipeline program: each stage updates its own parameters"
    if not module.runner.in_place:
        return "the Module updates with two buffers (in_place=False)"
    if any(c.input not in module.runner.carried for c in roles.carried):
        return "the Module holds only its shard of the optimizer states (shard_optimizer_states=True)"
    return state_refusal(roles) or graph_refusal(module.train_program, roles)


def kernel_refusal(roles: ProgramRoles, *, foreach: bool = True) -> str | None:
    """Why torch's kernels cannot compute what ``roles``' optimizer update does (its kind,
    its settings, loss scaling, this torch build), or None."""
    kind = roles.optimizer
    if kind not in KNOWN:
        return f"no torch kernel for the {kind or 'unknown'} optimizer"
    if not foreach and kind not in KERNELS:
        return f"torch has no fused {kind} kernel; its foreach kernels run it only when asked (foreach=True)"
    unknown = sorted(set(roles.hyperparameters) - KNOWN[kind] - COMMON)
    if unknown:
        return f"the {kind} update has settings the torch kernels do not take: {', '.join(unknown)}"
    if roles.hyperparameters.get("mode", "torch") != "torch":
        return f"torch's {kind} kernel computes torch's update, not mode={roles.hyperparameters['mode']}'s"
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install graphforge[torch])"
    kernel = KERNELS.get(kind)
    if kernel is not None and not hasattr(torch, kernel):
        return f"this torch build has no torch.{kernel}"
    scaling = roles.loss_scaling
    if scaling is not None and any(p not in scaling.unscaled for p in updated_parameters(roles)):
        return "the program's loss scaling does not name its unscaled gradients (compile it again)"
    return None


def graph_refusal(program: onnx.ModelProto, roles: ProgramRoles) -> str | None:
    """Why the gradients the kernels would read are not what the program's update reads: a
    node the optimizer did not write (a pass's, at the gradient boundary) reads one of them,
    so the update may read its result instead; or None."""
    readers: dict[str, list[str]] = {}
    for node in program.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.name)
    for parameter in updated_parameters(roles):
        gradient = _gradient_read(roles, parameter)
        others = [n for n in readers.get(gradient, []) if not n.startswith(role_names.OPTIM_PREFIX)]
        if others:
            return (
                f"node {others[0]!r}, which the optimizer did not write, reads the gradient {gradient!r} "
                "before the update: the kernels would leave out what it does"
            )
    return None


def _gradient_read(roles: ProgramRoles, parameter: str) -> str:
    """The tensor the update reads as ``parameter``'s gradient: with loss scaling, the
    gradient times 1/scale (segment 0 computes it, for the gradient norm and the finite check)."""
    return roles.loss_scaling.unscaled[parameter] if roles.loss_scaling else roles.gradient_boundary[parameter]


def state_refusal(roles: ProgramRoles) -> str | None:
    """Why the parameters and optimizer states ``roles`` carries are not what the kernels
    update (a dtype they do not take, states other than the optimizer's), or None."""
    kind = roles.optimizer
    optimizer_states = {c.input for c in roles.carried if c.role == "optimizer"} - set(roles.loss_scale_states)
    expected = set()
    states = state_names(kind, roles.hyperparameters)
    for name in updated_parameters(roles):
        spec = roles.carried_spec(name)
        if spec is None or np.dtype(spec.dtype).type not in FLOATS:
            return f"parameter {name!r} is of a type the torch kernels do not update"
        expected |= {f"{name}.{state}" for state in states}
    if optimizer_states != expected:
        extra = sorted(optimizer_states ^ expected)
        return f"optimizer states the {kind} kernel does not keep as the program does: {', '.join(extra[:3])}"
    return None


class Refused(GraphforgeError):
    """FusedUpdate cannot run this Module's update; ``why`` says why (``refusal``)."""

    def __init__(self, why: str):
        super().__init__(f"cannot run this Module's update with torch's kernels: {why}")
        self.why = why


def use_fused_update(module: Module, *, foreach: bool = False) -> str:
    """Run ``module``'s update with FusedUpdate where it can; returns one line saying which
    update runs (and why not the fused one). ``foreach``: LAMB too, in torch's foreach kernels."""
    try:
        kernel = FusedUpdate(module, foreach=foreach)
    except Refused as exc:
        module.use_update_kernel(None, exc.why)
        return f"update: the program's ONNX update ({exc.why})"
    module.use_update_kernel(kernel)
    return f"update: {kernel.description}"


def updated_parameters(roles: ProgramRoles) -> list[str]:
    """The parameters the update changes, in the program's order."""
    return [p for p in roles.parameters if p in roles.gradient_boundary and roles.carried_spec(p) is not None]


@dataclass
class _Group:
    """The tensors of one dtype, in the order the kernels take them."""

    params: list[str]
    grads: list[str]
    states: dict[str, list[str]]


class FusedUpdate:
    """graphforge.runtime.training.UpdateKernel: the module docstring's cases 1-4."""

    def __init__(self, module: Module, *, foreach: bool = True):
        why = refusal(module, foreach=foreach)
        if why is not None:
            raise Refused(why)
        roles = module.roles
        self.kind = roles.optimizer
        self.hyper = dict(roles.hyperparameters)
        self._runner = module.runner
        states = state_names(self.kind, self.hyper)
        groups: dict[np.dtype, _Group] = {}
        for name in updated_parameters(roles):
            group = groups.setdefault(np.dtype(roles.carried_spec(name).dtype), _Group([], [], {s: [] for s in states}))
            group.params.append(name)
            group.grads.append(_gradient_read(roles, name))
            for state in states:
                group.states[state].append(f"{name}.{state}")
        self._groups = list(groups.values())
        self._norm = roles.grad_norm
        self._scaling = roles.loss_scaling
        self._scaling_states = list(roles.loss_scale_states)
        #: id(OrtValue) -> (the OrtValue, kept so that its id is not reused; its torch view)
        self._views: dict[int, tuple[ort.OrtValue, Any]] = {}
        self._gradients: dict[str, tuple[ort.OrtValue, Any]] = {}  # name -> (its last value, its view)
        self._steps: dict[int, Any] = {}  # group -> the step-count tensor the kernels read
        self._device = torch_device(module.runner.device)
        kernel = KERNELS.get(self.kind)
        what = f"torch.{kernel}" if kernel else "torch's foreach kernels"
        count = sum(len(g.params) for g in self._groups)
        self.description = f"{what} ({self.kind}) over {count} parameters in {len(self._groups)} dtype group(s)"
        #: whether the kernels read their scalars from device tensors (and may be captured)
        self.device_scalars = kernel is not None and not (self.kind == "sgd" and self.hyper.get("dampening"))
        self._lr = self._clip = None  # the device tensors of the learning rate and the clipping factor
        self._graph = _Captured(self._device) if self.device_scalars and self._device.type == "cuda" else None
        if self._graph is not None:
            self.description += f", captured as a CUDA graph after {WARMUP} steps"

    # ------------------------------------------------------------------ views

    def _view(self, value: ort.OrtValue):
        """A torch tensor on ``value``'s memory (cached: the runner's buffers stay put)."""
        cached = self._views.get(id(value))
        if cached is None:
            cached = self._views[id(value)] = (value, tensor_of(value))
        return cached[1]

    def _gradient(self, name: str, value: ort.OrtValue):
        """A torch view of the gradient ``name``: the same buffer every step where the Module
        binds one (fixed shapes), else a fresh value, whose view replaces the last one."""
        cached = self._gradients.get(name)
        if cached is None or cached[0] is not value:
            cached = self._gradients[name] = (value, tensor_of(value))
        return cached[1]

    def _carried(self, names: list[str]) -> list:
        return [self._view(self._runner.carried[n].value) for n in names]

    # ------------------------------------------------------------------ the update

    def apply(self, gradients: Mapping[str, ort.OrtValue], lr: float, step: int, checks: Mapping[str, float]) -> None:
        if self._scaling is not None:
            views = self._carried(self._scaling_states)
            step = loss_scale_step(self._scaling, views, bool(checks[self._scaling.update_skipped]), step)
            if step is None:
                return
        norm = checks.get(self._norm) if self._norm is not None else None
        coef = clip_coefficient(self.hyper.get("clip_grad_norm"), norm)
        calls = []
        for group in self._groups:
            counter = self._steps.get(id(group))
            if counter is None:
                counter = self._steps[id(group)] = step_counter(self._device)
            try:
                grads = [self._gradient(n, gradients[n]) for n in group.grads]
            except KeyError as exc:
                raise GraphforgeError(f"segment 0 sent no gradient {exc.args[0]!r} for the update") from None
            params, states = self._carried(group.params), {s: self._carried(n) for s, n in group.states.items()}
            calls.append((params, grads, states, counter))
        if not self.device_scalars:
            for params, grads, states, counter in calls:
                update_tensors(self.kind, self.hyper, params, grads, states, lr=lr, step=step, clip=coef,
                               counter=counter)  # fmt: skip
            return
        lr_tensor, clip_tensor = self._scalars(lr, coef)
        for *_, counter in calls:
            counter.fill_(float(step + 1))

        def kernels():
            for params, grads, states, counter in calls:
                update_tensors(self.kind, self.hyper, params, grads, states, lr=lr_tensor, step=step,
                               clip=clip_tensor, counter=counter, counted=True)  # fmt: skip

        if self._graph is None or (self.kind == "sgd" and step == 0):  # (SGD's first step starts its buffers)
            kernels()
        else:
            self._graph.run(kernels, calls)

    def _scalars(self, lr: float, coef: float | None):
        """The device tensors of the learning rate and the clipping factor, written now: the
        kernels (and their captured graph) read them there."""
        import torch

        if self._lr is None:
            self._lr = torch.zeros((), dtype=torch.float32, device=self._device)
            self._clip = torch.ones((), dtype=torch.float32, device=self._device)
        self._lr.fill_(float(np.float32(lr)))  # the program's lr input is float32
        if coef is not None:
            self._clip.fill_(coef)
        return self._lr, (self._clip if coef is not None else None)


class _Captured:
    """An update's kernels as one CUDA graph: run eagerly WARMUP times, then captured and
    replayed for as long as the tensors they read and write stay where they were captured;
    where one moves (gradients onnxruntime allocates afresh), the kernels run eagerly from then
    on, as a graph captured each step would cost more than it saves. torch's stream is synchronized after each update, since
    onnxruntime's next run reads the parameters on a stream of its own."""

    def __init__(self, device):
        self._device = device
        self._eager = 0
        self._graph = None
        self._key: tuple = ()
        #: why the kernels run eagerly from now on, or None
        self.stopped: str | None = None

    def run(self, kernels, calls) -> None:
        import torch

        key = tuple(t.data_ptr() for params, grads, states, counter in calls
                    for t in [*params, *grads, *(x for s in states.values() for x in s), counter])  # fmt: skip
        if self._graph is not None and key == self._key:
            self._graph.replay()
        elif self.stopped is not None:
            kernels()
        elif self._graph is not None:  # (a reason kept before, a failed capture's, stays)
            self._graph, self.stopped = None, "a tensor the update reads moved since its capture"
            kernels()
        elif self._eager < WARMUP:
            self._eager += 1
            kernels()
        else:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(self._device)
            stream.wait_stream(torch.cuda.current_stream(self._device))
            try:
                with torch.cuda.graph(graph, stream=stream):  # recorded, not run: the replay below runs it
                    kernels()
            except RuntimeError as exc:  # a kernel torch cannot capture: eager from now on, not an error
                self.stopped = f"its capture failed: {' '.join(str(exc).split())[:200]}"
                torch.cuda.current_stream(self._device).wait_stream(stream)
                kernels()
            else:
                torch.cuda.current_stream(self._device).wait_stream(stream)
                self._graph, self._key = graph, key
                graph.replay()
        torch.cuda.current_stream(self._device).synchronize()


def loss_scale_step(scaling: LossScaling, views, found_inf: bool, step: int) -> int | None:
    """A loss-scaled step's own part of the update, as the program writes it
    (passes/mixed_precision.py, _update_scale and _skip_update), on ``views`` (torch views of
    the carried scale, growth tracker and skipped count): backoff when the gradients are not
    finite, growth after ``growth_interval`` finite steps in a row unless the grown scale is not
    finite. Returns the optimizer's step count (``step`` less the skipped updates), or None
    when the update is skipped."""
    import torch

    scale, tracker, skipped = views
    if found_inf:
        scale.mul_(torch.tensor(scaling.backoff_factor, dtype=scale.dtype))
        tracker.zero_()
        skipped.add_(1)
        return None
    counted = tracker + 1
    grow = counted >= scaling.growth_interval
    grown = scale * torch.tensor(scaling.growth_factor, dtype=scale.dtype)
    grown = torch.where(torch.isinf(grown), scale, grown)
    scale.copy_(torch.where(grow, grown, scale))
    tracker.copy_(torch.where(grow, torch.zeros_like(counted), counted))
    return step - int(skipped)


def step_counter(device):
    """The step-count tensor torch's fused Adam kernels read (one per dtype group, refilled each step)."""
    import torch

    return torch.zeros((), dtype=torch.float32, device=device)


def update_tensors(
    kind: str,
    hyper: Mapping[str, Any],
    params: list,
    grads: list,
    states: Mapping[str, list],
    *,
    lr: float,
    step: int,
    clip: float | None,
    counter,
    norms=None,
    counted: bool = False,
) -> None:
    """The update of ``kind`` (an optimizer pass's name and ``hyper``, its hyperparameters)
    over lists of torch tensors of one dtype: ``params`` and ``states`` updated in place from
    ``grads`` at learning rate ``lr`` (a number, or for the fused kernels a float32 tensor on
    the device), ``step`` steps done before this one. ``clip``: the clipping factor (the
    gradients are scaled by it first, in place; a number or a tensor), or None. ``counter``:
    a float32 scalar tensor for the fused kernels' step count (``counted``: it holds ``step + 1``
    already, written before a captured graph that replays this). ``norms``: for LAMB, what
    makes each tensor's norm whole from its squared partial norms (ZeRO's shards; None: the
    tensors are whole)."""
    import torch

    if not torch.is_tensor(lr):
        lr = float(np.float32(lr))  # the program's lr input is float32
    if clip is not None:
        torch._foreach_mul_(grads, clip)
    wd = float(hyper.get("weight_decay") or 0.0)
    if kind == "sgd" and hyper.get("dampening"):
        _damped_sgd(params, grads, states["momentum_buffer"], lr, step, wd, float(hyper["momentum"]),
                    float(hyper["dampening"]), bool(hyper.get("nesterov")))  # fmt: skip
        return
    if kind == "sgd":
        torch._fused_sgd_(params, grads, states.get("momentum_buffer", []), weight_decay=wd,
                          momentum=float(hyper.get("momentum") or 0.0), lr=lr,
                          dampening=float(hyper.get("dampening") or 0.0), nesterov=bool(hyper.get("nesterov")),
                          maximize=False, is_first_step=step == 0)  # fmt: skip
        return
    beta1, beta2, eps = float(hyper["beta1"]), float(hyper["beta2"]), float(hyper["eps"])
    if kind == "lamb":
        _lamb(params, grads, states["exp_avg"], states["exp_avg_sq"], lr, step + 1, beta1, beta2, eps, wd, norms)
        return
    if not counted:
        counter.fill_(float(step + 1))
    fused = getattr(torch, KERNELS[kind])
    fused(params, grads, states["exp_avg"], states["exp_avg_sq"], [], [counter] * len(params), lr=lr, beta1=beta1,
          beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False)  # fmt: skip


def clip_coefficient(max_norm: float | None, norm: float | None) -> float | None:
    """The program's clipping factor, in float32 as it computes it: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None:
        return None
    if norm is None:
        raise GraphforgeError("the program clips its gradients, but segment 0 sent no gradient norm")
    ratio = np.float32(max_norm) / (np.float32(norm) + np.float32(1e-6))
    return float(min(ratio, np.float32(1.0)))


def _damped_sgd(params, grads, buffers, lr: float, step: int, weight_decay, momentum, dampening, nesterov) -> None:
    """SGD with dampening in foreach kernels, operation for operation as the program writes it
    (Sgd.update): torch's fused kernel rounds ``momentum * buf + (1 - dampening) * grad`` in
    another order, and over 20 steps of a small MLP that drifted 1.3e-6 of a buffer's norm away."""
    import torch

    d_p = torch._foreach_add(grads, torch._foreach_mul(params, weight_decay)) if weight_decay else list(grads)
    if step == 0:  # torch starts the buffer at the first gradient
        torch._foreach_copy_(buffers, d_p)
    else:
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, torch._foreach_mul(d_p, 1.0 - dampening))
    direction = torch._foreach_add(d_p, torch._foreach_mul(buffers, momentum)) if nesterov else buffers
    torch._foreach_sub_(params, torch._foreach_mul(direction, lr))


def _lamb(params, grads, exp_avgs, exp_avg_sqs, lr: float, t: int, beta1, beta2, eps, weight_decay, norms=None) -> None:
    """passes/optimizers.py's Lamb.update in foreach kernels: Adam's bias-corrected direction
    plus decoupled weight decay, scaled per tensor by ||param|| / ||direction|| (1 where
    either is 0); the scalars in float64, as the program computes them. ``norms``: takes the
    squared partial norms [2, n] (parameters, directions) of pieces of tensors and returns
    those of the whole tensors, one column per piece (a shard's pieces; None: whole tensors)."""
    import torch

    bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_div(exp_avg_sqs, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    direction = torch._foreach_div(exp_avgs, bc1)
    torch._foreach_div_(direction, denom)
    if weight_decay:
        torch._foreach_add_(direction, torch._foreach_mul(params, weight_decay))
    w_norm = torch.stack(torch._foreach_norm([p.float() for p in params]))
    d_norm = torch.stack(torch._foreach_norm([d.float() for d in direction]))
    if norms is not None:
        whole = norms(torch.stack([w_norm, d_norm]).double() ** 2).sqrt()
        w_norm, d_norm = whole[0].float(), whole[1].float()
    usable = (w_norm > 0) & (d_norm > 0)
    trust = torch.where(usable, w_norm / torch.where(usable, d_norm, 1.0), torch.ones_like(w_norm))
    scales = (trust.double() * lr).to(params[0].dtype).unbind()
    torch._foreach_mul_(direction, scales)
    torch._foreach_sub_(params, direction)
