"""The tensor_parallel pass: the layers a group of processes splits between them, marked in the
forward program (Megatron-LM's column and row splits)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import is_parameter
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.placement.buckets import marker_call, marker_function
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

    It runs on the forward program, before ``autodiff``. Attention (heads split among the
    members), embeddings and the vocabulary-parallel loss are not split by it yet, and the
    runtime that runs one program per member (issue 40) is to come: today the program runs on
    one process, unchanged.
    """

    name = "tensor_parallel"
    refuses = (Fact.GRADIENTS,)

    size: int = 2
    skip: tuple[str, ...] = ()

    def __post_init__(self):
        check_number(self, "size", at_least=1)

    def run(self, model: Model) -> PassResult:
        model = infer_shapes(model, in_place=True)
        graph = model.graph
        blocks = _blocks(graph, set(self.skip))
        if not blocks:
            raise PassError(
                "tensor_parallel: no pair of projections (MatMul or Gemm on a 2-D parameter) with an elementwise "
                "activation between them was found; attention and embeddings are not split by this pass yet"
            )
        split: dict[str, int] = {}
        recorded = []
        copy_fn = marker_function(graph, roles.TENSOR_PARALLEL_COPY_OP, attribute="group")
        reduce_fn = marker_function(graph, roles.TENSOR_PARALLEL_REDUCE_OP, attribute="group")
        for index, (first, second) in enumerate(blocks):
            hidden = first.weight.shape[1 - first.axis_in]
            if hidden % self.size:
                raise PassError(
                    f"tensor_parallel: node {first.node.name!r} makes {hidden} hidden features, which {self.size} "
                    "processes cannot split evenly"
                )
            split[first.weight.name] = 1 - first.axis_in
            if first.bias is not None:
                split[first.bias.name] = 0
            split[second.weight.name] = second.axis_in
            copied = _copy_input(graph, first.node, index)
            reduced = _reduce_output(graph, second, index)
            recorded.append(
                {
                    "column": [first.weight.name, *([first.bias.name] if first.bias is not None else [])],
                    "row": [second.weight.name],
                    "copy": copied,
                    "reduce": reduced,
                }
            )
        graph.functions.extend([copy_fn, reduce_fn])
        graph.toposort()
        model.metadata[roles.TENSOR_PARALLEL] = json.dumps({"size": self.size, "blocks": recorded, "split": split})
        return PassResult(model, True, note=f"{len(blocks)} block(s) split across {self.size} processes")


def _projection(node: gs.Node) -> _Projection | None:
    """``node`` as a projection on a 2-D parameter (MatMul x·W, Gemm with or without transB and
    a bias C), or None."""
    if node.op == "MatMul" and len(node.inputs) == 2:
        weight = node.inputs[1]
        if is_parameter(weight) and len(weight.shape) == 2:
            add = _bias_add(node)
            return _Projection(node, weight, 0, add[0] if add else None, add[1] if add else None)
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


def _blocks(graph: gs.Graph, skip: set[str]) -> list[tuple[_Projection, _Projection]]:
    """Each (first, second) pair of projections with only an elementwise chain between them."""
    found, used = [], set()
    for node in graph.nodes:
        first = _projection(node)
        if first is None or node.name in skip or id(node) in used:
            continue
        end = first.add or first.node
        current = end.outputs[0]
        while True:
            readers = current.outputs
            if len(readers) != 1:
                break
            reader = readers[0]
            second = _projection(reader)
            if second is not None and reader.inputs[0] is current:
                if reader.name not in skip and id(reader) not in used:
                    found.append((first, second))
                    used.update({id(node), id(reader)})
                break
            if reader.op not in ELEMENTWISE or any(
                t is not current and not isinstance(t, gs.Constant) for t in reader.inputs
            ):
                break
            current = reader.outputs[0]
    return found


def _copy_input(graph: gs.Graph, node: gs.Node, group: int) -> str:
    """f before ``node``'s input (its other readers keep the input itself)."""
    source = node.inputs[0]
    copied = gs.Variable(f"{source.name}/tensor_parallel_copy", dtype=source.dtype, shape=source.shape)
    graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_COPY_OP, source, copied, group, attribute="group"))
    node.inputs[0] = copied
    return copied.name


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


def _scalar(value: float, like: gs.Tensor) -> np.ndarray:
    return np.array(value, dtype=like.dtype or np.float32)
