"""Where the split axis runs through a tensor-parallel block, and what a member's program must
change for it: the tensor_parallel pass's analysis of the nodes between a block's column and
row projections (passes/tensor_parallel.py).

Every tensor between the projections carries exactly one axis that the members split: the
column projections' output features at first, then (through an attention's reshapes and
transposes) the heads, then the features again where the heads are merged. :class:`Axes`
follows that axis node by node on the shapes of a probe (the model specialized to small
distinct sizes of its symbolic dims), and records what each member must rewrite: a reshape's
or an expand's target entry for the split axis (a constant the exporter wrote, such as the
number of heads), a Split's sizes, an Attention's head counts. A node that would mix the
members' parts (a reduction over the split axis, a concatenation with a whole tensor, a
contraction over it) ends the analysis with the reason, naming the node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.specialize import Specialize

from graphforge.constants import constant_value
from graphforge.errors import GraphforgeError, PassError
from graphforge.graph import Model
from graphforge.program import member_range

#: distinct small sizes for the symbolic dims of the probe: a reshape's axes are told apart by
#: the products of the sizes before them, which these keep apart from the model's own sizes
PROBE_SIZES = (5, 7, 11, 13, 17, 19, 23)

#: ops computed element by element (with broadcasting) from their inputs
ELEMENTWISE = frozenset(
    {"Relu", "Tanh", "Sigmoid", "Gelu", "Erf", "Mul", "Add", "Div", "Sub", "Pow", "Exp", "Log", "Softplus", "Elu",
     "Selu", "LeakyRelu", "HardSigmoid", "HardSwish", "Mish", "Swish", "Cast", "Identity", "Dropout", "Neg",
     "Sqrt", "Reciprocal", "Where", "Max", "Min", "Clip", "Abs", "Sin", "Cos", "Softsign", "Celu", "ThresholdedRelu",
     "PRelu", "IsNaN", "IsInf", "Not", "And", "Or", "Xor", "Equal", "Less", "Greater", "LessOrEqual",
     "GreaterOrEqual", "Sign", "Floor", "Ceil", "Round", "Mod"}
)  # fmt: skip
#: reductions whose axes may not include the split one
REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL2"})
#: ops that only rearrange the elements: the split axis goes where the sizes before it say
REARRANGING = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})


class Unsplittable(Exception):
    """The block cannot be split: ``str(self)`` says why, naming the node."""


class NotDivisible(Unsplittable):
    """A size of the block (features, heads) that the group cannot split evenly: ``count``."""

    def __init__(self, message: str, count: int):
        super().__init__(message)
        self.count = count


class NeedsSections(Exception):
    """A column projection's output is cut into sections (a fused QKV's Split): the analysis
    starts again with each member taking its part of every section."""

    def __init__(self, projection_output: str, sections: tuple[int, ...]):
        super().__init__(projection_output, sections)
        self.output, self.sections = projection_output, sections


def probe_shapes(model: Model) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape with the inputs' symbolic dims at distinct small sizes (an
    unnamed one named for the probe), from the model specialized to them; tensors whose shape
    stays unknown are absent."""
    probe = Model.from_proto(model.to_proto(values=False))
    unnamed = 0
    for tensor in probe.graph.inputs:
        if tensor.shape is None:
            continue
        shape = list(tensor.shape)
        for i, d in enumerate(shape):
            if d is None or (isinstance(d, int) and d < 0):
                shape[i], unnamed = f"tensor_parallel_probe_{unnamed}", unnamed + 1
        tensor.shape = shape
    names = sorted({d for t in probe.graph.inputs for d in (t.shape or ()) if isinstance(d, str)})
    dims = tuple(f"{n}={PROBE_SIZES[i % len(PROBE_SIZES)] + len(PROBE_SIZES) * 2 * (i // len(PROBE_SIZES))}"
                 for i, n in enumerate(names))  # fmt: skip
    if dims:
        try:
            probe = Specialize(dims=dims).run(probe).model
        except GraphforgeError as exc:
            raise PassError(f"tensor_parallel: the model's shapes at fixed dims ({', '.join(dims)}): {exc}") from None
    return {
        name: tuple(int(d) for d in t.shape)
        for name, t in probe.graph.tensors().items()
        if t.shape is not None and all(isinstance(d, int | np.integer) and d >= 0 for d in t.shape)
    }


#: a member's change to its program: (the graph, the group size, the member's rank) -> None
Edit = Callable[[gs.Graph, int, int], None]


@dataclass
class Axes:
    """The split axis of every tensor of a block, from its column projections' outputs
    (``start``: their last axis, the output features) to the row projection's input, and
    what a member rewrites on the way (``edits``).

    ``sections``: a column projection's output cut into sections along its features (a fused
    QKV projection's Split): each member takes its part of every section."""

    shapes: Mapping[str, tuple[int, ...]]
    size: int
    region: set[str]
    opset: int = 18
    axis: dict[str, int] = field(default_factory=dict)
    sections: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: a tensor that is still a column projection's output features, elementwise: -> that output
    origin: dict[str, str] = field(default_factory=dict)
    edits: list[Edit] = field(default_factory=list)
    #: sizes the group cannot split (what, the size), said once the block is known to be one (NotDivisible)
    indivisible: list[tuple[str, int]] = field(default_factory=list)

    def start(self, output: gs.Tensor, sections: tuple[int, ...] | None) -> None:
        shape = self._shape(output, output.inputs[0])
        self.axis[output.name] = len(shape) - 1
        self.sections[output.name] = sections or (shape[-1],)
        self.origin[output.name] = output.name
        for s in self.sections[output.name]:
            self._divisible(s, output.inputs[0], "output features")

    def split_like(self, parameter: gs.Tensor, output: gs.Tensor) -> None:
        """``parameter`` (1-D) is split as the column projection's ``output`` is, in its
        sections: its bias, added after a low-rank adapter's sum on it."""
        self.region.add(parameter.name)
        self.axis[parameter.name] = len(self._shape(parameter, None)) - 1
        self.sections[parameter.name] = self.sections[output.name]
        self.origin[parameter.name] = self.origin[output.name]

    def carry(self, node: gs.Node) -> None:
        """The split axis of ``node``'s outputs, from its inputs'; Unsplittable where none can be."""
        inside = [t for t in node.inputs if t.name in self.region]
        op = node.op
        if op in ELEMENTWISE or op == "CastLike":
            self._elementwise(node, inside if op != "CastLike" else node.inputs[:1])
        elif op in ("Softmax", "LogSoftmax"):
            a = self._only(node, inside)
            rank = len(self._shape(node.inputs[0], node))
            # before opset 13 it normalizes over every axis from ``axis`` (default 1) on
            flattened = self.opset < 13
            axis = self._normal(int(node.attrs.get("axis", 1 if flattened else -1)), rank)
            if a == axis or (flattened and a > axis):
                raise Unsplittable(f"{op} node {node.name!r} normalizes over the split axis")
            self._set(node.outputs[0], a, node.inputs[0])
        elif op == "Transpose":
            a = self._only(node, inside)
            rank = len(self._shape(node.inputs[0], node))
            perm = list(node.attrs.get("perm", range(rank - 1, -1, -1)))
            self._set(node.outputs[0], perm.index(a), node.inputs[0])
        elif op in REARRANGING:
            self._rearranged(node, self._only(node, inside))
        elif op == "Expand":
            self._expanded(node, self._only(node, inside))
        elif op == "MatMul":
            self._matmul(node, inside)
        elif op == "Split":
            self._split(node, self._only(node, inside))
        elif op == "Slice":
            self._sliced(node, self._only(node, inside))
        elif op == "Concat":
            self._concatenated(node, inside)
        elif op in REDUCTIONS:
            self._reduced(node, self._only(node, inside))
        elif op in ("LayerNormalization", "RMSNormalization"):
            self._normalized(node, self._only(node, inside))
        elif op == "Attention" and node.domain in (None, "", "ai.onnx"):
            self._attention(node)
        else:
            raise Unsplittable(f"{op} node {node.name!r} between the projections is not one the split can pass")

    # ------------------------------------------------------------------ the rules

    def _elementwise(self, node: gs.Node, inside: list[gs.Tensor]) -> None:
        out = self._shape(node.outputs[0], node)
        at = {len(out) - len(self._shape(t, node)) + self.axis[t.name] for t in inside}
        if len(at) != 1:
            raise Unsplittable(f"{node.op} node {node.name!r} combines tensors split along different axes")
        b = at.pop()
        for t in node.inputs:
            if t.name in self.region or t.is_empty() or node.op == "CastLike":
                continue
            shape = self._shape(t, node) if t.name in self.shapes or not _is_scalar(t) else ()
            k = b - (len(out) - len(shape))
            if 0 <= k < len(shape) and shape[k] != 1:
                raise Unsplittable(
                    f"{node.op} node {node.name!r} reads {t.name!r}, which varies along the split axis and is not split"
                )
        source = next(t for t in inside if len(out) - len(self._shape(t, node)) + self.axis[t.name] == b)
        self._same_sections(node, inside)
        if self._shape(source, node)[self.axis[source.name]] != out[b]:
            raise Unsplittable(f"{node.op} node {node.name!r} broadcasts the split axis")
        for o in node.outputs:
            if not o.is_empty() and o.outputs and o.name != node.outputs[0].name:
                raise Unsplittable(f"{node.op} node {node.name!r}'s second output is read")
        self._set(node.outputs[0], b, source)

    def _same_sections(self, node: gs.Node, inside: list[gs.Tensor]) -> None:
        """Two split tensors combined elementwise are cut alike: a projection's output summed with
        one cut in sections (a low-rank adapter's B·(x·Aᵀ) added to a fused QKV's product) takes
        the same sections (NeedsSections), else each member's part would hold other elements."""
        cuts = {self.sections[t.name] for t in inside}
        if len(cuts) == 1:
            return
        fused = [c for c in cuts if len(c) > 1]
        whole = [t for t in inside if len(self.sections[t.name]) == 1 and t.name in self.origin]
        if len(fused) == 1 and whole:
            raise NeedsSections(self.origin[whole[0].name], fused[0])
        raise Unsplittable(f"{node.op} node {node.name!r} combines tensors cut in different sections")

    def _rearranged(self, node: gs.Node, a: int) -> None:
        data = node.inputs[0]
        shape, out = self._shape(data, node), self._shape(node.outputs[0], node)
        before = math.prod(shape[:a])
        b = next((i for i in range(len(out)) if math.prod(out[:i]) == before and out[i] != 1), None)
        if b is None and a == len(shape) - 1 and out and out[-1] == shape[a]:
            # the last axis kept whole (logits to [-1, vocabulary]): rows stay rows, whatever the
            # dims before (the probe's may disagree: labels' dims are a dim of their own there)
            b = len(out) - 1
        if b is not None and out[b] % self.size:
            self.indivisible.append((
                f"{node.op} node {node.name!r} makes {out[b]} along the split axis ({shape} -> {out}: heads, or "
                f"features), which {self.size} processes cannot split evenly",
                out[b],
            ))  # fmt: skip
        if b is None:
            raise Unsplittable(
                f"{node.op} node {node.name!r} reshapes the split axis ({shape} -> {out}) so that the members' parts "
                "are not slices of one axis"
            )
        sections = self.sections[data.name]
        kept = out[b] == shape[a]
        if len(sections) > 1 and not kept:
            raise Unsplittable(f"{node.op} node {node.name!r} reshapes a fused projection's sections together")
        self._set(node.outputs[0], b, data, sections if kept else None)
        if node.op == "Reshape":
            self.edits.append(_target_entry(node, b, out[b], self.region))

    def _expanded(self, node: gs.Node, a: int) -> None:
        data = node.inputs[0]
        shape, out = self._shape(data, node), self._shape(node.outputs[0], node)
        b = a + len(out) - len(shape)
        if out[b] != shape[a]:
            raise Unsplittable(f"Expand node {node.name!r} broadcasts the split axis")
        self._set(node.outputs[0], b, data)
        self.edits.append(_target_entry(node, b, out[b], self.region, keep=(1, -1)))

    def _matmul(self, node: gs.Node, inside: list[gs.Tensor]) -> None:
        a_t, b_t = node.inputs[0], node.inputs[1]
        out = self._shape(node.outputs[0], node)
        sa, sb = self._shape(a_t, node), self._shape(b_t, node)
        if min(len(sa), len(sb)) < 2:
            raise Unsplittable(f"MatMul node {node.name!r} on a vector is not split")
        at = set()
        for t, shape, rows in ((a_t, sa, True), (b_t, sb, False)):
            if t.name not in self.region:
                continue
            a = self.axis[t.name]
            if a == len(shape) - (1 if rows else 2):
                raise Unsplittable(f"MatMul node {node.name!r} contracts the split axis (a row projection on data)")
            at.add(a + len(out) - len(shape))
        if len(at) != 1:
            raise Unsplittable(f"MatMul node {node.name!r} multiplies tensors split along different axes")
        b = at.pop()
        for t, shape in ((a_t, sa), (b_t, sb)):
            if t.name in self.region:
                continue
            k = b - (len(out) - len(shape))
            if k >= len(shape) - 2 or (k >= 0 and shape[k] != 1):
                raise Unsplittable(f"MatMul node {node.name!r} reads {t.name!r}, which is whole along the split axis")
        self._set(node.outputs[0], b, inside[0])

    def _split(self, node: gs.Node, a: int) -> None:
        data = node.inputs[0]
        shape = self._shape(data, node)
        axis = self._normal(int(node.attrs.get("axis", 0)), len(shape))
        if axis != a:
            for out in node.outputs:
                self._set(out, a, data)
            return
        sizes = tuple(self._shape(o, node)[a] for o in node.outputs)
        sections = self.sections[data.name]
        if sections != sizes:
            if len(sections) == 1 and data.name in self.origin:
                raise NeedsSections(self.origin[data.name], sizes)
            raise Unsplittable(f"Split node {node.name!r} cuts the split axis where no member's part ends")
        for out in node.outputs:
            self._set(out, a, data, None)
        self.edits.append(_split_sizes(node, sizes))

    def _sliced(self, node: gs.Node, a: int) -> None:
        data = node.inputs[0]
        if self._shape(data, node)[a] != self._shape(node.outputs[0], node)[a]:
            raise Unsplittable(f"Slice node {node.name!r} slices the split axis")
        self._set(node.outputs[0], a, data)

    def _concatenated(self, node: gs.Node, inside: list[gs.Tensor]) -> None:
        if len(inside) != len(node.inputs):
            raise Unsplittable(f"Concat node {node.name!r} joins a split tensor with a whole one")
        axes = {self.axis[t.name] for t in inside}
        rank = len(self._shape(node.outputs[0], node))
        if len(axes) != 1 or self._normal(int(node.attrs.get("axis", 0)), rank) in axes:
            raise Unsplittable(f"Concat node {node.name!r} joins along the split axis")
        self._set(node.outputs[0], axes.pop(), inside[0])

    def _reduced(self, node: gs.Node, a: int) -> None:
        data = node.inputs[0]
        shape, out = self._shape(data, node), self._shape(node.outputs[0], node)
        if int(node.attrs.get("keepdims", 1)):
            if out[a] != shape[a]:
                raise Unsplittable(f"{node.op} node {node.name!r} reduces over the split axis")
            self._set(node.outputs[0], a, data)
            return
        axes = node.attrs.get("axes")
        if axes is None and len(node.inputs) > 1 and not node.inputs[1].is_empty():
            axes = constant_value(node.inputs[1], self.opset)
        if axes is None:
            raise Unsplittable(f"{node.op} node {node.name!r} reduces over axes the split cannot tell")
        axes = {self._normal(int(x), len(shape)) for x in np.asarray(axes).reshape(-1)}
        if a in axes:
            raise Unsplittable(f"{node.op} node {node.name!r} reduces over the split axis")
        self._set(node.outputs[0], a - sum(x < a for x in axes), data)

    def _normalized(self, node: gs.Node, a: int) -> None:
        data = node.inputs[0]
        rank = len(self._shape(data, node))
        if a >= self._normal(int(node.attrs.get("axis", -1)), rank):
            raise Unsplittable(f"{node.op} node {node.name!r} normalizes over the split axis")
        if any(o.outputs for o in node.outputs[1:] if not o.is_empty()):
            raise Unsplittable(f"{node.op} node {node.name!r}'s statistics are read")
        self._set(node.outputs[0], a, data)

    def _attention(self, node: gs.Node) -> None:
        q, k, v = node.inputs[:3]
        rank = len(self._shape(q, node))
        heads = 2 if rank == 3 else 1
        for t in (q, k, v):
            if t.name not in self.region or self.axis[t.name] != heads:
                raise Unsplittable(f"Attention node {node.name!r} reads {t.name!r} whole, or split along other axes")
        rest = [t for t in node.inputs[3:] if not t.is_empty()]
        if any(t.name in self.region for t in rest) or any(not t.is_empty() for t in node.inputs[4:6]):
            raise Unsplittable(f"Attention node {node.name!r} reads a split mask or a key/value cache")
        if len(node.inputs) > 3 and not node.inputs[3].is_empty():
            mask = self._shape(node.inputs[3], node)
            if len(mask) == 4 and mask[1] != 1:
                raise Unsplittable(f"Attention node {node.name!r} reads a mask per head, which is not split")
        if any(o.outputs for o in node.outputs[1:] if not o.is_empty()):
            raise Unsplittable(f"Attention node {node.name!r}'s cache or scores are read")
        if rank == 3:
            for name in ("q_num_heads", "kv_num_heads"):
                self._divisible(int(node.attrs.get(name, 0)), node, name)
            self.edits.append(_attention_heads(node))
        else:
            self._divisible(self._shape(k, node)[1], node, "key/value heads")
        self._set(node.outputs[0], heads, q, None)

    # ------------------------------------------------------------------ helpers

    def _set(self, tensor: gs.Tensor, axis: int, source: gs.Tensor, sections=...) -> None:
        """``tensor`` is split along ``axis``; ``source`` the input it was computed from. Its
        sections are the source's where the axis kept its size (unless given), and so is
        the projection output it still is elementwise (``origin``)."""
        shape = self._shape(tensor, tensor.inputs[0] if tensor.inputs else None)
        kept = self._shape(source, None)[self.axis[source.name]] == shape[axis]
        if sections is ...:
            sections = self.sections[source.name] if kept else None
        self.axis[tensor.name] = axis
        self.sections[tensor.name] = sections or (shape[axis],)
        for count in self.sections[tensor.name]:
            self._divisible(count, tensor.inputs[0] if tensor.inputs else None, "elements along the split axis")
        if kept and source.name in self.origin and self.sections[tensor.name] == self.sections[source.name]:
            self.origin[tensor.name] = self.origin[source.name]

    def _shape(self, tensor: gs.Tensor, node: gs.Node | None) -> tuple[int, ...]:
        shape = self.shapes.get(tensor.name)
        if shape is None:
            where = f" (read by {node.op} node {node.name!r})" if node is not None else ""
            raise Unsplittable(f"the shape of {tensor.name!r}{where} is unknown at fixed dims")
        return shape

    def _only(self, node: gs.Node, inside: list[gs.Tensor]) -> int:
        if len(inside) != 1 or node.inputs[0] is not inside[0]:
            raise Unsplittable(f"{node.op} node {node.name!r} reads the split tensor where it cannot be split")
        return self.axis[inside[0].name]

    def _divisible(self, count: int, node: gs.Node | None, what: str) -> None:
        if count % self.size:
            where = f"node {node.name!r}" if node is not None else "a tensor"
            self.indivisible.append(
                (f"{where} has {count} {what}, which {self.size} processes cannot split evenly", count)
            )

    @staticmethod
    def _normal(axis: int, rank: int) -> int:
        return axis + rank if axis < 0 else axis


def _is_scalar(tensor: gs.Tensor) -> bool:
    value = constant_value(tensor)
    return value is not None and value.size == 1


# ---------------------------------------------------------------------- a member's edits


def _target_entry(node: gs.Node, index: int, whole: int, region: set[str], keep: tuple[int, ...] = (-1, 0)) -> Edit:
    """A member's Reshape (or Expand) writes its part of the split axis at ``index`` of its
    target: a constant entry (the exporter's number of heads, or of features) divided by the
    group size; an entry computed from a split tensor's shape is the member's already; one
    computed from a whole tensor's shape is divided at run time."""

    def edit(graph: gs.Graph, size: int, rank: int) -> None:
        target = node.inputs[1]
        value = constant_value(target, graph.opset)
        if value is not None:
            node.inputs[1] = _divided_constant(target, value, index, (size, rank), whole, keep, node)
            return
        piece, offset = target, index
        producer = target.inputs[0] if len(target.inputs) == 1 else None
        if producer is not None and producer.op == "Concat":
            for i, part in enumerate(producer.inputs):
                length = _length(part, graph.opset)
                if length is None:
                    break
                if offset < length:
                    value = constant_value(part, graph.opset)
                    if value is not None:  # the member's own Concat: another reshape may read this one
                        pieces = list(producer.inputs)
                        pieces[i] = _divided_constant(part, value, offset, (size, rank), whole, keep, node)
                        own = gs.Variable(f"{target.name}/tensor_parallel_member/{_label(node)}", dtype=np.int64)
                        graph.nodes.append(gs.Node("Concat", inputs=pieces, outputs=[own], attrs={"axis": 0}))
                        node.inputs[1] = own
                        return
                    piece = part
                    break
                offset -= length
        if _reads_shape_of(piece, region):
            return
        _divide_at_run_time(graph, node, index, (size, rank), whole)

    return edit


def _divided_constant(tensor, value, index, member, whole, keep, node) -> gs.Constant:
    """``value`` with its entry ``index`` (``whole``) the member's part of it (``member``: the
    group's size and the member's rank)."""
    value = np.array(value, dtype=np.int64).reshape(-1)
    if int(value[index]) not in keep:
        if int(value[index]) != whole:
            raise Unsplittable(
                f"{node.op} node {node.name!r}'s target holds {int(value[index])} where the split axis has {whole}"
            )
        value[index] = member_range(whole, member[1], member[0])[1]
    return gs.Constant(f"{tensor.name}/tensor_parallel_member/{_label(node)}", value)


def _length(tensor: gs.Tensor, opset: int) -> int | None:
    if tensor.shape is not None and len(tensor.shape) == 1 and isinstance(tensor.shape[0], int):
        return int(tensor.shape[0])
    value = constant_value(tensor, opset)
    return None if value is None else int(np.asarray(value).size)


def _reads_shape_of(tensor: gs.Tensor, region: set[str]) -> bool:
    """Whether ``tensor`` is computed from the shape of a tensor of the block (a member's own)."""
    stack, seen = [tensor], set()
    while stack:
        t = stack.pop()
        if id(t) in seen or len(t.inputs) != 1:
            continue
        seen.add(id(t))
        producer = t.inputs[0]
        if producer.op in ("Shape", "Size"):
            if producer.inputs[0].name in region:
                return True
            continue
        stack.extend(producer.inputs)
    return False


def _divide_at_run_time(graph: gs.Graph, node: gs.Node, index: int, member: tuple[int, int], whole: int) -> None:
    """The target's entry ``index`` divided by the group's size at run time; where the size
    does not divide ``whole`` (an uneven vocabulary), times the member's part of it over it."""
    size, rank = member
    target = node.inputs[1]
    length = _length(target, graph.opset)
    if length is None:
        raise Unsplittable(f"{node.op} node {node.name!r}'s target has an unknown length")
    divided = gs.Variable(f"{target.name}/tensor_parallel_member/{_label(node)}", dtype=np.int64, shape=[length])
    over = np.ones(length, np.int64)
    over[index] = size
    if whole % size:  # the member's count times the entry, over the whole
        times = np.ones(length, np.int64)
        times[index], over[index] = member_range(whole, rank, size)[1], whole
        scaled = gs.Variable(f"{divided.name}/times", dtype=np.int64, shape=[length])
        graph.nodes.append(gs.Node("Mul", inputs=[target, gs.Constant(f"{scaled.name}/by", times)], outputs=[scaled]))
        target = scaled
    graph.nodes.append(gs.Node("Div", inputs=[target, gs.Constant(f"{divided.name}/by", over)], outputs=[divided]))
    node.inputs[1] = divided


def _split_sizes(node: gs.Node, sizes: tuple[int, ...]) -> Edit:
    def edit(graph: gs.Graph, size: int, rank: int) -> None:
        if len(node.inputs) > 1 and not node.inputs[1].is_empty():
            node.inputs[1] = gs.Constant(
                f"{node.inputs[1].name}/tensor_parallel_member/{_label(node)}",
                np.array([s // size for s in sizes], np.int64),
            )
        elif "split" in node.attrs:
            node.attrs["split"] = [s // size for s in sizes]

    return edit


def _attention_heads(node: gs.Node) -> Edit:
    def edit(graph: gs.Graph, size: int, rank: int) -> None:
        for name in ("q_num_heads", "kv_num_heads"):
            node.attrs[name] = int(node.attrs[name]) // size

    return edit


def _label(node: gs.Node) -> str:
    return node.name or node.outputs[0].name
