"""The builder passes use to emit standard ONNX ops into an onnx-graphsurgeon graph.

It hides the opset differences rules would otherwise repeat (axes as an attribute before
opset 13 and as an input after; ReduceMean's axes input from 18), names what it creates
after the node it works for, and folds shapes that are statically known into constants.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import onnx_graphsurgeon as gs

TensorLike = gs.Tensor | np.ndarray | float | int

#: reductions whose ``axes`` moved from an attribute to an input, and the opset where it did
_AXES_INPUT_SINCE = {
    "ReduceSum": 13,
    "ReduceMean": 18,
    "ReduceMax": 18,
    "ReduceMin": 18,
    "ReduceProd": 18,
    "ReduceL1": 18,
    "ReduceL2": 18,
    "ReduceLogSum": 18,
    "ReduceLogSumExp": 18,
    "ReduceSumSquare": 18,
    "Squeeze": 13,
    "Unsqueeze": 13,
}


class Builder:
    """Appends nodes to ``graph``. Every node and tensor it makes is named
    ``<prefix><scope>/<op>_<n>`` so generated nodes remember where they came from."""

    def __init__(self, graph: gs.Graph, *, prefix: str = ""):
        self.graph = graph
        self.opset = graph.opset or 13
        self.prefix = prefix
        self._scope = ""
        self._ids = itertools.count()
        self._taken = {t for t in graph.tensors()} | {n.name for n in graph.nodes if n.name}

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        saved, self._scope = self._scope, name
        try:
            yield
        finally:
            self._scope = saved

    def fresh_name(self, what: str) -> str:
        while True:
            name = f"{self.prefix}{self._scope}/{what}_{next(self._ids)}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    # ------------------------------------------------------------------ generic

    def op(self, op_type: str, *inputs: TensorLike | None, outputs: int = 1, domain: str | None = None, **attrs):
        """Emit one node; returns its output tensor (or a list when ``outputs`` > 1).

        A None input is written as the empty name (an omitted optional input)."""
        ins = [gs.Variable.empty() if x is None else self.tensor(x) for x in inputs]
        dtype = _result_dtype(op_type, ins, attrs)
        outs = [gs.Variable(self.fresh_name(f"{op_type}_out"), dtype=dtype) for _ in range(outputs)]
        node = gs.Node(op_type, name=self.fresh_name(op_type), attrs=attrs, inputs=ins, outputs=outs, domain=domain)
        self.graph.nodes.append(node)
        return outs[0] if outputs == 1 else outs

    def tensor(self, x: TensorLike) -> gs.Tensor:
        if isinstance(x, gs.Tensor):
            return x
        return self.constant(np.asarray(x))

    def constant(self, value: np.ndarray | float | int, dtype: np.dtype | type | None = None) -> gs.Constant:
        array = np.asarray(value, dtype=dtype)
        return gs.Constant(self.fresh_name("const"), array)

    def scalar_like(self, value: float, like: gs.Tensor) -> gs.Constant:
        """A 0-d constant of ``like``'s floating dtype (float32 if unknown)."""
        return self.constant(value, dtype=like.dtype if like.dtype is not None else np.float32)

    def ints(self, values: Sequence[int]) -> gs.Constant:
        return self.constant(np.asarray(list(values), dtype=np.int64).reshape(-1))

    # ------------------------------------------------------------------ arithmetic

    def add(self, a, b):
        return self.op("Add", a, b)

    def sub(self, a, b):
        return self.op("Sub", a, b)

    def mul(self, a, b):
        return self.op("Mul", a, b)

    def div(self, a, b):
        return self.op("Div", a, b)

    def neg(self, a):
        return self.op("Neg", a)

    def matmul(self, a, b):
        return self.op("MatMul", a, b)

    def sum(self, tensors: Sequence[gs.Tensor]) -> gs.Tensor:
        """The sum of ``tensors`` (of one shape). A scatter-add into zeros among them (a
        Gather's gradient) scatters into the sum of the others instead: an embedding tied to
        an output head then gets its gradient without a zero-filled copy of the table."""
        if len(tensors) == 1:
            return tensors[0]
        for i, t in enumerate(tensors):
            scatter = self._unread_product(t, ("ScatterElements", "ScatterND"))
            if scatter is not None and scatter.attrs.get("reduction") == "add" and is_zeros(scatter.inputs[0]):
                rest = self.sum([u for j, u in enumerate(tensors) if j != i])
                return self.op(scatter.op, rest, *scatter.inputs[1:], **scatter.attrs)
        return self.op("Sum", *tensors)

    def _unread_product(self, x: gs.Tensor, ops: Sequence[str]) -> gs.Node | None:
        """The standard-domain node of an op in ``ops`` that made ``x``, if nothing reads
        ``x`` yet and it is no graph output: a fold may then replace the node (the old one
        is left without readers, for cleanup)."""
        if not isinstance(x, gs.Variable) or len(x.inputs) != 1 or x.outputs:
            return None
        node = x.inputs[0]
        if node.op not in ops or node.domain not in (None, "", "ai.onnx") or len(node.outputs) != 1:
            return None
        return None if any(o is x for o in self.graph.outputs) else node

    # ------------------------------------------------------------------ shapes

    def shape(self, x: gs.Tensor, start: int | None = None, end: int | None = None) -> gs.Tensor:
        """Shape of ``x`` (a constant when statically known)."""
        static = static_shape(x)
        if static is not None:
            return self.ints(static[start:end])
        attrs = {}
        if start is not None:
            attrs["start"] = start
        if end is not None:
            attrs["end"] = end
        if attrs and self.opset < 15:  # Shape takes start and end from opset 15
            return self.slice(self.op("Shape", x), 0, start or 0, 2**62 if end is None else end)
        return self.op("Shape", x, **attrs)

    def reshape(self, x, shape):
        return self.op("Reshape", x, shape if isinstance(shape, gs.Tensor) else self.ints(shape))

    def reshape_like(self, x, like: gs.Tensor):
        """``x`` reshaped to ``like``'s shape exactly: a zero-size dim stays zero (allowzero,
        opset 14+; without it Reshape reads a 0 as "keep this dim")."""
        return self.op("Reshape", x, self.shape(like), **({"allowzero": 1} if self.opset >= 14 else {}))

    def slice(self, x, axis: int, start: int, end: int = 2**62):
        """``x[start:end]`` along ``axis`` (static bounds; attributes before opset 10, inputs after)."""
        if self.opset < 10:
            return self.op("Slice", x, starts=[start], ends=[end], axes=[axis])
        return self.op("Slice", x, self.ints([start]), self.ints([end]), self.ints([axis]))

    def transpose(self, x, perm: Sequence[int]):
        """``x`` with its axes permuted. A transpose of a Transpose is one transpose of its
        source, or the source itself (the backward of ``MatMul(x, Transpose(W))``, how
        exporters write a Linear layer, reads W, not a copy of it); the 2-D transpose of a
        Gemm product nothing else reads is that Gemm with its operands swapped
        ((op(A) op(B))ᵀ = op(B)ᵀ op(A)ᵀ), so a transposed weight's gradient is made once."""
        perm = [int(p) for p in perm]
        producer = x.inputs[0] if isinstance(x, gs.Variable) and len(x.inputs) == 1 else None
        if producer is not None and producer.op == "Transpose" and producer.domain in (None, "", "ai.onnx"):
            inner = producer.attrs.get("perm") or list(reversed(range(len(perm))))
            composed = [int(inner[p]) for p in perm]
            source = producer.inputs[0]
            return source if composed == list(range(len(perm))) else self.op("Transpose", source, perm=composed)
        gemm = self._unread_product(x, ("Gemm",)) if perm == [1, 0] else None
        if gemm is not None and (len(gemm.inputs) < 3 or gemm.inputs[2].is_empty()):
            a, b = gemm.inputs[:2]
            attrs = {k: v for k, v in gemm.attrs.items() if k not in ("transA", "transB")}
            flags = {"transA": 1 - int(gemm.attrs.get("transB", 0)), "transB": 1 - int(gemm.attrs.get("transA", 0))}
            return self.op("Gemm", b, a, **attrs, **{k: v for k, v in flags.items() if v})
        return self.op("Transpose", x, perm=perm)

    def cast(self, x, dtype) -> gs.Tensor:
        """``x`` as ``dtype``: a NumPy type, or an ONNX enum (onnx-graphsurgeon's for the types
        NumPy lacks, e.g. bfloat16)."""
        from onnx import helper

        to = int(dtype) if isinstance(dtype, int | np.integer) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        return self.op("Cast", x, to=to)

    def cast_like(self, x, like: gs.Tensor) -> gs.Tensor:
        """``x`` cast to ``like``'s type: a Cast where that type is known, so that the run
        does not read ``like`` (a CastLike would keep a large tensor alive until it runs)."""
        if like.dtype is not None:
            with contextlib.suppress(TypeError):  # onnx-only types (bfloat16): CastLike
                return self.cast(x, like.dtype)
        return self.op("CastLike", x, like) if self.opset >= 15 else self.cast(x, like.dtype)

    def expand(self, x, shape):
        return self.op("Expand", x, shape)

    def zeros_like(self, x: gs.Tensor) -> gs.Tensor:
        return self.op("Mul", x, self.scalar_like(0.0, x)) if x.dtype is None else self._fill_like(x, 0.0)

    def ones_like(self, x: gs.Tensor) -> gs.Tensor:
        return self._fill_like(x, 1.0)

    def _fill_like(self, x: gs.Tensor, value: float) -> gs.Tensor:
        from onnx import numpy_helper

        dtype = x.dtype if x.dtype is not None else np.float32
        return self.op("ConstantOfShape", self.shape(x), value=numpy_helper.from_array(np.array([value], dtype=dtype)))

    # ------------------------------------------------------------------ opset-dependent forms

    def axes_op(self, op_type: str, x, axes: Sequence[int] | gs.Tensor | None, **attrs):
        """A reduction or (Un)Squeeze with ``axes`` given the way this opset wants it."""
        since = _AXES_INPUT_SINCE[op_type]
        if axes is None:
            return self.op(op_type, x, **attrs)
        if self.opset >= since:
            return self.op(op_type, x, axes if isinstance(axes, gs.Tensor) else self.ints(axes), **attrs)
        if isinstance(axes, gs.Tensor):
            raise ValueError(f"{op_type} before opset {since} needs static axes")
        return self.op(op_type, x, axes=list(axes), **attrs)

    def reduce_sum(self, x, axes, keepdims: bool = True):
        if not isinstance(axes, gs.Tensor) and len(axes) == 0:
            return x
        return self.axes_op("ReduceSum", x, axes, keepdims=int(keepdims))

    def unsqueeze(self, x, axes: Sequence[int]):
        return self.axes_op("Unsqueeze", x, axes)

    def squeeze(self, x, axes: Sequence[int]):
        return self.axes_op("Squeeze", x, axes)


_INT64_RESULT = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
_BOOL_RESULT = frozenset(
    {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf"}
)


_SAME_AS_FIRST = frozenset(
    [
        "Abs",
        "Acos",
        "Acosh",
        "Add",
        "Asin",
        "Asinh",
        "Atan",
        "Atanh",
        "AveragePool",
        "BatchNormalization",
        "Ceil",
        "Clip",
        "Concat",
        "Conv",
        "ConvTranspose",
        "Cos",
        "Cosh",
        "CumSum",
        "DepthToSpace",
        "Div",
        "Einsum",
        "Elu",
        "Erf",
        "Exp",
        "Expand",
        "Flatten",
        "Floor",
        "Gather",
        "GatherElements",
        "GatherND",
        "Gemm",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "HardSigmoid",
        "Identity",
        "InstanceNormalization",
        "LayerNormalization",
        "LeakyRelu",
        "Log",
        "LogSoftmax",
        "MatMul",
        "Max",
        "MaxPool",
        "Mean",
        "Min",
        "Mul",
        "Neg",
        "Pad",
        "Pow",
        "Range",
        "Reciprocal",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceMax",
        "ReduceMean",
        "ReduceMin",
        "ReduceProd",
        "ReduceSum",
        "ReduceSumSquare",
        "Relu",
        "Reshape",
        "Resize",
        "Round",
        "ScatterElements",
        "ScatterND",
        "Sigmoid",
        "Sign",
        "Sin",
        "Sinh",
        "Slice",
        "Softmax",
        "Softplus",
        "Softsign",
        "SpaceToDepth",
        "Split",
        "Sqrt",
        "Squeeze",
        "Sub",
        "Sum",
        "Tan",
        "Tanh",
        "Tile",
        "Transpose",
        "Trilu",
        "Unsqueeze",
    ]
)


def _result_dtype(op_type: str, inputs: Sequence[gs.Tensor], attrs: dict) -> np.dtype | None:
    """The element type of a node's first output where the builder can tell, so later
    rules can make constants of the right type without shape inference."""
    from onnx import helper

    if op_type in _INT64_RESULT:
        return np.dtype(np.int64)
    if op_type in _BOOL_RESULT:
        return np.dtype(bool)
    if op_type == "Cast":
        return helper.tensor_dtype_to_np_dtype(attrs["to"])
    if op_type == "ConstantOfShape" and "value" in attrs:
        value = attrs["value"]
        return (
            value.values.dtype if isinstance(value, gs.Constant) else helper.tensor_dtype_to_np_dtype(value.data_type)
        )
    if op_type in ("CastLike", "Where"):
        return inputs[1].dtype
    if op_type == "OneHot":
        return inputs[2].dtype
    if op_type in _SAME_AS_FIRST and inputs and not inputs[0].is_empty():
        return inputs[0].dtype
    return None  # unknown here: leave it to shape inference rather than guess wrong


def is_zeros(x: gs.Tensor) -> bool:
    """Whether ``x`` is made by a ConstantOfShape of zeros (``Builder.zeros_like``)."""
    if not isinstance(x, gs.Variable) or len(x.inputs) != 1 or x.inputs[0].op != "ConstantOfShape":
        return False
    value = x.inputs[0].attrs.get("value")
    if value is None:
        return True  # ConstantOfShape's default: a float 0
    if isinstance(value, gs.Constant):
        return not np.any(value.values)
    from onnx import numpy_helper

    return not np.any(numpy_helper.to_array(value))


def static_shape(x: gs.Tensor) -> tuple[int, ...] | None:
    """The shape as integers, or None if any dim is symbolic or unknown."""
    if isinstance(x, gs.Constant):
        return tuple(x.shape)
    shape = x.shape
    if shape is None or not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


def rank(x: gs.Tensor) -> int | None:
    shape = x.shape
    return None if shape is None else len(shape)
