"""The kv_cache pass: a causal LM's decoding model (past keys and values in, present out) from its forward."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from graphforge.passes.kv_cache_patterns import (
    AttentionLayer,
    CachePoint,
    attention_layers,
    ones_like_ids,
    sequence_ranges,
)

from graphforge import roles
from graphforge.builder import Builder
from graphforge.constants import constant_value
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import onnx_dtype
from graphforge.pass_infra import Fact, Pass, PassResult
from graphforge.shapes import symbolic_shapes

#: the inputs and outputs of the decoding model (optimum's and transformers' ONNX convention)
IDS, MASK, POSITIONS = "input_ids", "attention_mask", "position_ids"
PAST, PRESENT = "past_key_values.{layer}.{kind}", "present.{layer}.{kind}"
#: the decoding model's symbolic dims
PAST_LENGTH, TOTAL_LENGTH = "past_sequence_length", "total_sequence_length"
#: the axes the cache holds K and V in: [batch, kv_heads, sequence, head_dim]
CACHE_AXES = "bhtd"


@dataclass(frozen=True)
class KvCache(Pass):
    """Write a causal LM's decoding model from its forward: past keys and values in, present out.

    The new tokens' positions are offset by the cache's length.

    1. A model with cache inputs already (``past_key_values.*``) is left as it is, and the
       note says so.
    2. Each layer's attention is recognized in the graph (passes/kv_cache_patterns.py): a
       Softmax over the last axis of scores Q·Kᵀ (a MatMul of two activations, then scaling
       and masking by Add, Mul, Div or Where) whose probabilities multiply V. K and V are
       followed up from the products through transposes, casts, scaling by a constant and the
       grouped-query repeat (Unsqueeze, Expand or Tile, Reshape) to what the layer computed:
       after the rotary embedding, before the repeat. A Softmax that is not so is refused,
       naming it and what was expected, and the model is left as it was.
    3. Layer i's K and V are concatenated after ``past_key_values.{i}.key`` / ``.value``
       ([batch, kv_heads, past_sequence_length, head_dim]) on the sequence axis, and every
       reader of K and V reads the concatenation, which is the output ``present.{i}.key`` /
       ``.value`` ([batch, kv_heads, total_sequence_length, head_dim]).
    4. Positions: every Range counting the new tokens (constant start and step, its limit
       axis 1 of the token ids or their embedding: transformers' ``cache_position``, which
       gives the positions and the causal mask's query rows) starts and ends ``past_len``
       later, ``past_len`` being axis 2 of ``past_key_values.0.key``. One at least must be
       found. A ``position_ids`` input the forward took stays an input.
    5. The mask: ``attention_mask``, where the forward takes it, becomes [batch,
       total_sequence_length] (the mask's key columns are counted from it); a forward without
       one makes it as ones shaped like ``input_ids`` (ConstantOfShape(Shape(input_ids))),
       which becomes [batch, past_len + new_len]. A forward with neither is refused.
    6. ``graphforge.kv_cache`` records the layers' kv_heads and head_dim.
    With ``past_sequence_length`` 0 (empty past tensors) the decoding model computes what the
    forward computes.
    """

    name = "kv_cache"
    refuses = (Fact.LOSS, Fact.GRADIENTS)

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        names = {t.name for t in (*graph.inputs, *graph.outputs)}
        if any(n.startswith(("past_key_values.", "present.")) for n in names):
            return PassResult(model, False, "the model has cache inputs already: left as it is")
        inputs = {t.name: t for t in graph.inputs}
        ids = inputs.get(IDS)
        if ids is None:
            raise PassError(f"expected the token ids as the input {IDS!r}; the inputs: {', '.join(inputs)}")
        graph.toposort()
        layers = attention_layers(graph)
        ranges = sequence_ranges(graph, ids)
        if not ranges:
            raise PassError(
                f"no Range counting the new tokens (from axis 1 of {IDS!r}) was found: "
                "the positions and the causal mask cannot be offset by the cache's length (a dynamo export "
                "counts them from the attention mask's length: export with dynamo=False)"
            )
        ones = [] if MASK in inputs else ones_like_ids(graph, ids)
        if MASK not in inputs and not ones:
            raise PassError(
                f"the forward takes no {MASK!r} and makes none of ones like {IDS!r}: "
                "the mask's key columns cannot be counted from the cache"
            )
        sizes = _head_sizes(model, layers)
        _rewrite(graph, ids, layers, sizes, ranges, ones, inputs.get(MASK))
        model.metadata[roles.KV_CACHE] = json.dumps(
            {"layers": [{"kv_heads": h, "head_dim": d} for h, d, _ in sizes]}, sort_keys=True
        )
        note = f"{len(layers)} layers cached, {len(ranges)} position ranges offset"
        return PassResult(model, True, note)


def _head_sizes(model: Model, layers: list[AttentionLayer]) -> list[tuple[int, int, np.dtype]]:
    """Each layer's (kv_heads, head_dim, dtype): the dtype as ONNX's inference finds it, the
    sizes as onnxruntime's symbolic shape inference does (it follows the rotary embedding's
    slices, which ONNX's does not)."""
    proto = model.to_proto(values=False)
    del proto.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except onnx.shape_inference.InferenceError as exc:
        raise PassError(f"shape inference failed: {str(exc).strip().splitlines()[0]}") from None
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    shapes = symbolic_shapes(proto) or {}
    sizes = []
    for i, layer in enumerate(layers):
        found = []
        for point in (layer.key, layer.value):
            shape, elem_type = shapes.get(point.tensor.name), types.get(point.tensor.name)
            h, d = (shape[point.axes.index(a)] for a in "hd") if shape and len(shape) == 4 else (None, None)
            if not (isinstance(h, int) and isinstance(d, int) and elem_type):
                raise PassError(f"layer {i}: the heads and head dim of {point.tensor.name!r} are not known")
            found.append((h, d, onnx.helper.tensor_dtype_to_np_dtype(elem_type)))
        if found[0] != found[1]:
            raise PassError(f"layer {i}: K has {found[0][:2]} (heads, head dim) and V {found[1][:2]}: expected one")
        sizes.append(found[0])
    return sizes


def _rewrite(graph, ids, layers, sizes, ranges, ones, mask) -> None:
    """Cases 3 to 5 on ``graph``."""
    batch = ids.shape[0] if ids.shape and isinstance(ids.shape[0], str) else "batch"
    b = Builder(graph, prefix=roles.KV_CACHE_PREFIX)
    pasts = []
    for i, (layer, (heads, head_dim, dtype)) in enumerate(zip(layers, sizes, strict=True)):
        for kind, point in (("key", layer.key), ("value", layer.value)):
            past = gs.Variable(
                PAST.format(layer=i, kind=kind), dtype=dtype, shape=[batch, heads, PAST_LENGTH, head_dim]
            )
            present = _concatenated(b, past, point, f"layer{i}/{kind}")
            present.name, present.dtype = PRESENT.format(layer=i, kind=kind), dtype
            present.shape = [batch, heads, TOTAL_LENGTH, head_dim]
            pasts.append(past)
            graph.outputs.append(present)
    past_len = b.op("Gather", b.op("Shape", pasts[0]), b.constant(np.int64(2)), axis=0)
    for node in ranges:
        length = b.op("Cast", past_len, to=onnx_dtype(constant_value(node.inputs[0]).dtype))
        for i in (0, 1):
            node.inputs[i] = b.op("Add", node.inputs[i], length)
    for node in ones:
        grown = b.op("Concat", b.ints([0]), b.op("Unsqueeze", past_len, b.ints([0])), axis=0)
        node.inputs[0] = b.op("Add", node.inputs[0], grown)
    if mask is not None and mask.shape:
        mask.shape = [*mask.shape[:-1], TOTAL_LENGTH]
    graph.inputs.extend(pasts)
    _forget_inner_shapes(graph)
    graph.cleanup().toposort()


def _concatenated(b: Builder, past: gs.Variable, point: CachePoint, scope: str) -> gs.Variable:
    """Case 3 for one K or V: Concat(past, it) on the sequence axis, read by its readers."""
    x = point.tensor
    readers = list(x.outputs)
    with b.scope(scope):
        to_cache = [point.axes.index(a) for a in CACHE_AXES]
        cached = x if point.axes == CACHE_AXES else b.op("Transpose", x, perm=to_cache)
        present = b.op("Concat", past, cached, axis=2)
        back = present
        if point.axes != CACHE_AXES:
            back = b.op("Transpose", present, perm=[CACHE_AXES.index(a) for a in point.axes])
    for node in readers:
        for i, t in enumerate(node.inputs):
            if t is x:
                node.inputs[i] = back
    return present


def _forget_inner_shapes(graph: gs.Graph) -> None:
    """Inner tensors' symbolic shapes were inferred where the keys' length was the queries'."""
    boundary = {id(t) for t in (*graph.inputs, *graph.outputs)}
    for t in graph.tensors().values():
        inner = isinstance(t, gs.Variable) and id(t) not in boundary and t.shape is not None
        if inner and any(not isinstance(d, int) for d in t.shape):
            t.shape = None
