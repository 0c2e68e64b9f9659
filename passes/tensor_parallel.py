"""The tensor_parallel pass: the layers a group of processes splits between them, marked in the
forward program (Megatron-LM's column and row splits)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import is_parameter
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.placement.buckets import marker_call, marker_function
from graphforge.program import TensorParallelRole
from graphforge.shapes import infer_shapes

#: ops applied elementwise to one tensor (other inputs constants): what may sit between the two
#: projections of a split block, computed on each member's part of the hidden features
ELEMENTWISE = frozenset(
    {"Relu", "Tanh", "Sigmoid", "Gelu", "Erf", "Mul", "Add", "Div", "Sub", "Pow", "Exp", "Softplus", "Elu", "Selu",
     "LeakyRelu", "HardSigmoid", "HardSwish", "Mish", "Swish", "Cast", "Identity", "Dropout"}
)  # fmt: skip


@dataclass(frozen=True)
class _Projection:
    node: gs.Node
    weight: gs.Constant
    axis_in: int  # the weight's axis of input features
    bias: gs.Constant | None = None  # Gemm's C, or the parameter of the Add after a MatMul
    add: gs.Node | None = None


@dataclass(frozen=True)
class TensorParallel(Pass):
    """Split pairs of projections across a group of ``size`` processes, as Megatron-LM's MLP
    blocks: the first column-parallel (each member computes a 1/size slice of the hidden
    features), the elementwise activation between local to each member, the second
    row-parallel (each member's partial output, summed over the group). Found on the graph,
    not on names: a MatMul or Gemm whose weight is a 2-D parameter (and its bias), a chain of
    elementwise ops with one reader each, and a second such projection reading it.

    1. The first projection's input goes through ``graphforge.TensorParallelCopy`` (f), the
       second's output, before its bias, through ``graphforge.TensorParallelReduce`` (g): both
       Identity on one process, which runs the program as it was; their gradient rules make
       autodiff write the backward's collectives (g's gradient is f, f's is g).
    2. What each member holds a slice of is recorded (``graphforge.tensor_parallel``): the
       first weight along its output features, its bias, the second weight along its input
       features; the second bias stays whole, as everything else (norms, residuals).
    3. A hidden size not divisible by ``size`` is refused, naming the node; ``skip`` names
       projections (their nodes) left replicated; a model with no such pair is refused.
    4. ``rank``: the program of that member (0 .. size-1): each split parameter is its slice,
       and the shapes after it are inferred again, so that the passes after it (autodiff,
       the optimizer) write the member's backward and update with its shapes, as
       onnxruntime's Megatron transformer splits the forward graph before building the
       gradient graph. Without ``rank`` the program is the whole model with the markers: one
       process runs it unchanged, and the members' states join into its state
       (graphforge.distributed.tensor_parallel).

    It runs on the forward program, before ``autodiff``. Attention (heads split among the
    members), embeddings and the vocabulary-parallel loss are not split by it yet.
    """

    name = "tensor_parallel"
    refuses = (Fact.GRADIENTS,)

    size: int = 2
    skip: tuple[str, ...] = ()
    rank: int | None = None

    def __post_init__(self):
        check_number(self, "size", at_least=1)
        check_number(self, "rank", at_least=0, below=self.size)

    def run(self, model: Model) -> PassResult:
        model = infer_shapes(model, in_place=True)
        graph = model.graph
        blocks = _blocks(graph, set(self.skip))
        if not blocks:
            raise PassError(
                "tensor_parallel: no pair of projections (MatMul or Gemm on a 2-D parameter) with an elementwise "
                "activation between them was found (a weight or bias another layer shares is left whole); attention "
                "and embeddings are not split by this pass yet"
            )
        split: dict[str, int] = {}
        recorded = []
        copy_fn = marker_function(graph, roles.TENSOR_PARALLEL_COPY_OP, attribute="group")
        reduce_fn = marker_function(graph, roles.TENSOR_PARALLEL_REDUCE_OP, attribute="group")
        for index, block in enumerate(blocks):
            first, second = block.firsts[0], block.second
            hidden = first.weight.shape[1 - first.axis_in]
            if hidden % self.size:
                raise PassError(
                    f"tensor_parallel: node {first.node.name!r} makes {hidden} hidden features, which {self.size} "
                    "processes cannot split evenly"
                )
            column = []
            for projection in block.firsts:
                split[projection.weight.name] = 1 - projection.axis_in
                column.append(projection.weight.name)
                if projection.bias is not None:
                    split[projection.bias.name] = 0
                    column.append(projection.bias.name)
            split[second.weight.name] = second.axis_in
            copied = _copy_inputs(graph, [p.node for p in block.firsts], index)
            for node in block.between:
                if node.op == "Reshape":
                    _last_axis_from_data(graph, node)
            reduced = _reduce_output(graph, second, index)
            recorded.append({"column": column, "row": [second.weight.name], "copy": copied, "reduce": reduced})
        graph.functions.extend([copy_fn, reduce_fn])
        graph.toposort()
        if self.rank is not None:
            _keep_slices(model, split, self.rank, self.size, {id(b.second.node) for b in blocks})
            _own_dropout_streams(blocks, self.rank)
        role = TensorParallelRole(self.size, split, tuple(recorded), self.rank)
        roles.set_json(model, roles.TENSOR_PARALLEL, role.to_json())
        member = "" if self.rank is None else f" (the program of member {self.rank})"
        return PassResult(model, True, note=f"{len(blocks)} block(s) split across {self.size} processes{member}")


def _projection(node: gs.Node) -> _Projection | None:
    """``node`` as a projection on a 2-D parameter (MatMul x·W, Gemm with or without transB and
    a bias C), or None."""
    if node.op == "MatMul" and len(node.inputs) == 2:
        weight, axis_in = node.inputs[1], 0
        source = weight.inputs[0] if len(weight.inputs) == 1 else None
        if source is not None and source.op == "Transpose" and list(source.attrs.get("perm", [1, 0])) == [1, 0]:
            weight, axis_in = source.inputs[0], 1  # x·Wᵀ, as torch's dynamo exporter writes a Linear
        if is_parameter(weight) and len(weight.shape) == 2:
            add = _bias_add(node)
            return _Projection(node, weight, axis_in, add[0] if add else None, add[1] if add else None)
    if node.op == "Gemm" and not node.attrs.get("transA", 0) and len(node.inputs) >= 2:
        weight = node.inputs[1]
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if is_parameter(weight) and len(weight.shape) == 2 and (bias is None or is_parameter(bias)):
            if bias is not None and len(bias.shape) != 1:
                return None
            return _Projection(node, weight, 1 if node.attrs.get("transB", 0) else 0, bias)
    return None


def _bias_add(node: gs.Node) -> tuple[gs.Constant, gs.Node] | None:
    """The Add of a 1-D parameter right after a MatMul (its only reader), as exporters write a Linear's bias."""
    out = node.outputs[0]
    if len(out.outputs) != 1 or out.outputs[0].op != "Add":
        return None
    add = out.outputs[0]
    other = next((t for t in add.inputs if t is not out), None)
    if other is not None and is_parameter(other) and len(other.shape) == 1:
        return other, add
    return None


@dataclass(frozen=True)
class _Block:
    """Column-parallel projections (one, or a gated pair as SwiGLU's), the nodes between them
    and the row-parallel projection that reads what they make."""

    firsts: tuple[_Projection, ...]
    between: tuple[gs.Node, ...]
    second: _Projection


def _blocks(graph: gs.Graph, skip: set[str]) -> list[_Block]:
    """Each block: a projection whose input is computed, through elementwise ops and reshapes
    that keep the last axis, from the outputs of other projections only, and nothing else
    reads (except for its shape)."""
    found, used = [], set()
    for node in graph.nodes:
        second = _projection(node)
        if second is None or node.name in skip or id(node) in used:
            continue
        block = _block_before(second, skip, used)
        if block is not None:
            found.append(block)
            used.update(id(p.node) for p in [*block.firsts, block.second])
    return found


def _block_before(second: _Projection, skip: set[str], used: set[int]) -> _Block | None:
    """The block ``second`` ends, walking back from its input, or None."""
    firsts: dict[int, _Projection] = {}
    between: dict[int, gs.Node] = {}
    stack, seen = [second.node.inputs[0]], set()
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if isinstance(tensor, gs.Constant) or len(tensor.inputs) != 1:
            return None  # a graph input (or a constant) feeds it directly: not computed by a projection
        producer = tensor.inputs[0]
        if producer.op == "Constant":
            continue
        first = _projection_ending(producer)
        if first is not None:
            if first.node.name in skip or id(first.node) in used or first.node is second.node:
                return None
            firsts[id(first.node)] = first
            continue
        if not _keeps_features(producer):
            return None
        between[id(producer)] = producer
        sources = producer.inputs[:1] if producer.op == "Reshape" else producer.inputs
        stack.extend(t for t in sources if _constant_shape(t) is None)
    if not firsts:
        return None
    hidden = {f.weight.shape[1 - f.axis_in] for f in firsts.values()}
    if len(hidden) != 1 or second.weight.shape[second.axis_in] not in hidden:
        return None
    if not all(_read_only_by(p) for p in [*firsts.values(), second]):
        return None  # a weight shared with other layers (or a tied bias) stays whole
    inside = {*between, id(second.node)}
    for tensor in [*(t for n in between.values() for t in n.outputs), *(_end(f).outputs[0] for f in firsts.values())]:
        if any(id(r) not in inside and r.op != "Shape" for r in tensor.outputs):
            return None  # read outside the block: each member would hand on its slice only
    return _Block(tuple(firsts.values()), tuple(between.values()), second)


def _projection_ending(node: gs.Node) -> _Projection | None:
    """The projection ``node`` ends: a MatMul or Gemm on a 2-D parameter, or the bias Add after a MatMul."""
    if node.op == "Add":
        for t in node.inputs:
            if len(t.inputs) == 1 and t.inputs[0].op == "MatMul":
                made = _projection(t.inputs[0])
                if made is not None and made.add is node:
                    return made
        return None
    made = _projection(node)
    return made if made is not None and made.add is None else None


def _read_only_by(projection: _Projection) -> bool:
    """Whether the projection's weight and bias are read by it alone (a member slices them)."""
    own = {id(projection.node), *([id(projection.add)] if projection.add is not None else [])}
    for parameter in [projection.weight, *([projection.bias] if projection.bias is not None else [])]:
        for reader in parameter.outputs:
            if reader.op == "Transpose" and all(id(r) in own for r in reader.outputs[0].outputs):
                continue
            if id(reader) not in own:
                return False
    return True


def _end(projection: _Projection) -> gs.Node:
    return projection.add or projection.node


def _keeps_features(node: gs.Node) -> bool:
    """Whether each member can compute ``node`` on its part of the last axis: an elementwise
    op whose constants do not vary along it, or a Reshape that keeps it."""
    if node.op == "Reshape":
        data, out = node.inputs[0], node.outputs[0]
        return bool(data.shape and out.shape) and isinstance(data.shape[-1], int) and data.shape[-1] == out.shape[-1]
    if node.op not in ELEMENTWISE:
        return False
    return not any((shape := _constant_shape(t)) and shape[-1] != 1 for t in node.inputs)


def _constant_shape(tensor: gs.Tensor) -> tuple | None:
    """The shape of a constant (an initializer, or a Constant node's output), or None for a computed tensor."""
    if isinstance(tensor, gs.Constant):
        return tuple(tensor.shape)
    if len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant":
        value = tensor.inputs[0].attrs.get("value")
        return tuple(value.shape) if value is not None and hasattr(value, "shape") else ()
    return None


def _copy_inputs(graph: gs.Graph, nodes: list[gs.Node], group: int) -> list[str]:
    """f before the column projections' inputs, one per input (their other readers keep the input itself)."""
    copies: dict[int, gs.Variable] = {}
    for node in nodes:
        source = node.inputs[0]
        copied = copies.get(id(source))
        if copied is None:
            copied = copies[id(source)] = gs.Variable(
                f"{source.name}/tensor_parallel_copy", dtype=source.dtype, shape=source.shape
            )
            graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_COPY_OP, source, copied, group, attribute="group"))
        node.inputs[0] = copied
    return [c.name for c in copies.values()]


def _last_axis_from_data(graph: gs.Graph, node: gs.Node) -> None:
    """A Reshape between the projections keeps the last axis, whose size an exporter often
    wrote as a constant (GPT-2's ``view(size[:-1] + (nf,))``): its target's last entry is
    taken from the data at run time instead, so that each member's program reshapes its part
    (the runtime's specialization folds it back into a constant)."""
    data, target = node.inputs[0], node.inputs[1]
    stem = f"{node.name or node.outputs[0].name}/tensor_parallel"
    shape = gs.Variable(f"{stem}/data_shape", dtype=np.int64, shape=[len(data.shape)])
    last = gs.Variable(f"{stem}/last", dtype=np.int64, shape=[1])
    head = gs.Variable(f"{stem}/head", dtype=np.int64)
    joined = gs.Variable(f"{stem}/shape", dtype=np.int64)
    ints = lambda name, values: gs.Constant(f"{stem}/{name}", np.array(values, np.int64))  # noqa: E731
    graph.nodes += [
        gs.Node("Shape", inputs=[data], outputs=[shape]),
        gs.Node("Slice", inputs=[shape, ints("from", [-1]), ints("to", [2**62]), ints("axis", [0])], outputs=[last]),
        gs.Node("Slice", inputs=[target, ints("start", [0]), ints("end", [-1]), ints("axis0", [0])], outputs=[head]),
        gs.Node("Concat", inputs=[head, last], outputs=[joined], attrs={"axis": 0}),
    ]
    node.inputs[1] = joined


def _reduce_output(graph: gs.Graph, second: _Projection, group: int) -> str:
    """g after the second projection's product, before its bias (added once, to the sum)."""
    node = second.node
    bias = None
    if node.op == "Gemm" and len(node.inputs) > 2:  # the bias leaves the Gemm: added after the sum
        bias = node.inputs[2]
        beta = float(node.attrs.pop("beta", 1.0))
        node.inputs = node.inputs[:2]
    product = node.outputs[0]
    partial = gs.Variable(f"{product.name}/tensor_parallel_partial", dtype=product.dtype, shape=product.shape)
    node.outputs[0] = partial
    summed = gs.Variable(f"{product.name}/tensor_parallel_sum", dtype=product.dtype, shape=product.shape)
    graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_REDUCE_OP, partial, summed, group, attribute="group"))
    if bias is None:
        graph.nodes.append(gs.Node("Identity", inputs=[summed], outputs=[product]))
        return summed.name
    if beta != 1.0:
        scaled = gs.Variable(f"{bias.name}/tensor_parallel_beta", dtype=bias.dtype)
        graph.nodes.append(gs.Node("Mul", inputs=[bias, gs.Constant(f"{scaled.name}/c", _scalar(beta, bias))],
                                   outputs=[scaled]))  # fmt: skip
        bias = scaled
    graph.nodes.append(gs.Node("Add", inputs=[summed, bias], outputs=[product]))
    return summed.name


def _keep_slices(model: Model, split: dict[str, int], rank: int, size: int, ends: set[int]) -> None:
    """Member ``rank``'s slice of each split parameter, and the shapes of what is computed
    from them inferred again, up to the row-parallel projections (``ends``: their nodes),
    whose outputs keep their shapes. Only those: an exporter's shapes of the rest may be more
    than onnx's inference can tell again (torch's dynamo exporter's, after computed slices)."""
    graph = model.graph
    tensors = graph.tensors()
    stack = []
    for name, axis in split.items():
        constant = tensors[name]
        constant.values = np.ascontiguousarray(np.split(np.asarray(constant.values), size, axis=axis)[rank])
        stack.append(constant)
    seen = set()
    while stack:
        tensor = stack.pop()
        for node in tensor.outputs:
            if id(node) in seen or id(node) in ends or node.op == "Shape":
                continue
            seen.add(id(node))
            for out in node.outputs:
                out.shape = None
                stack.append(out)
    infer_shapes(model, in_place=True)


def _own_dropout_streams(blocks: list[_Block], rank: int) -> None:
    """A Dropout between a block's projections drops elements of the member's slice: each
    member must draw masks of its own, as Megatron-LM draws them inside a split region from a
    generator per rank (outside, every member draws the same). graphforge's seeded dropout
    keys a node's stream by its output's name (runtime/dropout.py), so the member's output gets
    a name of its own; nothing outside the block reads it."""
    for block in blocks:
        for node in block.between:
            if node.op == "Dropout":
                node.outputs[0].name = f"{node.outputs[0].name}/tensor_parallel_member{rank}"


def _scalar(value: float, like: gs.Tensor) -> np.ndarray:
    return np.array(value, dtype=like.dtype or np.float32)
