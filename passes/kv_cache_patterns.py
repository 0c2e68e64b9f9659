"""What the kv_cache pass recognizes in a causal LM's forward graph: each layer's attention
(Q·Kᵀ, Softmax, ·V) and the K and V it reads, the Ranges that count the new tokens' positions,
and a mask of ones made like the token ids. Pure functions over an onnx-graphsurgeon graph.

The patterns are those torch's TorchScript exporter (``dynamo=False``) writes for transformers'
eager attention: K and V projected, reshaped to heads and transposed, rotary applied, repeated
for grouped-query attention (Unsqueeze, Expand or Tile, Reshape), the scores Q·Kᵀ scaled and
masked (Add or Where), Softmax over the last axis, times V.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graphforge.constants import constant_value, is_constant
from graphforge.errors import PassError

#: ops between the scores' MatMul and the Softmax: scaling, masking, casts, soft-capping
_SCORE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Cast", "Identity", "Tanh", "Slice"})
#: ops between the Softmax and the values' MatMul
_PROBABILITY_OPS = frozenset({"Cast", "Identity", "Dropout"})
#: ops a sequence length passes through unchanged on its way to a Range's limit
_SCALAR_OPS = frozenset({"Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape"})
#: ops from the token ids to a tensor whose axis 1 is still the new tokens' sequence
_SEQUENCE_OPS = frozenset({"Cast", "Identity", "Reshape", "Flatten", "Unsqueeze"})


class AttentionNotRecognized(PassError):
    """A layer's attention is not the pattern the kv_cache pass rewrites."""


@dataclass(frozen=True)
class CachePoint:
    """K or V as the forward computes it before any grouped-query repeat: ``tensor``, whose
    axes mean ``axes`` (a permutation of "bhtd": batch, heads, sequence, head dim)."""

    tensor: gs.Variable
    axes: str


@dataclass(frozen=True)
class AttentionLayer:
    softmax: gs.Node
    scores: gs.Node
    values: gs.Node
    key: CachePoint
    value: CachePoint


def producer(t: gs.Tensor) -> gs.Node | None:
    return t.inputs[0] if len(t.inputs) == 1 else None


def attention_layers(graph: gs.Graph) -> list[AttentionLayer]:
    """Every layer's attention in graph order, one per Softmax over scores; an error naming
    the Softmax whose surroundings are not attention, or saying there is none."""
    softmaxes = [n for n in graph.nodes if n.op == "Softmax"]
    if not softmaxes:
        raise AttentionNotRecognized(
            "no attention found: the graph has no Softmax (expected Softmax(Q·Kᵀ + mask)·V in each layer)"
        )
    return [attention_at(n, layer, graph.opset) for layer, n in enumerate(softmaxes)]


def attention_at(softmax: gs.Node, layer: int, opset: int | None = None) -> AttentionLayer:
    where = f"layer {layer} (Softmax {softmax.name!r})" if softmax.name else f"layer {layer} (an unnamed Softmax)"
    axis = softmax.attrs.get("axis", -1)
    if axis not in (-1, 3):
        raise AttentionNotRecognized(f"{where}: expected a Softmax over the last axis of [batch, heads, q, k]")
    scores = _scores_product(softmax)
    if scores is None:
        raise AttentionNotRecognized(
            f"{where}: expected exactly one MatMul Q·Kᵀ of two activations before it (through Add, Mul, Div, Where)"
        )
    values = _values_product(softmax)
    if values is None:
        raise AttentionNotRecognized(f"{where}: expected its probabilities to be the first input of a MatMul with V")
    key = cache_point(scores.inputs[1], "bhdt", opset)
    value = cache_point(values.inputs[1], "bhtd", opset)
    for name, point in (("K", key), ("V", value)):
        if sorted(point.axes) != sorted("bhtd") or is_constant(point.tensor) or not point.tensor.inputs:
            raise AttentionNotRecognized(
                f"{where}: expected {name} as a projection reshaped to [batch, seq, heads, head_dim] and "
                f"transposed; found {point.tensor.name!r} ({_made_by(point.tensor)})"
            )
    return AttentionLayer(softmax, scores, values, key, value)


def _made_by(t: gs.Tensor) -> str:
    node = producer(t)
    return f"made by {node.op} {node.name!r}" if node is not None else "a graph input or constant"


def _scores_product(softmax: gs.Node) -> gs.Node | None:
    """The one MatMul of two activations the Softmax's input comes from through _SCORE_OPS."""
    found, seen, frontier = [], set(), [softmax.inputs[0]]
    while frontier:
        t = frontier.pop()
        node = producer(t)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "MatMul":
            if not any(is_constant(x) for x in node.inputs):
                found.append(node)
        elif node.op in _SCORE_OPS:
            frontier.extend(x for x in node.inputs[: 1 if node.op == "Slice" else None] if _floating(x))
    return found[0] if len(found) == 1 else None


def _floating(t: gs.Tensor) -> bool:
    """An activation that is not known to be other than floating point (a mask's bool)."""
    return not is_constant(t) and (t.dtype is None or np.issubdtype(np.dtype(t.dtype), np.floating))


def _values_product(softmax: gs.Node) -> gs.Node | None:
    """The MatMul P·V the probabilities reach through _PROBABILITY_OPS and SDPA's guard
    against rows of -inf (Where(IsNaN(p), 0, p))."""
    t = softmax.outputs[0]
    while True:
        readers = [n for n in t.outputs if n.op != "IsNaN"]
        if len(readers) != 1:
            return None
        node = readers[0]
        if node.op == "MatMul" and node.inputs[0] is t:
            return node
        guard = node.op == "Where" and node.inputs[2] is t and (c := producer(node.inputs[0])) is not None
        if not (node.op in _PROBABILITY_OPS or (guard and c.op == "IsNaN" and c.inputs[0] is t)):
            return None
        t = node.outputs[0]


def cache_point(t: gs.Tensor, axes: str, opset: int | None = None) -> CachePoint:
    """Walk up from a product's operand (its axes ``axes``) through transposes, casts, scaling
    by a constant (with ``opset``, a constant expression too: an unfolded export's
    Cast(Sqrt(c))) and the grouped-query repeat to the K or V the layer computed."""
    while (node := producer(t)) is not None:
        if node.op == "Transpose" and len(axes) == len(node.attrs.get("perm", ())):
            before = [""] * len(axes)
            for i, p in enumerate(node.attrs["perm"]):
                before[p] = axes[i]
            t, axes = node.inputs[0], "".join(before)
        elif node.op in ("Cast", "Identity"):
            t = node.inputs[0]
        elif (scaled := _scaled_by_constant(node, opset)) is not None:
            t = scaled
        elif axes == "bhtd" and (repeated := _repeated_heads(node)) is not None:
            t = repeated
        else:
            break
    return CachePoint(t, axes)


def _scaled_by_constant(node: gs.Node, opset: int | None) -> gs.Tensor | None:
    """x for Mul(x, c), Mul(c, x) or Div(x, c) with c a constant scalar."""
    if node.op not in ("Mul", "Div") or len(node.inputs) != 2:
        return None
    for i, (x, c) in enumerate((node.inputs, node.inputs[::-1])):
        if node.op == "Div" and i == 1:
            break
        value = constant_value(c, opset)
        if value is not None and value.size == 1 and not is_constant(x):
            return x
    return None


def _repeated_heads(node: gs.Node) -> gs.Tensor | None:
    """X for transformers' repeat_kv: Reshape(Expand|Tile(Unsqueeze(X, axis 2))) [b, h·n, t, d]."""
    if node.op != "Reshape":
        return None
    spread = producer(node.inputs[0])
    if spread is None or spread.op not in ("Expand", "Tile"):
        return None
    unsqueeze = producer(spread.inputs[0])
    if unsqueeze is None or unsqueeze.op != "Unsqueeze":
        return None
    axes = unsqueeze.attrs.get("axes")
    if axes is None and len(unsqueeze.inputs) > 1:
        axes = constant_value(unsqueeze.inputs[1])
    return unsqueeze.inputs[0] if axes is not None and list(np.ravel(axes)) == [2] else None


# --------------------------------------------------------------------------- positions and masks


def sequence_ranges(graph: gs.Graph, ids: gs.Tensor) -> list[gs.Node]:
    """The Ranges that count the new tokens: constant start and step, their limit the length
    of axis 1 of a tensor made from the token ids (transformers' cache_position, from which
    it computes the positions and the causal mask's query rows)."""
    return [
        n
        for n in graph.nodes
        if n.op == "Range"
        and all(constant_value(x) is not None for x in (n.inputs[0], n.inputs[2]))
        and _is_sequence_length(n.inputs[1], ids)
    ]


def _is_sequence_length(t: gs.Tensor, ids: gs.Tensor) -> bool:
    node = producer(t)
    while node is not None and node.op in _SCALAR_OPS:
        node = producer(node.inputs[0])
    if node is None:
        return False
    if node.op == "Gather":
        index, shape = constant_value(node.inputs[1]), producer(node.inputs[0])
        if index is None or index.size != 1 or int(index.ravel()[0]) != 1 or shape is None or shape.op != "Shape":
            return False
        if shape.attrs.get("start", 0) != 0:
            return False
        return _made_from_ids(shape.inputs[0], ids)
    if node.op == "Shape" and node.attrs.get("start") == 1 and node.attrs.get("end") == 2:
        return _made_from_ids(node.inputs[0], ids)
    return False


def _made_from_ids(t: gs.Tensor, ids: gs.Tensor) -> bool:
    """Whether ``t`` is the ids, their embedding or a reshape of either (axis 1 the sequence)."""
    while t is not ids:
        node = producer(t)
        if node is None:
            return False
        if node.op == "Gather" and is_constant(node.inputs[0]):
            t = node.inputs[1]
        elif node.op in _SEQUENCE_OPS:
            t = node.inputs[0]
        else:
            return False
    return True


def ones_like_ids(graph: gs.Graph, ids: gs.Tensor) -> list[gs.Node]:
    """ConstantOfShape(Shape(ids)) of value 1: the attention mask a forward without one makes."""
    found = []
    for node in graph.nodes:
        if node.op != "ConstantOfShape":
            continue
        shape = producer(node.inputs[0])
        value = node.attrs.get("value")
        if shape is None or shape.op != "Shape" or shape.inputs[0] is not ids or shape.attrs:
            continue
        if value is not None and np.all(np.asarray(value.values) == 1):
            found.append(node)
    return found
