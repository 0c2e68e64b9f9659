"""Projections on 2-D parameters (Linear layers as exporters write them: MatMul x·W or x·Wᵀ,
with or without a bias Add, the lora pass's sum between them; Gemm), which the tensor_parallel
pass splits."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.ir import is_parameter


@dataclass(frozen=True)
class Projection:
    """A MatMul or Gemm on a 2-D parameter: a Linear layer as exporters write it."""

    node: gs.Node
    weight: gs.Constant
    axis_in: int  # the weight's axis of input features
    bias: gs.Constant | None = None  # Gemm's C, or the parameter of the Add after a MatMul
    add: gs.Node | None = None
    #: the bias Add after a low-rank adapter's sum on the product (the lora pass adds
    #: y + scale·(x·Aᵀ)·Bᵀ between a MatMul and its bias Add); ``add`` is then None: the
    #: projection's own output is the product, and the bias is added after the adapter's
    adapted_add: gs.Node | None = None

    @property
    def end(self) -> gs.Node:
        """The node whose output is the projection's (its bias Add, where it has one)."""
        return self.add or self.node


def projection(node: gs.Node) -> Projection | None:
    """``node`` as a projection on a 2-D parameter (MatMul x·W, Gemm with or without transB and
    a bias C), or None."""
    if node.op == "MatMul" and len(node.inputs) == 2:
        weight, axis_in = node.inputs[1], 0
        source = weight.inputs[0] if len(weight.inputs) == 1 else None
        if source is not None and source.op == "Transpose" and list(source.attrs.get("perm", [1, 0])) == [1, 0]:
            weight, axis_in = source.inputs[0], 1  # x·Wᵀ, as torch's dynamo exporter writes a Linear
        if is_parameter(weight) and len(weight.shape) == 2:
            add = _bias_add(node)
            if add is not None:
                return Projection(node, weight, axis_in, *add)
            bias, adapted = _bias_add(_adapter_sum(node)) or (None, None)
            return Projection(node, weight, axis_in, bias, adapted_add=adapted)
    if node.op == "Gemm" and not node.attrs.get("transA", 0) and len(node.inputs) >= 2:
        weight = node.inputs[1]
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if is_parameter(weight) and len(weight.shape) == 2 and (bias is None or is_parameter(bias)):
            if bias is not None and len(bias.shape) != 1:
                return None
            return Projection(node, weight, 1 if node.attrs.get("transB", 0) else 0, bias)
    return None


def _bias_add(node: gs.Node | None) -> tuple[gs.Constant, gs.Node] | None:
    """The Add of a 1-D parameter right after a MatMul (its only reader), as exporters write a Linear's bias."""
    if node is None:
        return None
    out = node.outputs[0]
    if len(out.outputs) != 1 or out.outputs[0].op != "Add":
        return None
    add = out.outputs[0]
    other = next((t for t in add.inputs if t is not out), None)
    if other is not None and is_parameter(other) and len(other.shape) == 1:
        return other, add
    return None


def _adapter_sum(node: gs.Node) -> gs.Node | None:
    """The lora pass's Add of a low-rank adapter's product to the MatMul's (its only reader), or None."""
    out = node.outputs[0]
    if len(out.outputs) != 1:
        return None
    add = out.outputs[0]
    return add if add.op == "Add" and add.name.startswith(roles.LORA_PREFIX) else None


def projection_ending(node: gs.Node) -> Projection | None:
    """The projection ``node`` ends: a MatMul or Gemm on a 2-D parameter, or the bias Add after a MatMul."""
    if node.op == "Add":
        for t in node.inputs:
            if len(t.inputs) == 1 and t.inputs[0].op == "MatMul":
                made = projection(t.inputs[0])
                if made is not None and made.add is node:
                    return made
        return None
    made = projection(node)
    return made if made is not None and made.add is None else None


def other_readers(projection: Projection) -> list[gs.Node]:
    """The nodes reading the projection's weight or bias besides the projection itself (and
    its Transpose of the weight): what a member's slice of them would be wrong for."""
    own = {id(n) for n in (projection.node, projection.add, projection.adapted_add) if n is not None}
    others = []
    for parameter in [projection.weight, *([projection.bias] if projection.bias is not None else [])]:
        for reader in parameter.outputs:
            if reader.op == "Transpose" and all(id(r) in own for r in reader.outputs[0].outputs):
                continue
            if id(reader) not in own:
                others.append(reader)
    return others


def read_only_by(projection: Projection) -> bool:
    """Whether the projection's weight and bias are read by it alone (a member slices them)."""
    return not other_readers(projection)
