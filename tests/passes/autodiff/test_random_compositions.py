"""Random small DAGs of differentiable ops (hypothesis): the autodiff pass's gradients with respect
to every graph input must match central differences of the forward model in float64.

Each example draws a few leaf inputs and up to eight ops; the second operand of a binary op is
either an existing tensor of a compatible shape or a fresh input shaped to broadcast against the
first (a suffix, some dims set to 1, or an extra leading dim). Every tensor nothing reads feeds
the loss, sum(t * R_t) with fixed random R_t, so every op's gradient is exercised.
"""

from __future__ import annotations

import numpy as np
import onnx
from gradcheck import numeric_gradients
from graphforge.passes import Autodiff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import graphforge

OPSET = 18
UNARY = ["Tanh", "Sigmoid", "Exp"]
BINARY = ["Add", "Mul", "Sub", "Div"]
OPS = [*UNARY, *BINARY, "MatMul", "Transpose", "ReduceSum", "ReduceMean", "Reshape", "Concat", "Split", "Softmax"]
dims = st.sampled_from([2, 3, 1])  # 2 first: hypothesis leans towards the first choice, and all-1 shapes test little


class RandomGraph:
    """The model being drawn: nodes, leaf inputs, constants, and each tensor's static shape."""

    def __init__(self, draw):
        self.draw = draw
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[str] = []
        self.initializers: list[onnx.TensorProto] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.read: set[str] = set()

    # ------------------------------------------------------------------ bookkeeping

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{len(self.shapes) + len(self.initializers)}"

    def leaf(self, shape: tuple[int, ...]) -> str:
        name = self.fresh("in")
        self.inputs.append(name)
        self.shapes[name] = tuple(shape)
        return name

    def const(self, value: np.ndarray) -> str:
        name = self.fresh("c")
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def emit(self, op: str, inputs: list[str], shapes: list[tuple[int, ...]], **attrs) -> list[str]:
        outputs = [self.fresh("t") + f"_{k}" for k in range(len(shapes))]
        self.nodes.append(helper.make_node(op, inputs, outputs, **attrs))
        self.read.update(inputs)
        for name, shape in zip(outputs, shapes, strict=True):
            self.shapes[name] = tuple(int(d) for d in shape)
        return outputs

    def pick(self, min_rank: int = 0) -> str:
        names = [n for n, s in self.shapes.items() if len(s) >= min_rank]
        return (
            self.draw(st.sampled_from(names)) if names else self.leaf(self.draw(st.lists(dims, min_size=2, max_size=3)))
        )

    def broadcast_partner(self, shape: tuple[int, ...]) -> str:
        """An existing tensor that broadcasts with ``shape``, or a fresh input that does."""
        existing = [n for n, s in self.shapes.items() if _broadcasts(s, shape)]
        if existing and self.draw(st.booleans()):
            return self.draw(st.sampled_from(existing))
        keep = self.draw(st.integers(0, len(shape)))
        partner = [d if self.draw(st.booleans()) else 1 for d in shape[len(shape) - keep :]]
        if self.draw(st.integers(0, 4)) == 0 and len(shape) < 3:
            partner = [self.draw(dims), *([1] * (len(shape) - keep)), *partner]
        return self.leaf(tuple(partner))

    # ------------------------------------------------------------------ one op each

    def unary(self, op: str) -> None:
        x = self.pick()
        if op == "Exp":  # keep Exp's argument small: exp(tanh(x))
            (x,) = self.emit("Tanh", [x], [self.shapes[x]])
        self.emit(op, [x], [self.shapes[x]])

    def binary(self, op: str) -> None:
        a = self.pick()
        b = self.broadcast_partner(self.shapes[a])
        if op == "Div":  # divide by something positive: sigmoid(b) + 0.5
            (s,) = self.emit("Sigmoid", [b], [self.shapes[b]])
            (b,) = self.emit("Add", [s, self.const(np.array(0.5))], [self.shapes[b]])
        self.emit(op, [a, b], [np.broadcast_shapes(self.shapes[a], self.shapes[b])])

    def matmul(self) -> None:
        a = self.pick(min_rank=1)
        k, n = self.shapes[a][-1], self.draw(dims)
        candidates = [name for name, s in self.shapes.items() if len(s) == 2 and s[0] == k]
        b = self.draw(st.sampled_from(candidates)) if candidates and self.draw(st.booleans()) else self.leaf((k, n))
        self.emit("MatMul", [a, b], [np.matmul(np.zeros(self.shapes[a]), np.zeros(self.shapes[b])).shape])

    def transpose(self) -> None:
        x = self.pick(min_rank=2)
        perm = self.draw(st.permutations(range(len(self.shapes[x]))))
        self.emit("Transpose", [x], [tuple(self.shapes[x][p] for p in perm)], perm=list(perm))

    def reduce(self, op: str) -> None:
        x = self.pick(min_rank=1)
        rank = len(self.shapes[x])
        axes = sorted(self.draw(st.sets(st.integers(-rank, rank - 1), min_size=1, max_size=rank)))
        axes = sorted({a % rank for a in axes})
        keepdims = self.draw(st.booleans())
        shape = np.sum(np.zeros(self.shapes[x]), axis=tuple(axes), keepdims=keepdims).shape
        self.emit(op, [x, self.const(np.array(axes, np.int64))], [shape], keepdims=int(keepdims))

    def reshape(self) -> None:
        x = self.pick(min_rank=1)
        shape = list(self.shapes[x])
        how = self.draw(st.sampled_from(["flatten", "merge", "unsqueeze"]))
        if how == "flatten" or len(shape) < 2:
            target, spec = [int(np.prod(shape))], [-1]
        elif how == "merge":
            i = self.draw(st.integers(0, len(shape) - 2))
            target = [*shape[:i], shape[i] * shape[i + 1], *shape[i + 2 :]]
            spec = [-1 if j == i else d for j, d in enumerate(target)]
        else:
            i = self.draw(st.integers(0, len(shape)))
            target = spec = [*shape[:i], 1, *shape[i:]]
        self.emit("Reshape", [x, self.const(np.array(spec, np.int64))], [tuple(target)])

    def concat(self) -> None:
        a = self.pick(min_rank=1)
        shape = self.shapes[a]
        axis = self.draw(st.integers(0, len(shape) - 1))
        fits = [n for n, s in self.shapes.items() if len(s) == len(shape) and _equal_but(s, shape, axis)]
        b = self.draw(st.sampled_from(fits))  # a itself always fits: its gradient then sums two parts
        out = list(shape)
        out[axis] += self.shapes[b][axis]
        self.emit("Concat", [a, b], [tuple(out)], axis=axis - len(shape) * self.draw(st.booleans()))

    def split(self) -> None:
        candidates = [n for n, s in self.shapes.items() if any(d >= 2 for d in s)]
        if not candidates:
            return self.unary("Tanh")
        x = self.draw(st.sampled_from(candidates))
        shape = self.shapes[x]
        axis = self.draw(st.sampled_from([i for i, d in enumerate(shape) if d >= 2]))
        first = self.draw(st.integers(1, shape[axis] - 1))
        parts = [tuple(first if i == axis else d for i, d in enumerate(shape))]
        parts.append(tuple(shape[axis] - first if i == axis else d for i, d in enumerate(shape)))
        self.emit("Split", [x, self.const(np.array([first, shape[axis] - first], np.int64))], parts, axis=axis)
        return None

    def softmax(self) -> None:
        x = self.pick(min_rank=1)
        rank = len(self.shapes[x])
        self.emit("Softmax", [x], [self.shapes[x]], axis=self.draw(st.integers(-rank, rank - 1)))

    def step(self, op: str) -> None:
        if op in UNARY:
            self.unary(op)
        elif op in BINARY:
            self.binary(op)
        elif op in ("ReduceSum", "ReduceMean"):
            self.reduce(op)
        else:
            getattr(self, op.lower())()

    # ------------------------------------------------------------------ the model

    def model(self, seed: int) -> onnx.ModelProto:
        """loss = sum over the tensors nothing reads of sum(t * R_t)."""
        rng = np.random.default_rng(seed)
        sinks = [n for n in self.shapes if n not in self.read]
        terms = []
        for name in sinks:
            r = self.const(rng.standard_normal(self.shapes[name]))
            (weighted,) = self.emit("Mul", [name, r], [self.shapes[name]])
            (term,) = self.emit("ReduceSum", [weighted], [()], keepdims=0)
            terms.append(term)
        self.nodes.append(helper.make_node("Sum", terms, ["loss"]))
        graph = helper.make_graph(
            self.nodes,
            "random",
            [helper.make_tensor_value_info(n, TensorProto.DOUBLE, self.shapes[n]) for n in self.inputs],
            [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
            self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def _equal_but(a: tuple[int, ...], b: tuple[int, ...], axis: int) -> bool:
    return all(x == y for i, (x, y) in enumerate(zip(a, b, strict=True)) if i != axis)


@st.composite
def random_graphs(draw) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[str]]:
    g = RandomGraph(draw)
    for _ in range(draw(st.integers(1, 2))):
        g.leaf(tuple(draw(st.lists(dims, min_size=1, max_size=3))))
    # a prefix of a permutation: several different ops per example, each op in about half of them
    ops = draw(st.permutations(OPS))[: draw(st.integers(4, 10))]
    for op in ops:
        g.step(op)
    seed = draw(st.integers(0, 2**16))
    model = g.model(seed)
    rng = np.random.default_rng(seed + 1)
    feeds = {name: rng.uniform(-1.5, 1.5, g.shapes[name]) for name in g.inputs}
    return model, feeds, list(g.inputs)


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_composition_gradients_match_central_differences(case):
    model, feeds, inputs = case
    result = graphforge.compile(model, [Autodiff(trainable=(), inputs=tuple(inputs))])
    session = graphforge.create_session(result.model, providers=["CPUExecutionProvider"])
    analytic = dict(zip(inputs, session.run([f"{n}_grad" for n in inputs], feeds), strict=True))
    numeric = numeric_gradients(model, feeds, inputs, eps=1e-6)
    scale = max(1.0, *(float(np.abs(g).max()) for g in numeric.values()))
    for name in inputs:
        assert analytic[name].shape == feeds[name].shape, name
        np.testing.assert_allclose(
            analytic[name], numeric[name], rtol=1e-5, atol=1e-6 * scale, err_msg=f"gradient of {name}\n{model.graph}"
        )
