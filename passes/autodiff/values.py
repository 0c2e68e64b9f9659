"""A rule's tensors: Values with the operators of its formula, and the Emitter that makes them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from graphforge.builder import Builder

_NUMBER = (int, float, np.integer, np.floating)


class Value:
    """A tensor of the graph being built, with the operators a rule's formula needs, so that
    Sigmoid's rule reads ``dy * (y * (1 - y))``.

    Each operator emits one node through the builder the value came from, in the order Python
    evaluates the expression (parentheses decide the association, and so the rounding). A
    Python number becomes a 0-d constant of the other operand's type (float32 where that is
    unknown), as ``Emitter.scalar`` makes one. ``tensor`` is the graph's own tensor: its
    ``shape`` and ``dtype`` are the graph's (static or symbolic dims, as shape inference left them).
    """

    __slots__ = ("b", "tensor")
    __array_ufunc__ = None  # a numpy scalar on the left defers to the reflected operator

    def __init__(self, tensor: gs.Tensor, builder: Builder):
        self.tensor, self.b = tensor, builder

    def __repr__(self) -> str:
        return f"Value({self.tensor.name!r})"

    # -------------------------------------------------------------- graph facts

    @property
    def shape(self):
        return self.tensor.shape

    @shape.setter
    def shape(self, shape) -> None:
        self.tensor.shape = shape

    @property
    def dtype(self):
        return self.tensor.dtype

    @dtype.setter
    def dtype(self, dtype) -> None:
        self.tensor.dtype = dtype

    @property
    def ndim(self) -> int:
        if self.tensor.shape is None:
            raise ValueError(f"the rank of {self.tensor.name!r} is unknown")
        return len(self.tensor.shape)

    # -------------------------------------------------------------- operators

    def _emit(self, op_type: str, *inputs, **attrs) -> Value:
        for t in inputs:
            if isinstance(t, Value) and t.b is not self.b:  # a body's value and an outer one, say
                raise ValueError(
                    f"{op_type} of {self!r} and {t!r}, values of two builders: make one of the other's "
                    "(Emitter.value) so it is clear which graph the node goes to"
                )
        return Value(self.b.op(op_type, *(raw(t) for t in inputs), **attrs), self.b)

    def _binary(self, op_type: str, other, reflected: bool = False):
        if isinstance(other, _NUMBER) and not isinstance(other, bool | np.bool_):
            other = self.b.scalar_like(other, self.tensor)
        elif not isinstance(other, Value | gs.Tensor):
            return NotImplemented
        return self._emit(op_type, other, self) if reflected else self._emit(op_type, self, other)

    def __add__(self, other):
        return self._binary("Add", other)

    def __radd__(self, other):
        return self._binary("Add", other, reflected=True)

    def __sub__(self, other):
        return self._binary("Sub", other)

    def __rsub__(self, other):
        return self._binary("Sub", other, reflected=True)

    def __mul__(self, other):
        return self._binary("Mul", other)

    def __rmul__(self, other):
        return self._binary("Mul", other, reflected=True)

    def __truediv__(self, other):
        return self._binary("Div", other)

    def __rtruediv__(self, other):
        return self._binary("Div", other, reflected=True)

    def __matmul__(self, other):
        return self._binary("MatMul", other)

    def __rmatmul__(self, other):
        return self._binary("MatMul", other, reflected=True)

    def __neg__(self) -> Value:
        return self._emit("Neg", self)

    def __gt__(self, other):
        return self._binary("Greater", other)

    def __lt__(self, other):
        return self._binary("Less", other)

    def __and__(self, other):
        return self._binary("And", other)

    def __or__(self, other):
        return self._binary("Or", other)

    def __invert__(self) -> Value:
        return self._emit("Not", self)

    # -------------------------------------------------------------- functions of one tensor

    def op(self, op_type: str, *others, **attrs) -> Value:
        """This tensor through any op, as its first input (``x.op("Cos")``, ``x.op("Gather", i, axis=1)``)."""
        return self._emit(op_type, self, *others, **attrs)

    def exp(self) -> Value:
        return self._emit("Exp", self)

    def log(self) -> Value:
        return self._emit("Log", self)

    def sqrt(self) -> Value:
        return self._emit("Sqrt", self)

    def abs(self) -> Value:
        return self._emit("Abs", self)

    def sign(self) -> Value:
        return self._emit("Sign", self)

    def tanh(self) -> Value:
        return self._emit("Tanh", self)

    def sigmoid(self) -> Value:
        return self._emit("Sigmoid", self)

    def reciprocal(self) -> Value:
        return self._emit("Reciprocal", self)

    # -------------------------------------------------------------- shapes and axes

    def transpose(self, perm: Sequence[int]) -> Value:
        """The axes permuted (``Builder.transpose``: a transpose of a Transpose is one transpose)."""
        return Value(self.b.transpose(self.tensor, [int(p) for p in perm]), self.b)

    @property
    def T(self) -> Value:
        """Every axis reversed, as numpy's ``.T`` (a matrix's transpose); the rank must be known."""
        return self.transpose(list(reversed(range(self.ndim))))

    @property
    def mT(self) -> Value:
        """The last two axes swapped, as the array API's ``.mT``; the rank must be known."""
        r = self.ndim
        return self.transpose([*range(r - 2), r - 1, r - 2])

    def sum(self, axes: Sequence[int] | Value | None = None, keepdims: bool = False) -> Value:
        """ReduceSum over ``axes`` (None: all of them; an empty list: none, no node)."""
        if axes is None:
            return self.reduce("ReduceSum", None, keepdims)
        return Value(self.b.reduce_sum(self.tensor, raw(axes), keepdims=keepdims), self.b)

    def mean(self, axes: Sequence[int] | None = None, keepdims: bool = False) -> Value:
        return self.reduce("ReduceMean", axes, keepdims)

    def reduce(self, op_type: str, axes: Sequence[int] | Value | None, keepdims: bool = False) -> Value:
        """Any reduction (ReduceProd, ReduceL2, ...) over ``axes`` (None: all), given as the opset wants them."""
        return Value(self.b.axes_op(op_type, self.tensor, raw(axes), keepdims=int(keepdims)), self.b)

    def reshape(self, shape: Sequence[int] | Value) -> Value:
        return Value(self.b.reshape(self.tensor, raw(shape)), self.b)

    def reshape_like(self, like: Value | gs.Tensor) -> Value:
        """Reshaped to ``like``'s shape exactly (a zero-size dim stays zero)."""
        return Value(self.b.reshape_like(self.tensor, raw(like)), self.b)

    def flatten(self, axis: int) -> Value:
        """ONNX's Flatten: the matrix [prod(dims before axis), prod(dims from axis)]."""
        return self._emit("Flatten", self, axis=axis)

    def expand(self, shape: Value | gs.Tensor) -> Value:
        return self._emit("Expand", self, shape)

    def unsqueeze(self, axes: Sequence[int]) -> Value:
        return Value(self.b.unsqueeze(self.tensor, axes), self.b)

    def squeeze(self, axes: Sequence[int]) -> Value:
        return Value(self.b.squeeze(self.tensor, axes), self.b)

    def slice(self, axis: int, start: int, end: int = 2**62) -> Value:
        """``[start:end]`` along ``axis``, static bounds."""
        return Value(self.b.slice(self.tensor, axis, start, end), self.b)

    def cast(self, dtype) -> Value:
        return Value(self.b.cast(self.tensor, dtype), self.b)

    def cast_like(self, like: Value | gs.Tensor) -> Value:
        return Value(self.b.cast_like(self.tensor, raw(like)), self.b)


def raw(t):
    """The graph's tensor of a Value (anything else as it is): what the builder and the driver take."""
    return t.tensor if isinstance(t, Value) else t


class Emitter:
    """Makes Values with a builder: constants, and the ops that take no Value first."""

    def __init__(self, builder: Builder):
        self.b = builder

    def value(self, t) -> Value | None:
        """``t`` (a graph tensor, or a Value of another builder: an outer tensor a body reads)
        as a Value of this builder; None stays None."""
        return t if t is None or (isinstance(t, Value) and t.b is self.b) else Value(raw(t), self.b)

    def op(self, op_type: str, *inputs, outputs: int = 1, **attrs):
        """One node (``Builder.op``): its output as a Value, or a list of them for ``outputs`` > 1."""
        out = self.b.op(op_type, *(raw(t) for t in inputs), outputs=outputs, **attrs)
        return [Value(t, self.b) for t in out] if outputs > 1 else Value(out, self.b)

    def const(self, value, dtype=None) -> Value:
        return Value(self.b.constant(value, dtype), self.b)

    def ints(self, values: Sequence[int]) -> Value:
        """A 1-D int64 constant (shapes, axes, sizes)."""
        return Value(self.b.ints(values), self.b)

    def scalar(self, value: float, like: Value | gs.Tensor) -> Value:
        """A 0-d constant of ``like``'s floating type (float32 if unknown)."""
        return Value(self.b.scalar_like(value, raw(like)), self.b)

    def where(self, cond: Value, a, b) -> Value:
        """Where(cond, a, b); a number becomes a scalar of the other branch's type (one of the
        two is a tensor)."""
        return self.op("Where", cond, *self._numbers_as_scalars(a, b))

    def _numbers_as_scalars(self, a, b) -> tuple:
        if isinstance(a, _NUMBER):
            a = self.scalar(a, b)
        if isinstance(b, _NUMBER):
            b = self.scalar(b, a)
        return a, b

    def concat(self, parts: Sequence, axis: int) -> Value:
        return self.op("Concat", *parts, axis=axis)

    def sum(self, values: Sequence) -> Value:
        """The Sum of ``values`` (``Builder.sum``: one Sum node, a scatter-add folded in)."""
        return Value(self.b.sum([raw(v) for v in values]), self.b)

    def shape(self, t, start: int | None = None, end: int | None = None) -> Value:
        """``t``'s shape (or dims start:end) as an int64 tensor, a constant where static."""
        return Value(self.b.shape(raw(t), start, end), self.b)

    def zeros_like(self, t) -> Value:
        return Value(self.b.zeros_like(raw(t)), self.b)

    def ones_like(self, t) -> Value:
        return Value(self.b.ones_like(raw(t)), self.b)
