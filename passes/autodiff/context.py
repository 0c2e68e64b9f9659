"""What a gradient rule sees: the forward node, its tensors as Values with operators, and shape helpers."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.autodiff.values import Emitter, Value, raw
from onnx import numpy_helper

from graphforge.builder import Builder, rank, static_shape
from graphforge.constants import constant_value
from graphforge.errors import PassError


class GradContext(Emitter):
    """Handed to a rule for one forward node.

    ``x(i)``/``y(i)`` are the node's i-th input/output as Values (None when absent), and the
    gradients a rule receives are Values too: a rule writes its formula with their operators,
    and the Emitter's methods make what it needs besides (``b`` is the raw builder, naming
    backward nodes after the forward node). Shapes come from ONNX shape inference: static
    where known, otherwise the helpers emit ``Shape`` ops so the gradient stays correct for
    every batch size and sequence length.
    """

    def __init__(
        self,
        node: gs.Node,
        builder: Builder,
        opset: int,
        *,
        totals: dict[int, gs.Tensor] | None = None,
        forward_ids: set[int] | None = None,
        wanted: set[int] | None = None,
        inputs: list[gs.Tensor] | None = None,
        constants: dict[int, tuple[gs.Tensor, np.ndarray | None]] | None = None,
    ):
        super().__init__(builder)
        self.node = node
        self.opset = opset
        self._totals = totals if totals is not None else {}
        self._forward_ids = forward_ids
        self._wanted = wanted
        # id(tensor) -> (tensor, its const_value), shared by the driver's whole walk: a constant
        # read by several nodes is evaluated once (the tensor is held: its id is not reused)
        self._constants = constants if constants is not None else {}
        #: the node's inputs (the graph's tensors), then the outer tensors its subgraphs read
        #: (driver.node_inputs); a rule returns one gradient per entry
        self.inputs = list(inputs) if inputs is not None else list(node.inputs)

    def for_node(self, node: gs.Node) -> GradContext:
        """A context for another forward node (to read its attributes), sharing this builder."""
        return GradContext(
            node, self.b, self.opset, totals=self._totals, forward_ids=self._forward_ids, constants=self._constants
        )

    def emitting_to(self, builder: Builder) -> GradContext:
        """This context with another builder: its Values and constants go to that builder's
        graph (a decomposition's own, see expand.decomposed)."""
        return GradContext(
            self.node,
            builder,
            self.opset,
            totals=self._totals,
            forward_ids=self._forward_ids,
            wanted=self._wanted,
            inputs=self.inputs,
            constants=self._constants,
        )

    def wants(self, t) -> bool:
        """Whether the driver uses a gradient for input ``t`` (it lies on a path from a tensor
        differentiated to the loss); rules may skip work for the others."""
        t = raw(t)
        return not t.is_empty() and (self._wanted is None or id(t) in self._wanted)

    # -------------------------------------------------------------- the backward pass so far

    def readers(self, t) -> list[gs.Node]:
        """The forward nodes reading ``t`` (backward nodes already emitted are left out)."""
        t = raw(t)
        if self._forward_ids is None:
            return list(t.outputs)
        return [n for n in t.outputs if id(n) in self._forward_ids]

    def output_grad(self, t) -> Value | None:
        """The total gradient of a tensor whose producer was already visited (reverse
        topological order: any output of a reader of this node's outputs), None if none flowed.
        Lets a rule fuse its gradient with its readers' (see rules/loss.py, cross entropy)."""
        return self.value(self._totals.get(id(raw(t))))

    # -------------------------------------------------------------- the forward node

    def x(self, i: int) -> Value | None:
        inputs = self.node.inputs
        return self.value(inputs[i]) if i < len(inputs) and not inputs[i].is_empty() else None

    def y(self, i: int = 0) -> Value | None:
        outputs = self.node.outputs
        return self.value(outputs[i]) if i < len(outputs) and not outputs[i].is_empty() else None

    def attr(self, name: str, default=None):
        return self.node.attrs.get(name, default)

    def const_value(self, i: int) -> np.ndarray | None:
        """The value of input i when it is a constant: an initializer, a Constant node, or a
        small graph of constants only (``constant_value``, evaluated once per tensor)."""
        inputs = self.node.inputs
        if i >= len(inputs) or inputs[i].is_empty():
            return None
        t = inputs[i]
        if id(t) not in self._constants:
            self._constants[id(t)] = (t, constant_value(t, self.opset))
        return self._constants[id(t)][1]

    def axes(self, i: int, attr: str = "axes") -> list[int] | None:
        """Axes given as an attribute (old opsets) or as constant input i (new ones), normalised
        to non-negative numbers when the rank is known. None if absent (meaning: all)."""
        value = self.attr(attr)
        if value is None:
            const = self.const_value(i)
            if const is None:
                if self.x(i) is not None:
                    self.fail(f"input {i} ({attr}) must be a constant to differentiate this node")
                return None
            value = const.reshape(-1).tolist()
        r = rank(self.node.inputs[0])
        return [int(a) + r if r is not None and a < 0 else int(a) for a in value]

    def rank(self, t) -> int:
        r = rank(raw(t))
        if r is None:
            self.fail(f"the rank of {raw(t).name!r} is unknown (shape inference could not tell)")
        return r

    def static_shape(self, t) -> tuple[int, ...] | None:
        return static_shape(raw(t))

    def fail(self, message: str) -> None:
        raise PassError(f"cannot differentiate: {message}", node=self.node.name, op_type=self.node.op)

    # -------------------------------------------------------------- small helpers rules share

    def equal(self, a, b) -> Value:
        """a == b as a bool tensor, for float operands too (Equal takes floats from opset 11).
        Here and in ``at_least``/``at_most`` a number becomes a scalar of the other's type."""
        a, b = self._numbers_as_scalars(a, b)
        if self.opset >= 11:
            return self.op("Equal", a, b)
        return ~(self.op("Less", a, b) | self.op("Greater", a, b))

    def at_least(self, a, b) -> Value:
        """a >= b as a bool tensor (GreaterOrEqual is opset 12)."""
        a, b = self._numbers_as_scalars(a, b)
        return self.op("GreaterOrEqual", a, b) if self.opset >= 12 else ~self.op("Less", a, b)

    def at_most(self, a, b) -> Value:
        """a <= b as a bool tensor (LessOrEqual is opset 12)."""
        a, b = self._numbers_as_scalars(a, b)
        return self.op("LessOrEqual", a, b) if self.opset >= 12 else ~self.op("Greater", a, b)

    def dy_or_zeros(self, dys, i: int) -> Value:
        """Output i's gradient, or zeros of its shape when no gradient reaches that output
        (multi-output ops like Split whose outputs are not all used)."""
        return dys[i] if dys[i] is not None else self.zeros_like(self.node.outputs[i])

    def ensure_output(self, i: int, name: str) -> Value:
        """The forward node's output i, adding it if the model did not ask for it
        (MaxPool's indices, Dropout's mask): the backward pass reads it."""
        outputs = self.node.outputs
        while len(outputs) <= i:
            outputs.append(gs.Variable.empty())
        if outputs[i].is_empty():
            outputs[i] = gs.Variable(self.b.fresh_name(name))
        return self.value(outputs[i])

    def unbroadcast(self, grad, grad_shape, x, peers=()) -> Value:
        """Sum ``grad`` (shaped ``grad_shape``, a broadcast result) down to ``x``'s shape.

        ``peers`` are the other operands of the broadcast: where all of them have size 1
        (or no axis) at a position, x's dim *is* the result's, even when shape inference
        named the two symbolic dims differently."""
        return _unbroadcast(self, self.value(grad), grad_shape, self.value(x), peers)


def _unbroadcast(ctx: GradContext, grad: Value, grad_shape, x: Value, peers=()) -> Value:
    """Sum ``grad`` (of shape ``grad_shape``, the broadcast result's) down to ``x``'s shape.

    Axes that are equal (same number or same symbolic name) are kept; axes where x has a
    static 1 are summed statically; anything else (symbolic dims, unknown ranks) is
    decided at run time from the two shapes."""
    if x.shape is None or grad_shape is None:
        return _unbroadcast_dynamic(ctx, grad, x, None)
    xs, gs_ = list(x.shape), list(grad_shape)
    lead = len(gs_) - len(xs)
    if lead < 0:
        ctx.fail(f"input {x.tensor.name!r} has a higher rank than its broadcast result")
    axes = list(range(lead))
    dynamic = False
    for i, (xd, gd) in enumerate(zip(xs, gs_[lead:], strict=True)):
        if _same_dim(xd, gd) or _peers_are_one(peers, lead + i - len(gs_)):
            continue
        if xd == 1:
            axes.append(lead + i)
        else:
            dynamic = True
    if dynamic:
        return _unbroadcast_dynamic(ctx, grad, x, lead)
    if not axes:
        return grad
    summed = grad.sum(axes, keepdims=True)
    return summed.reshape_like(x) if lead else summed


def _peers_are_one(peers, axis_from_end: int) -> bool:
    """Whether every peer operand is absent or of static size 1 at this (negative) axis."""
    if not peers:
        return False
    for peer in peers:
        shape = peer.shape
        if shape is None:
            return False
        if len(shape) >= -axis_from_end and shape[axis_from_end] != 1:
            return False
    return True


def _same_dim(a, b) -> bool:
    if isinstance(a, int | np.integer) and isinstance(b, int | np.integer):
        return int(a) == int(b) and a >= 0
    return isinstance(a, str) and a == b


def _unbroadcast_dynamic(ctx: GradContext, grad: Value, x: Value, lead: int | None) -> Value:
    """Reduce over the axes where x has size 1 (or is missing) and grad does not, with the
    axes found at run time; ``lead`` (extra leading axes of grad) may be unknown too."""
    if ctx.opset < 13:
        ctx.fail("un-broadcasting over symbolic dims needs opset 13+ (ReduceSum with run-time axes)")
    x_shape, g_shape = ctx.shape(x), grad.op("Shape")
    if lead is None:  # as many ones in front of x's shape as grad has more axes
        missing = g_shape.op("Size") - x_shape.op("Size")
        ones = missing.reshape([1]).op("ConstantOfShape", value=_int64_one())
        x_shape = ctx.concat([ones, x_shape], axis=0)
    elif lead:
        x_shape = ctx.concat([ctx.ints([1] * lead), x_shape], axis=0)
    one = ctx.ints([1])
    broadcast = x_shape.op("Equal", one) & ~g_shape.op("Equal", one)
    summed = grad.op("ReduceSum", broadcast.op("NonZero").reshape([-1]), keepdims=1, noop_with_empty_axes=1)
    return summed.reshape_like(x)


def _int64_one():
    return numpy_helper.from_array(np.array([1], dtype=np.int64))
