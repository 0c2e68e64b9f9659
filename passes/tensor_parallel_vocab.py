"""Vocabulary-parallel layers for the tensor_parallel pass (passes/tensor_parallel.py), as
Megatron-LM splits them: the token embedding's table by rows, the LM head by its output (the
vocabulary), and the cross-entropy over the split vocabulary computed from the members' slices
of the logits, so that no member holds the full-vocabulary logits.

- Embedding: member r holds rows [r·V/T, (r+1)·V/T) of the table (where T does not divide V,
  as GPT-2's 50257, the first V mod T members one row more: ``member_range``). It looks up the tokens in its
  rows (the others read row 0 and are zeroed), and the members' lookups are summed
  (TensorParallelReduce, g).
- LM head: a projection whose output, through layout ops (Transpose, Reshape, Slice, Cast, a
  scale), is the input of a LogSoftmax over the vocabulary axis that only a loss reads
  (NegativeLogLikelihoodLoss over it, or a sum or mean over the vocabulary: label smoothing),
  as the loss pass writes cross_entropy. Its input goes through f; its weight may be the
  embedding's table (tied weights stay tied: both split along the vocabulary).
- Cross-entropy: log p[y] = x[y] − m − log Σ exp(x − m), with m the maximum over the group
  (TensorParallelMax, no gradient), Σ exp(x − m) and x[y] (on the member whose rows hold y)
  summed over the group (g). The log-probabilities themselves are never made: every value after
  the sums is the whole model's, so g's gradient (the same on every member) is exact.

On one process (the program without a rank) every marker is an Identity and each member's range
is the whole vocabulary: the program computes what the model did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.tensor_parallel_axes import ELEMENTWISE, Axes, Unsplittable
from graphforge.passes.tensor_parallel_projections import Projection, other_readers, projection_ending

from graphforge import roles
from graphforge.builder import Builder
from graphforge.constants import constant_value
from graphforge.ir import is_parameter
from graphforge.placement.buckets import marker_call
from graphforge.program import member_range

#: ops between an LM head and its LogSoftmax that only move or convert the logits
LAYOUT = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Cast", "Identity"})
#: ops between the token ids (a graph input) and an embedding's lookup
ID_LAYOUT = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast", "Identity"})
#: layout ops walked back from a LogSoftmax to the projection before it gives up
MAX_CHAIN = 32


@dataclass(frozen=True)
class VocabHead:
    """An LM head split along the vocabulary: the projection, the layout nodes from its output
    to the LogSoftmax, the LogSoftmax, the losses that read it, where the vocabulary axis runs
    (``axes``) and the vocabulary's size."""

    projection: Projection
    chain: tuple[gs.Node, ...]
    softmax: gs.Node
    readers: tuple[gs.Node, ...]
    axes: Axes
    vocabulary: int

    @property
    def logits(self) -> gs.Tensor:
        """What the LogSoftmax normalized: the logits, a member's slice of them."""
        return (self.chain[-1] if self.chain else self.projection.end).outputs[0]


@dataclass(frozen=True)
class Embedding:
    """A token embedding's lookup (Gather on axis 0 of a 2-D parameter, by ids from a graph input)."""

    node: gs.Node

    @property
    def table(self) -> gs.Constant:
        return self.node.inputs[0]


def vocab_layers(graph: gs.Graph, shapes, size: int, skip: set[str], used: set[int]):
    """The LM heads and token embeddings to split along the vocabulary, and why each one that
    stays whole does. A table shared by an embedding and a head (tied weights) is split only
    where every layer reading it is."""
    heads, left = [], []
    for node in graph.nodes:
        if node.op != "LogSoftmax" or node.name in skip:
            continue
        try:
            head = _head_of(node, graph, shapes, size, skip, used)
        except Unsplittable as exc:
            left.append(f"the LM head before LogSoftmax node {node.name!r}: {exc}")
            continue
        if head is not None:
            heads.append(head)
    embeddings = []
    for node in graph.nodes:
        if _is_token_embedding(node, graph) and node.name not in skip:
            rows = node.inputs[0].shape[0]
            if rows < size:
                left.append(f"the embedding {node.name!r} has {rows} rows, fewer than {size} processes")
            else:
                embeddings.append(Embedding(node))
    for _ in range(2):  # a tied table: each side dropped drops the other
        split_heads = {id(h.projection.node) for h in heads}
        looked_up = {id(e.node) for e in embeddings}
        kept = []
        for head in heads:
            other = other_readers(head.projection)
            if all(id(r) in looked_up for r in other):
                kept.append(head)
            else:
                left.append(
                    f"the LM head {head.projection.node.name!r}: its weight is read by a layer that stays whole"
                )
        heads = kept
        kept = []
        for embedding in embeddings:
            readers = [r for r in embedding.table.outputs if id(r) != id(embedding.node)]
            heads_of = [r for r in readers if not _is_token_embedding(r, graph)]
            if all(_reads_for(r, split_heads) for r in heads_of) and all(
                id(r) in looked_up for r in readers if _is_token_embedding(r, graph)
            ):
                kept.append(embedding)
            else:
                left.append(f"the embedding {embedding.node.name!r}: its table is read by a layer that stays whole")
        embeddings = kept
    return heads, embeddings, list(dict.fromkeys(left))


def _head_of(softmax: gs.Node, graph: gs.Graph, shapes, size: int, skip: set[str], used: set[int]):
    """The LM head ``softmax`` normalizes the output of, or None where its input is not a
    projection's output (through layout ops); Unsplittable where it is one that cannot split."""
    chain: list[gs.Node] = []
    tensor = softmax.inputs[0]
    while True:
        if len(tensor.inputs) != 1 or len(chain) > MAX_CHAIN:
            return None
        producer = tensor.inputs[0]
        head = projection_ending(producer)
        if head is not None:
            break
        if producer.op not in LAYOUT and not _scales(producer):
            return None
        chain.insert(0, producer)
        tensor = producer.inputs[0]
    if head.node.name in skip or id(head.node) in used:
        return None
    for tensor, reader in zip([head.end.outputs[0], *(n.outputs[0] for n in chain)], [*chain, softmax], strict=True):
        # (a Shape of it is the member's: what a reshape to [-1, logits.size(-1)] wants)
        if any(r is not reader and r.op not in ("Shape", "Size") for r in tensor.outputs):
            raise Unsplittable(f"{tensor.name!r} is read by another node than the loss's")
    region = {head.end.outputs[0].name, *(n.outputs[0].name for n in chain)}
    axes = Axes(shapes, size, region, opset=graph.opset)
    axes.start(head.end.outputs[0], None)
    for node in chain:
        axes.carry(node)
    vocabulary = axes.shapes[head.end.outputs[0].name][-1]
    # (a vocabulary the group does not divide: the first members take one more class, member_range)
    x = softmax.inputs[0]
    a, rank = axes.axis[x.name], len(axes.shapes[x.name])
    axis = int(softmax.attrs.get("axis", 1 if graph.opset < 13 else -1))
    axis = axis + rank if axis < 0 else axis
    if axis != a or (graph.opset < 13 and a != rank - 1):
        raise Unsplittable(f"LogSoftmax node {softmax.name!r} normalizes over another axis than the vocabulary")
    out = softmax.outputs[0]
    if any(out is o for o in graph.outputs):
        raise Unsplittable(f"the log-probabilities {out.name!r} are an output of the model")
    for reader in out.outputs:
        if reader.op == "NegativeLogLikelihoodLoss" and reader.inputs[0] is out:
            if len(reader.inputs) > 2 and not reader.inputs[2].is_empty():
                raise Unsplittable(f"NegativeLogLikelihoodLoss node {reader.name!r} weighs the classes")
            if a != 1:
                raise Unsplittable(f"NegativeLogLikelihoodLoss node {reader.name!r} reads classes on another axis")
        elif reader.op in ("ReduceSum", "ReduceMean") and _reduced_axes(reader, rank, graph.opset) == {a}:
            pass
        else:
            raise Unsplittable(f"{reader.op} node {reader.name!r} reads the log-probabilities of the whole vocabulary")
    return VocabHead(head, tuple(chain), softmax, tuple(out.outputs), axes, vocabulary)


def _scales(node: gs.Node) -> bool:
    """An elementwise op on the logits alone, with constants (a logit scale, a soft cap)."""
    return node.op in ELEMENTWISE and all(isinstance(t, gs.Constant) for t in node.inputs[1:])


def _reduced_axes(node: gs.Node, rank: int, opset: int) -> set[int] | None:
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and not node.inputs[1].is_empty():
        axes = constant_value(node.inputs[1], opset)
    if axes is None:
        return None
    return {int(x) + rank if int(x) < 0 else int(x) for x in np.asarray(axes).reshape(-1)}


def _is_token_embedding(node: gs.Node, graph: gs.Graph) -> bool:
    """A lookup in a 2-D parameter of more rows than columns by ids from a graph input (token
    ids: a position table is looked up by computed ids, and stays whole, as Megatron-LM keeps
    it)."""
    if node.op != "Gather" or int(node.attrs.get("axis", 0)) != 0 or len(node.inputs) != 2:
        return False
    table, ids = node.inputs
    if not is_parameter(table) or table.shape is None or len(table.shape) != 2:
        return False
    if table.shape[0] <= table.shape[1]:
        return False  # a table of types or segments (BERT's 2 rows): not worth a sum across the group
    for _ in range(MAX_CHAIN):
        if any(ids is i for i in graph.inputs):
            return True
        if len(ids.inputs) != 1 or ids.inputs[0].op not in ID_LAYOUT:
            return False
        ids = ids.inputs[0].inputs[0]
    return False


def _reads_for(node: gs.Node, heads: set[int]) -> bool:
    """Whether ``node`` is a split head, or a Transpose read by split heads only."""
    if id(node) in heads:
        return True
    return node.op == "Transpose" and all(id(r) in heads for r in node.outputs[0].outputs)


def head_split(head: VocabHead) -> dict[str, int]:
    """The axis of the vocabulary in the head's parameters."""
    split = {head.projection.weight.name: 1 - head.projection.axis_in}
    if head.projection.bias is not None:
        split[head.projection.bias.name] = 0
    return split


def split_embedding(graph: gs.Graph, embedding: Embedding, rank: int | None, size: int, group: int) -> str:
    """The lookup in the member's rows, zero for ids outside them, summed over the group (g);
    returns the sum's name."""
    node = embedding.node
    rows = embedding.table.shape[0]
    b = Builder(graph, prefix=f"{node.name}/tensor_parallel_vocab")
    ids = node.inputs[1]
    inside, local = _in_range(b, ids, rows, rank, size)
    node.inputs[1] = b.op("Where", inside, local, b.constant(np.array(0, dtype=ids.dtype)))
    out = node.outputs[0]
    looked_up = gs.Variable(b.fresh_name("rows"), dtype=out.dtype, shape=out.shape)
    node.outputs[0] = looked_up
    # (times the mask: a float constant here would be an initializer, which training takes for a parameter)
    mine = b.mul(looked_up, b.cast_like(b.unsqueeze(inside, [-1]), looked_up))
    return _summed(b, mine, out, group)


def split_loss(graph: gs.Graph, head: VocabHead, rank: int | None, size: int, group: int) -> list[str]:
    """The head's LogSoftmax and the losses on it, computed from the member's logits; returns
    the names of the group's sums and maximum."""
    softmax, x = head.softmax, head.softmax.inputs[0]
    a = head.axes.axis[x.name]
    b = Builder(graph, prefix=_loss_prefix(head))
    shift = b.axes_op("ReduceMax", x, [a], keepdims=1)
    shift_all = gs.Variable(b.fresh_name("max"), dtype=x.dtype)
    graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_MAX_OP, shift, shift_all, group, attribute="group"))
    exp_sum = b.axes_op("ReduceSum", b.op("Exp", b.sub(x, shift_all)), [a], keepdims=1)
    total = gs.Variable(b.fresh_name("exp_sum"), dtype=x.dtype)
    graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_REDUCE_OP, exp_sum, total, group, attribute="group"))
    log_norm = b.add(shift_all, b.op("Log", total))  # log Σ exp(x) over the vocabulary, keepdims
    names = [shift_all.name, total.name]
    for reader in head.readers:
        if reader.op == "NegativeLogLikelihoodLoss":
            names.append(_nll(b, reader, x, log_norm, head.vocabulary, rank, size, group))
        else:
            names.append(_class_reduction(b, reader, x, a, log_norm, head.vocabulary, group))
    _detach(graph, softmax)
    return names


def _loss_prefix(head: VocabHead) -> str:
    """The names of what the split cross-entropy adds: the loss's (a loss node, never a parameter)."""
    return f"{roles.LOSS_PREFIX}{head.softmax.name}/tensor_parallel_vocab"


def _detach(graph: gs.Graph, node: gs.Node) -> None:
    node.inputs.clear()
    node.outputs.clear()
    graph.nodes.remove(node)


def _nll(b: Builder, nll: gs.Node, x, log_norm, vocabulary: int, rank, size, group) -> str:
    """-log p[y] = log Σ exp(x) − x[y], with x[y] from the member whose rows hold y, reduced as ``nll`` did."""
    labels = nll.inputs[1]
    inside, local = _in_range(b, labels, vocabulary, rank, size)
    ignore = nll.attrs.get("ignore_index")
    valid = None
    if ignore is not None:
        valid = b.op("Not", b.op("Equal", labels, b.constant(np.array(int(ignore), dtype=labels.dtype))))
        inside = b.op("And", inside, valid)
    safe = b.op("Where", inside, local, b.constant(np.array(0, dtype=labels.dtype)))
    # -x[n, y, ...] on the member holding y (NLL of the logits themselves: a gather along the classes)
    negated = b.op("NegativeLogLikelihoodLoss", x, safe, reduction="none")
    mine = b.op("Where", inside, negated, b.scalar_like(0.0, x))
    picked = gs.Variable(b.fresh_name("picked"), dtype=x.dtype)
    b.graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_REDUCE_OP, mine, picked, group, attribute="group"))
    loss = b.add(b.squeeze(log_norm, [1]), picked)
    if valid is not None:
        loss = b.op("Where", valid, loss, b.scalar_like(0.0, x))
    reduction = nll.attrs.get("reduction", "mean")
    if reduction == "sum":
        loss = b.axes_op("ReduceSum", loss, None, keepdims=0)
    elif reduction == "mean" and valid is None:
        loss = b.axes_op("ReduceMean", loss, None, keepdims=0)
    elif reduction == "mean":
        count = b.axes_op("ReduceSum", b.cast_like(valid, x), None, keepdims=0)
        loss = b.div(b.axes_op("ReduceSum", loss, None, keepdims=0), count)
    out = nll.outputs[0]
    _detach(b.graph, nll)
    b.graph.nodes.append(gs.Node("Identity", inputs=[loss], outputs=[out]))
    return picked.name


def _class_reduction(b: Builder, node: gs.Node, x, a: int, log_norm, vocabulary: int, group: int) -> str:
    """Σ log p over the vocabulary (or its mean) = Σ x − V · log Σ exp(x)."""
    keep = int(node.attrs.get("keepdims", 1))
    partial = b.axes_op("ReduceSum", x, [a], keepdims=keep)
    total = gs.Variable(b.fresh_name("sum"), dtype=x.dtype)
    b.graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_REDUCE_OP, partial, total, group, attribute="group"))
    norm = log_norm if keep else b.squeeze(log_norm, [a])
    summed = b.sub(total, b.mul(b.scalar_like(float(vocabulary), x), norm))
    if node.op == "ReduceMean":
        summed = b.div(summed, b.scalar_like(float(vocabulary), x))
    out = node.outputs[0]
    _detach(b.graph, node)
    b.graph.nodes.append(gs.Node("Identity", inputs=[summed], outputs=[out]))
    return total.name


def _in_range(b: Builder, ids: gs.Tensor, whole: int, rank: int | None, size: int):
    """Whether each id is in the member's range of ``whole`` (all of it without a rank), and its
    index there."""
    first, count = (0, whole) if rank is None else member_range(whole, rank, size)
    dtype = ids.dtype or np.int64
    local = b.sub(ids, b.constant(np.array(first, dtype=dtype)))  # (by 0 too: every member's nodes alike)
    above = b.op("Not", b.op("Less", local, b.constant(np.array(0, dtype=dtype))))
    below = b.op("Less", local, b.constant(np.array(count, dtype=dtype)))
    return b.op("And", above, below), local


def _summed(b: Builder, partial: gs.Tensor, out: gs.Variable, group: int) -> str:
    summed = gs.Variable(b.fresh_name("sum"), dtype=out.dtype, shape=out.shape)
    b.graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_REDUCE_OP, partial, summed, group, attribute="group"))
    b.graph.nodes.append(gs.Node("Identity", inputs=[summed], outputs=[out]))
    return summed.name


def kept_shapes(heads: Sequence[VocabHead], embeddings: Sequence[Embedding]) -> set[int]:
    """The nodes after which a member's shapes are the whole model's again (once split_loss
    rewrote the heads): each lookup in a split table, and the reductions over the vocabulary
    of the logits (directly, or of their shifted exponentials)."""
    ends = {id(e.node) for e in embeddings}
    for head in heads:
        stack = list(head.logits.outputs)
        while stack:
            node = stack.pop()
            if node.op in ("ReduceMax", "ReduceSum", "NegativeLogLikelihoodLoss"):
                ends.add(id(node))
            elif node.op in ("Sub", "Exp"):
                stack.extend(node.outputs[0].outputs)
    return ends
