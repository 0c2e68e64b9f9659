"""The mixed_precision pass: a training program computes in float16 or bfloat16, keeps its
parameters and optimizer states in float32, and scales its loss dynamically, in standard ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.builder import Builder
from graphforge.dag import placed_early
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ort_compat import resolve_provider
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.placement.precision import LOW_TYPES, convert, kernel_check, program_policy
from graphforge.program import CarriedSpec, LossScaling, ProgramRoles
from graphforge.shapes import infer_shapes

#: the carried tensors of dynamic loss scaling: the scale, the finite steps since it last
#: changed, and the updates skipped so far
SCALE, TRACKER, SKIPPED = "loss_scale", "loss_scale.growth_tracker", "loss_scale.skipped"
#: the output saying whether this step's update was skipped (its gradients were not finite)
UPDATE_SKIPPED = "update_skipped"


@dataclass(frozen=True)
class MixedPrecision(Pass):
    """Compute the forward and backward in ``dtype`` where it is safe, as torch.autocast and
    GradScaler do, after the optimizer pass (so the backward's own ops, such as the sums a
    bias gradient makes, are placed by the same rules as the forward's, and the loss
    scaling has the gradient boundary to work at).

    1. Precision (graphforge.placement.precision): GEMMs and convolutions compute in ``dtype``; what
       loses too much in 16 bits (softmax, exp/log/pow, reductions, normalization
       statistics, the loss and its gradient) in float32; the rest in the type of the
       activations it reads. ``keep_fp32``: op types, node names or the forward nodes whose
       gradients also stay in float32. Parameters, optimizer states and the update stay
       float32 (master weights): each weight is cast once per step, and each gradient
       comes back to float32 before the gradient boundary.
    2. Kernels: a node goes to ``dtype`` only where onnxruntime's ``provider`` ("auto": CUDA
       where it works here, else the CPU) has a kernel for it; otherwise it computes in
       float32, and the note counts it.
    3. Loss scaling (``loss_scale``: "dynamic", "none", a number for a static scale, or
       "auto": dynamic for float16, none for bfloat16). The backward starts from the scale
       instead of 1; at the gradient boundary (after the allreduce, whichever of the two
       passes runs first) each gradient is multiplied by 1/scale, and when any is not finite
       the update is skipped: every parameter, optimizer state and the optimizer's step
       count keep their values exactly. The scale is carried state (``loss_scale``, first
       ``init_scale``), halved (``backoff_factor``) on a skipped step and doubled
       (``growth_factor``) after ``growth_interval`` finite steps in a row, as
       torch.amp.GradScaler does; ``loss_scale.skipped`` counts the skipped updates and the
       output ``update_skipped`` says whether this step's was.
    """

    name = "mixed_precision"
    requires = (Fact.OPTIMIZER, Fact.GRADIENT_BOUNDARY)
    refuses = (Fact.MIXED_PRECISION, Fact.STAGES)
    ensures = (Fact.MIXED_PRECISION,)

    dtype: Literal["float16", "bfloat16"] = "float16"
    keep_fp32: tuple[str, ...] = ()
    loss_scale: float | Literal["auto", "dynamic", "none"] = "auto"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    provider: Literal["auto", "cpu", "cuda"] = "auto"

    def __post_init__(self):
        if self.dtype not in LOW_TYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {', '.join(LOW_TYPES)}")
        keep = (self.keep_fp32,) if isinstance(self.keep_fp32, str) else tuple(self.keep_fp32)
        object.__setattr__(self, "keep_fp32", keep)
        if not isinstance(self.loss_scale, str):
            check_number(self, "loss_scale", above=0)
        elif self.loss_scale not in ("auto", "dynamic", "none"):
            raise ValueError(f"loss_scale={self.loss_scale!r}: use dynamic, none, auto or a number")
        check_number(self, "init_scale", above=0)
        check_number(self, "growth_factor", at_least=1)
        check_number(self, "backoff_factor", above=0, at_most=1)
        check_number(self, "growth_interval", at_least=1)

    @property
    def scaling(self) -> str:
        """ "dynamic", "static" or "none"."""
        if self.loss_scale == "auto":
            return "dynamic" if self.dtype == "float16" else "none"
        return self.loss_scale if isinstance(self.loss_scale, str) else "static"

    def run(self, model: Model) -> PassResult:
        try:
            provider = resolve_provider(self.provider)
        except ValueError as exc:
            raise PassError(f"{exc}; compile with provider=cpu, or on the machine that trains") from None
        model = infer_shapes(model, in_place=True)  # the conversion needs every float type known
        graph = model.graph
        program_roles = ProgramRoles.of_model(model)
        done = convert(
            graph,
            LOW_TYPES[self.dtype],
            program_policy(self.keep_fp32),
            kernel_check(provider, graph.opset or 13),
            parameters=model.initializer_inputs,
            prefix=roles.AMP_PREFIX,
        )
        if not done.low:
            raise PassError(
                f"no node can compute in {self.dtype} on {provider} (its kernels are missing there); "
                "the program would be the float32 one with casts"
            )
        scaling = None
        if self.scaling != "none":
            existing = {id(n) for n in graph.nodes}
            scaling = _LossScaler(self, model, program_roles).insert()
            # a guard Where(found_inf, P, P_new) left at the end would keep every parameter's
            # new value alive until all of them were computed
            graph.nodes = placed_early(graph.nodes, existing)
        roles.set_json(
            model,
            roles.MIXED_PRECISION,
            {
                "dtype": self.dtype,
                "provider": provider,
                "keep_fp32": list(self.keep_fp32),
                "loss_scale": scaling.to_json() if scaling else {"kind": "none"},
                "nodes": {
                    "low": sum(done.low.values()),
                    "casts": done.casts,
                    "emulated": dict(done.emulated),
                    "fallback": dict(done.fallback),
                },
            },
        )
        note = done.note(self.dtype) + (f"; {self.scaling} loss scaling" if scaling else "")
        return PassResult(model, True, note=note)


class _LossScaler:
    """Writes dynamic loss scaling into a program (MixedPrecision's case 3)."""

    def __init__(self, mp: MixedPrecision, model: Model, program_roles: ProgramRoles):
        self.mp, self.model, self.roles = mp, model, program_roles
        self.graph = model.graph
        self.b = Builder(self.graph, prefix=roles.OPTIM_PREFIX)
        self.tensors = self.graph.tensors()

    def insert(self) -> LossScaling:
        mp, graph, b = self.mp, self.graph, self.b
        for name in (SCALE, TRACKER, SKIPPED, UPDATE_SKIPPED, roles.next_name(SCALE)):
            if name in self.tensors:
                raise PassError(f"cannot add {name!r} for loss scaling: the model already has a tensor with that name")
        static = mp.scaling == "static"
        init = float(mp.loss_scale) if static else mp.init_scale
        scale = gs.Constant(SCALE, np.array(init, np.float32))
        tracker = gs.Variable(TRACKER, dtype=np.int64, shape=[])
        skipped = gs.Variable(SKIPPED, dtype=np.int64, shape=[])
        graph.inputs += [tracker, skipped]
        self.model.initializer_inputs.append(SCALE)
        with b.scope("loss_scale"):
            self._scale_seed(scale)
            found_inf, unscaled = self._unscale(scale)
            self._skip_update(found_inf, skipped)
            growth, backoff = (1.0, 1.0) if static else (mp.growth_factor, mp.backoff_factor)
            updated = self._update_scale(scale, tracker, skipped, found_inf, growth, backoff)
        outputs = list(graph.outputs)
        for name, value, like in updated:
            out = b.op("Identity", value)
            out.name, out.dtype, out.shape = name, like.dtype, []
            outputs.append(out)
        flag = b.op("Identity", found_inf)
        flag.name, flag.dtype, flag.shape = UPDATE_SKIPPED, np.bool_, []
        graph.outputs = [*outputs, flag]
        state = roles.get_json(self.model, roles.STATE, [])
        for name, dtype, init_kind in (
            (SCALE, "float32", "initializer"),
            (TRACKER, "int64", "zeros"),
            (SKIPPED, "int64", "zeros"),
        ):
            state.append(CarriedSpec(name, roles.next_name(name), "optimizer", dtype, (), init_kind, None).to_json())
        roles.set_json(self.model, roles.STATE, state)
        return LossScaling(
            "static" if static else "dynamic",
            SCALE,
            TRACKER,
            SKIPPED,
            UPDATE_SKIPPED,
            init,
            growth,
            backoff,
            mp.growth_interval,
            unscaled,
        )

    def _scale_seed(self, scale: gs.Tensor) -> None:
        """The backward starts from dL/dloss = scale."""
        name = self.model.metadata.get(roles.LOSS_SEED)
        seed = self.tensors.get(name) if name else None
        if seed is None:
            raise PassError(
                "loss scaling needs the backward's starting constant (graphforge.loss_seed), which the model "
                "lacks: compile it again with autodiff, and run mixed_precision before passes that fold constants"
            )
        readers = [n for n in seed.outputs if (n.name or "").startswith(roles.GRAD_PREFIX)]
        scaled = self.b.mul(seed, self.b.cast_like(scale, seed))
        for node in readers:
            node.inputs = [scaled if t is seed else t for t in node.inputs]

    def _unscale(self, scale: gs.Tensor) -> tuple[gs.Tensor, dict[str, str]]:
        """Each gradient where everything after the boundary reads it, times 1/scale; returns
        whether any is not finite (their sum is not: inf and nan propagate through it), and
        the name of each parameter's unscaled gradient."""
        b = self.b
        inverse = b.op("Reciprocal", scale)
        reduced = self.roles.allreduce.reduced if self.roles.allreduce else {}
        sums, names = [], {}
        for parameter, boundary in self.roles.gradient_boundary.items():
            gradient = self.tensors[reduced.get(parameter, boundary)]
            readers = list(gradient.outputs)
            unscaled = b.mul(gradient, b.cast_like(inverse, gradient))
            unscaled.dtype, unscaled.shape = gradient.dtype, gradient.shape
            names[parameter] = unscaled.name
            for node in readers:
                node.inputs = [unscaled if t is gradient else t for t in node.inputs]
            total = b.axes_op("ReduceSum", unscaled, None, keepdims=0)
            sums.append(total if np.dtype(gradient.dtype) == np.float32 else b.cast(total, np.float32))
        if not sums:
            raise PassError("the program has no gradients at its gradient boundary to unscale")
        total = b.sum(sums)
        return b.op("Or", b.op("IsInf", total), b.op("IsNaN", total)), names

    def _skip_update(self, found_inf: gs.Tensor, skipped: gs.Tensor) -> None:
        """On a step whose gradients are not finite, every parameter and optimizer state keeps
        its value, and the optimizer's step count (the ``step`` input less the skipped
        updates) stays as it was."""
        b, tensors = self.b, self.tensors
        for spec in self.roles.carried_with_role("parameter", "optimizer"):
            out = tensors.get(spec.output)
            if out is None or not out.inputs:
                continue
            producer = out.inputs[0]
            producer.inputs[0] = b.op("Where", found_inf, tensors[spec.input], producer.inputs[0])
        step = tensors.get(self.roles.step_input or "")
        if step is not None:
            readers = [n for n in step.outputs if (n.name or "").startswith(roles.OPTIM_PREFIX)]
            counted = b.sub(step, skipped)
            for node in readers:
                node.inputs = [counted if t is step else t for t in node.inputs]

    def _update_scale(self, scale, tracker, skipped, found_inf, growth: float, backoff: float):
        """torch.amp.GradScaler's update: (name, next value, like) of each carried scalar."""
        b = self.b
        zero = b.constant(np.array(0, np.int64))
        counted = b.add(tracker, b.constant(np.array(1, np.int64)))
        grow = b.op("GreaterOrEqual", counted, b.constant(np.array(self.mp.growth_interval, np.int64)))
        grown = b.mul(scale, b.constant(np.array(growth, np.float32)))
        grown = b.op("Where", b.op("IsInf", grown), scale, grown)  # torch keeps a scale that would overflow
        finite_next = b.op("Where", grow, grown, scale)
        scale_next = b.op("Where", found_inf, b.mul(scale, b.constant(np.array(backoff, np.float32))), finite_next)
        tracker_next = b.op("Where", b.op("Or", found_inf, grow), zero, counted)
        skipped_next = b.add(skipped, b.cast(found_inf, np.int64))
        return [
            (roles.next_name(SCALE), scale_next, scale),
            (roles.next_name(TRACKER), tracker_next, tracker),
            (roles.next_name(SKIPPED), skipped_next, skipped),
        ]
