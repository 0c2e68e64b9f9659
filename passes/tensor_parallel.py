"""The tensor_parallel pass: the layers a group of processes splits between them, marked in the
forward program (Megatron-LM's column and row splits)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.tensor_parallel_axes import (
    Axes,
    NeedsSections,
    NotDivisible,
    Unsplittable,
    probe_shapes,
)
from graphforge.passes.tensor_parallel_projections import Projection, projection, projection_ending, read_only_by
from graphforge.passes.tensor_parallel_vocab import (
    LAYOUT,
    MAX_CHAIN,
    head_split,
    kept_shapes,
    split_embedding,
    split_loss,
    vocab_layers,
)

from graphforge import roles
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.placement.buckets import marker_call, marker_function
from graphforge.program import TensorParallelRole, member_range
from graphforge.shapes import infer_shapes
from graphforge.stand_ins import is_left_out, left_out_as

#: nodes the walk back from a row projection visits before it gives up on a block: a block is
#: a few dozen nodes (an attention with its reshapes and rotary embedding about a hundred)
MAX_BLOCK_NODES = 2000


@dataclass(frozen=True)
class TensorParallel(Pass):
    """Split blocks of projections across a group of ``size`` processes, as Megatron-LM does:
    the block's first projections column-parallel (each member computes a 1/size slice of
    their output features), what is computed between them local to each member, the last
    projection row-parallel (each member's partial output, summed over the group). Found on
    the graph, not on names: a MatMul or Gemm whose weight is a 2-D parameter (the row
    projection) is walked back to the projections its input is computed from, through

    - an MLP's activation (elementwise ops; SwiGLU's gate and up projections share the split);
    - an attention: the Q, K and V projections split by heads (their reshapes to heads and the
      merge after it rewritten for the member's heads; grouped key/value heads split alike; a
      fused QKV projection split per section, each member taking its heads of Q, of K and of
      V), the scores, softmax, mask, rotary embedding and dropout computed on the member's
      heads, ONNX's Attention op with its head counts divided.

    Where the split axis runs is followed node by node on the shapes of a probe (the model at
    small fixed dims; passes/tensor_parallel_axes.py).

    1. The first projections' input goes through ``graphforge.TensorParallelCopy`` (f), the
       row projection's output, before its bias, through ``graphforge.TensorParallelReduce``
       (g): both Identity on one process, which runs the program as it was; their gradient
       rules make autodiff write the backward's collectives (g's gradient is f, f's is g).
    2. What each member holds a slice of is recorded (``graphforge.tensor_parallel``): the
       first weights along their output features, their biases, the row weight along its
       input features (and, for a fused projection, its sections); the row bias stays whole,
       as everything else (norms, residuals, embeddings).
    3. A block whose features or heads ``size`` does not divide is refused, naming the node;
       ``skip`` names projections (their nodes) whose blocks stay replicated. A block the
       walk cannot split (a node that mixes the members' parts: an attention bias per head,
       a reduction over the heads) stays whole, said once in a warning with the first reason;
       a model with no block is refused.
    4. ``rank``: the program of that member (0 .. size-1): each split parameter is its slice,
       the reshapes' and splits' sizes are the member's, and the shapes after them are
       inferred again, so that the passes after it (autodiff, the optimizer) write the
       member's backward and update with its shapes, as onnxruntime's Megatron transformer
       splits the forward graph before building the gradient graph. The member's shapes are
       checked against the whole model's on the probe. Without ``rank`` the program is the
       whole model with the markers: one process runs it unchanged, and the members' states
       join into its state (graphforge.distributed.tensor_parallel).

    5. Along the vocabulary (passes/tensor_parallel_vocab.py; ``vocab=false`` leaves them
       whole): each token embedding (a lookup in a 2-D parameter by ids from a graph input),
       each member holding its rows, the lookups summed (g); and an LM head whose logits only
       a cross-entropy reads (a LogSoftmax over the vocabulary, the loss pass's or the
       export's, under NegativeLogLikelihoodLoss or label smoothing's mean), column-parallel,
       with the cross-entropy computed from the member's slice of the logits (the maximum
       across the group, TensorParallelMax, then sums of the exponentials and of the label's
       logit): no member holds the full-vocabulary logits. A table tied to the LM head is
       split once, along the vocabulary, for both. A vocabulary the group does not divide
       (GPT-2's 50257) is split unevenly, the first members one row more (``member_range``).

    6. Low-rank adapters (the lora pass's ``lora::`` nodes) follow their base weight, and are
       never blocks of their own: a column projection's B ([out, r]) is split along its
       output rows as the weight, its input x·Aᵀ going through f (A stays whole, its gradient
       summed there, the same on every member); a row projection's A ([r, in]) is split along
       its input columns as the weight, its partial x·Aᵀ summed by a g of its own (r wide),
       B staying whole (its input, and so its gradient, the same on every member). A
       Dropout on a row adapter's input draws the member's own masks (case 4). A MatMul's
       bias Add after the adapter's sum (the lora pass adds it to the product, before the
       bias) is the projection's still: a column projection's bias split with its weight, a
       row projection's added once, after the sum.

    It runs on the forward program, after the loss pass (to split its cross-entropy) and
    before ``autodiff`` (``with_tensor_parallel`` places it so in a pipeline).
    """

    name = "tensor_parallel"
    refuses = (Fact.GRADIENTS,)

    size: int = 2
    skip: tuple[str, ...] = ()
    rank: int | None = None
    vocab: bool = True

    def __post_init__(self):
        check_number(self, "size", at_least=1)
        check_number(self, "rank", at_least=0, below=self.size)

    def run(self, model: Model) -> PassResult:
        model = infer_shapes(model, in_place=True)
        graph = model.graph
        graph.toposort()
        shapes = probe_shapes(model)
        blocks, heads, embeddings = self._layers(model, shapes)
        copy_fn = marker_function(graph, roles.TENSOR_PARALLEL_COPY_OP, attribute="group")
        reduce_fn = marker_function(graph, roles.TENSOR_PARALLEL_REDUCE_OP, attribute="group")
        split, sections, recorded = _split_blocks(graph, blocks)
        vocab_split, vocab_recorded = _split_vocabulary(graph, embeddings, heads, self.rank, self.size, len(blocks))
        split.update(vocab_split)
        recorded += vocab_recorded
        graph.functions.extend([copy_fn, reduce_fn])
        if heads:
            graph.functions.append(marker_function(graph, roles.TENSOR_PARALLEL_MAX_OP, attribute="group"))
        graph.toposort()
        uneven = _uneven(embeddings, heads, self.size)
        role = TensorParallelRole(self.size, split, tuple(recorded), self.rank, sections, uneven)
        if self.rank is not None:
            _member_program(model, role, blocks, heads, embeddings, shapes)
        roles.set_json(model, roles.TENSOR_PARALLEL, role.to_json())
        member = "" if self.rank is None else f" (the program of member {self.rank})"
        kinds = sorted({b["kind"] for b in recorded})
        return PassResult(
            model,
            True,
            note=f"{len(recorded)} layer(s) ({', '.join(kinds)}) split across {self.size} processes{member}",
        )

    def _layers(self, model: Model, shapes) -> tuple[list[_Block], list, list]:
        """The blocks, LM heads and token embeddings to split (cases 3 and 5): refused where
        the group's size does not divide one and nothing else splits, or where nothing does;
        the layers that stay whole said once in a warning."""
        graph = model.graph
        blocks, left, indivisible = _blocks(graph, set(self.skip), shapes, self.size)
        heads, embeddings = [], []
        if self.vocab:
            used = {id(p.node) for b in blocks for p in [*b.firsts, b.second]}
            heads, embeddings, vocab_left = vocab_layers(graph, shapes, self.size, set(self.skip), used)
            left += vocab_left
            if not heads and not Fact.LOSS.holds(model) and _output_projection(graph, used):
                # an LM head splits only under its cross-entropy, which the loss pass adds
                left.insert(0, "the projection to the model's output: no loss reads it yet (an LM head splits only "
                            "under its cross-entropy: put tensor_parallel after the loss pass)")  # fmt: skip
        if indivisible:  # (a head left whole with its block is no other layer)
            named = {name for name, _ in indivisible}
            others = blocks or embeddings or [h for h in heads if h.projection.node.name not in named]
            _refuse_indivisible(indivisible, self.size, others=bool(others))
        if left:
            warnings.warn(
                f"tensor_parallel: {len(left)} layer(s) stay whole on every member: {left[0]}"
                + (f" (and {len(left) - 1} more)" if len(left) > 1 else ""),
                stacklevel=3,  # the caller of run
            )
        if not blocks and not heads and not embeddings:
            reason = f": {left[0]}" if left else ""
            raise PassError(
                "tensor_parallel: no layer to split was found (a block of projections: a MatMul or Gemm on a 2-D "
                "parameter whose input is computed from other such projections, read by nothing else; a token "
                f"embedding; an LM head under a cross-entropy){reason}"
            )
        return blocks, heads, embeddings


def _split_blocks(
    graph: gs.Graph, blocks: Sequence[_Block]
) -> tuple[dict[str, int], dict[str, tuple[int, ...]], list[dict]]:
    """Mark each block's input for the copy (f) and its output for the reduction (g), block i
    in group i (cases 1 and 2). Returns each split parameter's axis, the sections of a fused
    projection's parameters, and what the role records of each block."""
    split: dict[str, int] = {}
    sections: dict[str, tuple[int, ...]] = {}
    recorded = []
    for index, block in enumerate(blocks):
        column = []
        for first in block.firsts:
            cut = block.axes.sections[first.end.outputs[0].name]
            split[first.weight.name] = 1 - first.axis_in
            column.append(first.weight.name)
            if first.bias is not None:
                split[first.bias.name] = 0
                column.append(first.bias.name)
            if len(cut) > 1:
                sections[first.weight.name] = cut
                if first.bias is not None:
                    sections[first.bias.name] = cut
        split[block.second.weight.name] = block.second.axis_in
        row = [block.second.weight.name]
        copied = _copy_inputs(graph, [p.node for p in block.firsts], index)
        reduced = _reduce_output(graph, block.second, index)
        entry = {"column": column, "row": row, "copy": copied, "reduce": reduced, "kind": block.kind}
        if block.adapter is not None:  # case 6: the row projection's adapter, A along its input
            split[block.adapter.weight.name] = block.adapter.axis_in
            row.append(block.adapter.weight.name)
            entry["reduce_adapter"] = _reduce_output(graph, block.adapter, index)
        recorded.append(entry)
    return split, sections, recorded


def _split_vocabulary(
    graph: gs.Graph, embeddings: Sequence, heads: Sequence, rank: int | None, size: int, group: int
) -> tuple[dict[str, int], list[dict]]:
    """Split the token embeddings, then the LM heads with their cross-entropy, along the
    vocabulary (case 5), in groups from ``group`` on. Returns each split parameter's axis,
    and what the role records of each layer."""
    split: dict[str, int] = {}
    recorded = []
    for embedding in embeddings:
        split[embedding.table.name] = 0
        summed = split_embedding(graph, embedding, rank, size, group)
        recorded.append({"column": [embedding.table.name], "row": [], "copy": [], "reduce": [summed],
                         "kind": "embedding"})  # fmt: skip
        group += 1
    for head in heads:
        split.update(head_split(head))
        copied = _copy_inputs(graph, [head.projection.node], group)
        reduced = split_loss(graph, head, rank, size, group)
        # the model's outputs among the logits (a member's: its slice along the vocabulary)
        outputs = {t.name: head.axes.axis[t.name] for t in graph.outputs if t.name in head.axes.axis}
        recorded.append({"column": list(head_split(head)), "row": [], "copy": copied, "reduce": reduced,
                         "kind": "vocabulary", "outputs": outputs})  # fmt: skip
        group += 1
    return split, recorded


def _uneven(embeddings: Sequence, heads: Sequence, size: int) -> dict[str, int]:
    """The split parameters whose vocabulary ``size`` does not divide -> its whole size."""
    uneven = {e.table.name: e.table.shape[0] for e in embeddings if e.table.shape[0] % size}
    for head in heads:
        if head.vocabulary % size:
            uneven.update(dict.fromkeys(head_split(head), head.vocabulary))
    return uneven


def _member_program(model: Model, role: TensorParallelRole, blocks, heads, embeddings, shapes) -> None:
    """Make ``model`` (the whole model, marked) the program of member ``role.rank`` (case 4):
    its reshapes' and splits' sizes, its slices of the split parameters, its own dropout
    streams; its shapes checked against the whole model's on the probe (``shapes``)."""
    graph = model.graph
    for axes in [*(b.axes for b in blocks), *(h.axes for h in heads)]:
        for edit in axes.edits:
            edit(graph, role.size, role.rank)
    graph.toposort()
    ends = {id(p.node) for b in blocks for p in (b.second, b.adapter) if p is not None}
    _keep_slices(model, role, ends | kept_shapes(heads, embeddings))
    _own_dropout_streams(blocks, role.rank)
    _check_member_shapes(model, blocks, heads, shapes, role.size, role.rank)


def _output_projection(graph: gs.Graph, used: set[int]) -> bool:
    """Whether some output of ``graph`` is a projection's, through layout ops (an LM head's
    logits, say), one no block splits (``used``: the blocks' nodes)."""
    for output in graph.outputs:
        tensor = output
        for _ in range(MAX_CHAIN):
            node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
            if node is None:
                break
            made = projection_ending(node)
            if made is not None:
                if id(made.node) not in used:
                    return True
                break
            if node.op not in LAYOUT or not node.inputs:
                break
            tensor = node.inputs[0]
    return False


def with_tensor_parallel(passes: Sequence[Pass], split: TensorParallel) -> list[Pass]:
    """``passes`` (a pipeline for the forward model) with ``split`` where it belongs: after the
    loss pass, whose cross-entropy it splits along the vocabulary, and before the first pass
    that writes gradients; first where no loss pass comes before that."""
    passes = list(passes)
    writes = next((i for i, p in enumerate(passes) if Fact.GRADIENTS in p.ensures), len(passes))
    loss = [i for i, p in enumerate(passes[:writes]) if p.name == "loss"]
    at = loss[-1] + 1 if loss else 0
    return [*passes[:at], split, *passes[at:]]


@dataclass(frozen=True)
class _Block:
    """Column-parallel projections (one, a gated pair as SwiGLU's, or an attention's Q, K and
    V), the nodes between them and the row-parallel projection that reads what they make,
    and where the split axis runs through them."""

    firsts: tuple[Projection, ...]
    between: tuple[gs.Node, ...]
    second: Projection
    axes: Axes | None
    #: the row projection's low-rank adapter: its product x·Aᵀ (case 6), or None
    adapter: Projection | None = None

    @property
    def kind(self) -> str:
        return "attention" if any(n.op in ("Softmax", "Attention") for n in self.between) else "mlp"


def _refuse_indivisible(indivisible: list[tuple[str, NotDivisible]], size: int, *, others: bool) -> None:
    """Refuse a split the group's size does not divide, with a way out that works: leaving
    those blocks whole where other layers still split, else a size that divides them all."""
    names = ", ".join(repr(name) for name, _ in indivisible)
    first = indivisible[0][1]
    if others:
        raise PassError(f"tensor_parallel: {first} (leave its block whole: skip=[{names}])")
    common = math.gcd(*(exc.count for _, exc in indivisible))
    sizes = [d for d in range(2, common + 1) if common % d == 0][:4]
    way = (
        f"use a group size that divides it: {' or '.join(f'size={d}' for d in sizes)}"
        if sizes
        else "no group size splits it evenly: train it without tensor parallelism"
    )
    raise PassError(f"tensor_parallel: {first}, and no other layer splits: {way}")


def _blocks(graph: gs.Graph, skip: set[str], shapes, size: int):
    """The blocks to split, why each block that stays whole does, and the blocks the group's
    size does not divide (the node that ends each, and why)."""
    found, left, used, indivisible = [], [], set(), []
    for node in graph.nodes:
        second = projection(node)
        if second is None or node.name in skip or id(node) in used or node.name.startswith(roles.LORA_PREFIX):
            continue  # (an adapter's products follow their base weight's split: case 6)
        try:
            block = _block_before(second, skip, used, graph, shapes, size)
        except NotDivisible as exc:
            indivisible.append((node.name, exc))
            continue
        except Unsplittable as exc:
            left.append(f"the block ending at {node.op} node {node.name!r}: {exc}")
            continue
        if block is not None:
            found.append(block)
            used.update(id(p.node) for p in [*block.firsts, block.second])
    return found, left, indivisible


def _block_before(second: Projection, skip: set[str], used: set[int], graph, shapes, size) -> _Block | None:
    """The block ``second`` ends, or None where its input is not computed from other
    projections alone. Walking back from its input (not through Shape, whose value a member
    computes alike) finds the first projections; the nodes computed from their outputs are
    the block, the rest of what the walk saw (masks, rotary tables) what every member
    computes whole."""
    firsts: dict[int, Projection] = {}
    behind: dict[int, gs.Node] = {}
    stack, seen = [second.node.inputs[0]], set()
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen or isinstance(tensor, gs.Constant) or len(tensor.inputs) != 1:
            continue
        seen.add(id(tensor))
        producer = tensor.inputs[0]
        if producer.op in ("Constant", "Shape", "Size"):
            continue
        first = projection_ending(producer)
        if first is not None:
            if first.node.name in skip or id(first.node) in used or first.node is second.node:
                return None
            firsts[id(first.node)] = first
            continue
        behind[id(producer)] = producer
        if len(behind) > MAX_BLOCK_NODES:
            return None
        stack.extend(producer.inputs)
    if not firsts or not all(read_only_by(p) for p in [*firsts.values(), second]):
        return None  # a weight shared with other layers (or a tied bias) stays whole
    region = {f.end.outputs[0].name for f in firsts.values()}
    between = []
    for node in graph.nodes:  # in order: a node reads what the block made before it
        if id(node) in behind and any(t.name in region for t in node.inputs if not _shape_only(t, node)):
            between.append(node)
            region.update(t.name for t in node.outputs if not t.is_empty())
    if second.node.inputs[0].name not in region:
        return None
    adapter, reading = _row_adapter(second)
    between += reading
    inside = {id(n) for n in between} | {id(second.node)} | ({id(adapter.node)} if adapter else set())
    for tensor in [*(t for n in between for t in n.outputs), *(f.end.outputs[0] for f in firsts.values())]:
        if tensor.is_empty():
            continue
        outside = [r for r in tensor.outputs if id(r) not in inside and not _shape_only(tensor, r)]
        if outside or any(tensor is o for o in graph.outputs):
            return None  # read outside the block: each member would hand on its slice only
    block = _Block(tuple(firsts.values()), tuple(between), second, None, adapter)
    try:
        axes = _axes(list(firsts.values()), between, [second, *([adapter] if adapter else [])], graph, shapes, size,
                     region)  # fmt: skip
    except Unsplittable:
        if block.kind == "attention":
            raise
        return None  # a residual or a head read whole: not a block, as a plain stack of layers is not
    if axes.indivisible:
        raise NotDivisible(*axes.indivisible[0])
    return dataclasses.replace(block, axes=axes)


def _row_adapter(second: Projection) -> tuple[Projection | None, list[gs.Node]]:
    """The low-rank adapter of the row projection ``second`` (case 6): the projection x·Aᵀ of
    the lora nodes reading its input x, and the nodes between (a Cast, a Dropout); none
    where no lora node reads x."""
    x = second.node.inputs[0]
    readers = [n for n in x.outputs if n is not second.node and not _shape_only(x, n)]
    if len(readers) != 1 or not readers[0].name.startswith(roles.LORA_PREFIX):
        return None, []
    node, reading = readers[0], []
    while node.op in ("Cast", "Dropout") and node.name.startswith(roles.LORA_PREFIX):
        reading.append(node)
        out = node.outputs[0]
        if len(out.outputs) != 1 or any(o.outputs for o in node.outputs[1:]):
            return None, []
        node = out.outputs[0]
    made = projection(node) if node.name.startswith(roles.LORA_PREFIX) else None
    if made is None or not read_only_by(made):
        return None, []
    return made, reading


def _axes(firsts, between, seconds, graph, shapes, size, region) -> Axes:
    """Where the split axis runs through the block; each fused projection's sections found
    on the way (the walk starts again with them). ``seconds``: the row projection, and its
    adapter's product."""
    cuts: dict[str, tuple[int, ...]] = {}
    for _ in range(len(firsts) + 1):
        axes = Axes(shapes, size, region, opset=graph.opset)
        try:
            for first in firsts:
                out = first.end.outputs[0]
                axes.start(out, cuts.get(out.name))
                if first.adapted_add is not None:  # case 6: the bias after the adapter's sum
                    axes.split_like(first.bias, out)
            for node in between:
                axes.carry(node)
        except NeedsSections as need:
            cuts[need.output] = need.sections
            continue
        for second in seconds:
            x = second.node.inputs[0]
            shape = shapes.get(x.name)
            if shape is None or axes.axis.get(x.name) != len(shape) - 1 or len(axes.sections[x.name]) != 1:
                raise Unsplittable(
                    f"the input of {second.node.op} node {second.node.name!r} is not split along its features"
                )
        return axes
    raise Unsplittable(f"the sections of the projections before node {seconds[0].node.name!r} do not settle")


def _shape_only(tensor: gs.Tensor, node: gs.Node) -> bool:
    """Whether ``node`` reads only ``tensor``'s shape or type (Shape, Size, CastLike's target)."""
    return node.op in ("Shape", "Size") or (node.op == "CastLike" and len(node.inputs) > 1 and node.inputs[1] is tensor)


def _copy_inputs(graph: gs.Graph, nodes: list[gs.Node], group: int) -> list[str]:
    """f before the column projections' inputs, one per input (their other readers keep the input itself)."""
    copies: dict[int, gs.Variable] = {}
    for node in nodes:
        source = node.inputs[0]
        copied = copies.get(id(source))
        if copied is None:
            copied = copies[id(source)] = gs.Variable(
                # per block: two blocks may read one tensor (Phi's attention and MLP, one norm before both)
                f"{source.name}/tensor_parallel_copy{group}",
                dtype=source.dtype,
                shape=source.shape,
            )
            graph.nodes.append(marker_call(roles.TENSOR_PARALLEL_COPY_OP, source, copied, group, attribute="group"))
        node.inputs[0] = copied
    return [c.name for c in copies.values()]


def _reduce_output(graph: gs.Graph, second: Projection, group: int) -> str:
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
    if beta != 1.0:  # (beta from a Constant node: an initializer would be taken for a parameter)
        scaled = gs.Variable(f"{bias.name}/tensor_parallel_beta", dtype=bias.dtype)
        factor = gs.Variable(f"{scaled.name}/c", dtype=bias.dtype, shape=[])
        graph.nodes.append(gs.Node("Constant", attrs={"value": gs.Constant(factor.name, _scalar(beta, bias))},
                                   outputs=[factor]))  # fmt: skip
        graph.nodes.append(gs.Node("Mul", inputs=[bias, factor], outputs=[scaled]))
        bias = scaled
    graph.nodes.append(gs.Node("Add", inputs=[summed, bias], outputs=[product]))
    return summed.name


def _keep_slices(model: Model, role: TensorParallelRole, ends: set[int]) -> None:
    """Member ``role.rank``'s slice of each split parameter, and the shapes of what is
    computed from them inferred again, up to the row-parallel projections (``ends``: their
    nodes), whose outputs keep their shapes. Only those: an exporter's shapes of the rest may
    be more than onnx's inference can tell again (torch's dynamo exporter's, after computed
    slices)."""
    graph = model.graph
    tensors = graph.tensors()
    stack = []
    for name in role.split:
        constant = tensors[name]
        if is_left_out(constant):  # compiled for its shapes alone (the planner's programs)
            left_out_as(constant, role.member_shape(name, constant.shape))
        else:
            constant.values = role.member_slice(name, np.asarray(constant.values))
        stack.append(constant)
    seen = set()
    while stack:
        tensor = stack.pop()
        for node in tensor.outputs:
            if id(node) in seen or id(node) in ends or node.op in ("Shape", "Size"):
                continue
            seen.add(id(node))
            for out in node.outputs:
                out.shape = None
                stack.append(out)
    infer_shapes(model, in_place=True)


def _check_member_shapes(model: Model, blocks: list[_Block], heads, whole: dict, size: int, rank: int) -> None:
    """Each tensor of a block has, in the member's program at the probe's dims, the whole
    model's shape with the split axis divided by ``size``, and the row projections' outputs
    the whole model's: what the exporter computed from the whole sizes (a head size as
    features // heads) would not, and is refused here, naming the tensor."""
    member = probe_shapes(model)
    # (where the split runs, the node named in the refusal, its output the member computes
    # whole, whether only the split axis is compared: an LM head's logits meet the labels,
    # whose dims the probe sizes apart from the batch's)
    layers = [(b.axes, b.second.node, b.second.node.outputs[0].name, False) for b in blocks]
    layers += [(h.axes, h.projection.node, None, True) for h in heads]
    for axes, end, whole_output, axis_only in layers:
        expected = {}
        for name, axis in axes.axis.items():
            shape = list(whole[name])
            shape[axis] = member_range(shape[axis], rank, size)[1]
            expected[name] = tuple(shape)
        if whole_output is not None:
            expected[whole_output] = whole.get(whole_output)
        for name, shape in expected.items():
            got = member.get(name)
            if shape is None or got is None:
                continue
            axis = axes.axis.get(name)
            differs = got[axis] != shape[axis] if axis_only and len(got) == len(shape) else got != shape
            if differs:
                raise PassError(
                    f"tensor_parallel: in member {rank}'s program {name!r} has the shape {list(got)} where its part of "
                    f"the whole {list(whole[name])} is {list(shape)}: the model computes it from a whole size (leave "
                    f"the layer whole: skip=[{end.name!r}])"
                )


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
