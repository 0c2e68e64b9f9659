"""The gradient-rule registry: one small function per op type, in an explicit table.

A rule receives a GradContext (the forward node, its tensors as Values with operators, shape
helpers) and the gradients of the node's outputs (Values, None where none flows), and returns
one gradient per forward input: a Value, or None for an input that takes none (a Reshape's
shape). The driver does the shared work: ordering, summing, un-broadcasting, dtype checks.

Helpers make each kind of rule short, as JAX's ``defjvp``/``deflinear`` do: ``unary`` for
elementwise ops of one input (its derivative times dy), ``linear`` for ops linear in their
leading inputs, each with the others fixed (MatMul, Transpose, Concat: the gradient is the
transpose of the map, given as one function of dy), ``nondifferentiable`` for ops whose
outputs carry no gradient.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphforge.passes.autodiff.context import GradContext
    from graphforge.passes.autodiff.values import Value

Grads = Sequence["Value | None"]
RuleFn = Callable[["GradContext", Grads], Sequence["Value | None"]]


@dataclass(frozen=True)
class Rule:
    op_type: str
    fn: RuleFn | None  # None: non-differentiable, no gradient flows through
    since: int = 1  # first ai.onnx opset the rule handles
    until: int | None = None  # last one (None: up to the newest)
    broadcast: bool = False  # inputs broadcast numpy-style: the driver un-broadcasts each gradient
    domain: str = ""
    module: str = ""  # the rules module that registered it (its op family, listed in docs/ops.md)
    #: integer outputs carry a gradient too (a straight-through estimator: QuantizeLinear)
    straight_through: bool = False
    #: inputs that configure the op rather than hold what it computes on (Clip's bounds, Dropout's
    #: ratio, BatchNormalization's running statistics: numbers or buffers in torch), as (index,
    #: what it is) pairs: an initializer read only there is no parameter unless ``trainable``
    #: names it, and where the rule gives such an input no gradient, this says why
    settings: tuple[tuple[int, str], ...] = ()
    #: outputs the rule treats as constants (BatchNormalization's running statistics, which
    #: torch updates outside autograd), as (index, what it is) pairs: a gradient reaching
    #: them goes no further
    detached: tuple[tuple[int, str], ...] = ()

    def setting(self, index: int) -> str | None:
        """What input ``index`` is when it is a setting, else None."""
        return next((what for i, what in self.settings if i == index), None)

    @property
    def differentiable(self) -> bool:
        return self.fn is not None

    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset <= self.until)


#: the oldest opset any rule handles: the driver's own ops (ConstantOfShape for zeros,
#: Expand for a reduction's gradient) are opset 9 ops; models that old are not trained today
OLDEST_OPSET = 9


class RuleRegistry:
    """op type → Rule. A second rule for the same (domain, op type) is refused."""

    def __init__(self) -> None:
        self._rules: dict[tuple[str, str], Rule] = {}

    def add(self, rule: Rule) -> Rule:
        key = (rule.domain, rule.op_type)
        if key in self._rules:
            raise ValueError(f"a gradient rule for {rule.op_type!r} is already registered")
        if rule.since < OLDEST_OPSET:
            rule = replace(rule, since=OLDEST_OPSET)
        self._rules[key] = rule
        return rule

    def get(self, op_type: str, domain: str | None = "") -> Rule | None:
        return self._rules.get((domain or "", op_type))

    def __iter__(self):
        return iter(sorted(self._rules.values(), key=lambda r: (r.domain, r.op_type)))

    def __len__(self) -> int:
        return len(self._rules)

    def op_types(self) -> list[str]:
        return sorted(r.op_type for r in self._rules.values())

    # -------------------------------------------------------------- decorators and helpers

    def gradient(
        self,
        op_type: str,
        *,
        since: int = 1,
        until: int | None = None,
        broadcast: bool = False,
        straight_through: bool = False,
        settings: dict[int, str] | None = None,
        detached: dict[int, str] | None = None,
    ):
        """Register the decorated function as ``op_type``'s rule (``settings``, ``detached``: see Rule)."""

        def register(fn: RuleFn) -> RuleFn:
            self.add(
                Rule(
                    op_type,
                    fn,
                    since,
                    until,
                    broadcast,
                    module=fn.__module__,
                    straight_through=straight_through,
                    settings=tuple(sorted((settings or {}).items())),
                    detached=tuple(sorted((detached or {}).items())),
                )
            )
            return fn

        return register

    def unary(self, op_type: str, dx: Callable[[GradContext, Value], Value], *, since: int = 1) -> None:
        """An elementwise op of one differentiable input: ``dx(ctx, dy)`` is its gradient."""
        fn = lambda ctx, dys: [dx(ctx, dys[0]), *[None] * (len(ctx.node.inputs) - 1)]  # noqa: E731
        self.add(Rule(op_type, fn, since, module=dx.__module__))

    def linear(
        self,
        op_type: str,
        *,
        since: int = 1,
        until: int | None = None,
        broadcast: bool = False,
        settings: dict[int, str] | None = None,
    ):
        """Register the decorated function as the transpose of an op linear in its leading
        inputs, each with the others fixed (JAX's ``deflinear``, ``defbilinear``): called with
        the gradients of the node's outputs, ``transpose(ctx, *dys)`` returns that of input 0,
        or a list of those of the first inputs (None for an index among them); the inputs after
        them (shapes, axes, indices) take none."""

        def register(transpose: Callable[..., Value | Sequence[Value | None]]):
            def fn(ctx, dys):
                dxs = transpose(ctx, *dys)
                dxs = list(dxs) if isinstance(dxs, list | tuple) else [dxs]
                return [*dxs, *[None] * (len(ctx.inputs) - len(dxs))]

            fn.__module__ = transpose.__module__  # the op family is the transpose's module
            self.gradient(op_type, since=since, until=until, broadcast=broadcast, settings=settings)(fn)
            return transpose

        return register

    def nondifferentiable(self, *op_types: str, since: int = 1) -> None:
        """Ops through which no gradient flows (integer/bool results, or a zero derivative)."""
        module = sys._getframe(1).f_globals.get("__name__", "")  # the rules module calling this
        for op_type in op_types:
            self.add(Rule(op_type, None, since, module=module))


RULES = RuleRegistry()
