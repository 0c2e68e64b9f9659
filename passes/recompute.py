"""The recompute pass: the backward reads some forward activations recomputed, not saved."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import networkx as nx
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.analysis.cost import node_flops, parse_dims
from graphforge.analysis.memory import tensor_sizes
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import NONDETERMINISTIC_OPS
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.placement.stages import forward_chain, plan_stages

#: ops never recomputed: a second run would not give the values the forward used
NEVER = {op: "not deterministic: a second run draws other values" for op in NONDETERMINISTIC_OPS}
#: ops recomputed only when the budget cannot be met otherwise: each dominates a step's
#: time (GEMMs, convolutions, attention, recurrences), so recomputing one costs about its
#: share of the forward again; cheap ops around them (norms, activations, reshapes) cost
#: little to redo and their outputs are as large
EXPENSIVE = {
    "MatMul": "a GEMM",
    "Gemm": "a GEMM",
    "FusedMatMul": "a GEMM",
    "Einsum": "a GEMM, usually",
    "Conv": "a convolution",
    "ConvTranspose": "a convolution",
    "Attention": "attention: two GEMMs and a softmax",
    "LSTM": "a recurrence over the sequence",
    "GRU": "a recurrence over the sequence",
    "RNN": "a recurrence over the sequence",
    "Scan": "a loop over the sequence",
}


@dataclass(frozen=True)
class Recompute(Pass):
    """Choose which forward activations the backward keeps and which it recomputes.

    1. The activations the backward reads (what a step saves without recomputation) are
       weighed by their bytes, the inputs' symbolic dims as ``dims`` says (else 8): weights'
       transposes weigh as much at any batch, activations grow with it.
    2. ``budget``: the share of those bytes that may stay saved; 1.0 changes nothing, 0 saves
       the least possible. A minimum cut over the forward (networkx; PyTorch's partitioner
       does the same) gives the fewest bytes from which everything the backward reads can be
       recomputed within its layer (case 3's tensors are always saved), EXPENSIVE ops kept
       out of the recomputation while that meets the budget, NEVER ops always; then
       activations are kept saved again, the most expensive to recompute per byte first,
       while the budget allows.
    3. ``level=1`` (onnxruntime's memory optimizer level 1): keep only where one activation
       alone crosses from a layer to the next (a transformer block's input), recompute the
       rest of each layer.
    4. Each recomputed node is a copy named ``recompute::<forward node>/<op>_<n>`` (its
       origin, for ``diff``), placed in the file between the forward and the backward, so
       onnxruntime's default order runs it just before its first backward reader; the
       runtime turns onnxruntime's common subexpression elimination off for such programs,
       which would merge the copies back into the forward. Recorded in
       ``graphforge.recompute`` (what is saved, bytes before and after); ``prune`` drops the
       copies with the backward.
    """

    name = "recompute"
    requires = (
        Fact.GRADIENTS,
        Fact.OPTIMIZER,
    )  # a training step's memory; the layers are found from the carried parameters

    budget: float = 1.0
    level: int = 0
    #: sizes of the inputs' symbolic dims the activations are weighed at ("batch=8"; else 8)
    dims: tuple[str, ...] = ()

    def __post_init__(self):
        check_number(self, "budget", at_least=0, at_most=1)
        if self.level not in (0, 1):
            raise ValueError(
                f"recompute: level={self.level!r}: use 0 (the budget decides) or 1 (keep each layer's input)"
            )

    def run(self, model: Model) -> PassResult:
        if roles.RECOMPUTE in model.metadata:
            raise PassError("the program already has recomputation: run `recompute` once", node="", op_type="")
        graph = model.graph
        forward = forward_nodes(graph)
        needed = needed_activations(graph, forward)
        sizes = tensor_sizes(model.to_proto(values=False), parse_dims(self.dims))
        size = {t.name: max(sizes.get(t.name, 1), 1) for n in forward for t in n.outputs}  # needed among them
        before = sum(size[name] for name in needed)
        if (self.level == 0 and self.budget >= 1.0) or not needed:
            return PassResult(model, False)
        layers = layer_inputs(model)
        if self.level == 1:
            saved = min_cut_saved(forward, needed, size, banned=set(NEVER), kept=layers)
        else:
            saved = budget_saved(forward, needed, size, self.budget, layers)
        clones = rewrite(graph, forward, needed, saved)
        if not clones:
            return PassResult(model, False)
        after = saved_bytes(graph, size)
        roles.set_json(
            model,
            roles.RECOMPUTE,
            {"budget": self.budget, "level": self.level, "recomputed": len(clones), "saved_bytes": [before, after]},
        )
        dims = ", ".join(self.dims) or "dims as 8"
        note = f"{len(clones)} nodes recomputed; saved activations {before:,} → {after:,} bytes ({dims})"
        return PassResult(model, True, note=note)


def forward_nodes(graph: gs.Graph) -> list[gs.Node]:
    """The model's own nodes (no pass made them), in the file's order."""
    return [n for n in graph.nodes if roles.node_origin(n.name or "") is None]


def needed_activations(graph: gs.Graph, forward: Iterable[gs.Node]) -> list[str]:
    """The forward's outputs the backward (``grad::`` nodes) reads, in the order made."""
    made = {t.name for n in forward for t in n.outputs}
    read = {
        t.name
        for n in graph.nodes
        if (origin := roles.node_origin(n.name or "")) and origin[0] == "grad"
        for t in n.inputs
    }
    return [name for name in dict.fromkeys(t.name for n in forward for t in n.outputs) if name in read & made]


def layer_inputs(model: Model) -> set[str]:
    """The tensors where one activation alone crosses from one part of the forward to the
    next (a transformer block's input), as the pipeline pass finds its cut points."""
    _, _, points = forward_chain(plan_stages(model, []), per_node={})  # the points only: no FLOPs
    return set(points.values())


def min_cut_saved(
    forward: list[gs.Node],
    needed: Collection[str],
    size: Mapping[str, int],
    *,
    banned: Collection[str],
    kept: Collection[str] = (),
) -> set[str]:
    """The forward tensors to save, fewest bytes first, such that every ``needed`` one is
    saved or can be recomputed from saved ones and the graph's inputs (parameters, the
    batch), never recomputing a node whose op is in ``banned`` nor past a tensor in
    ``kept`` (saved at no cost, so that recomputation stays within a layer rather than
    going back to the batch: the whole forward again, alive as long as the saved one). A
    minimum cut: each tensor is an edge of its size from its "in" to its "out" end, a node
    joins its inputs' "out" to its outputs' "in", a banned node's outputs and the kept
    tensors hang from the source, a needed tensor's "out" from the sink."""
    flow = nx.DiGraph()
    made = {t.name for n in forward for t in n.outputs}
    for node in forward:
        for out in node.outputs:
            cost = 0 if out.name in kept else size.get(out.name, 1)
            flow.add_edge((out.name, "in"), (out.name, "out"), capacity=cost)
            if node.op in banned or out.name in kept:
                flow.add_edge("source", (out.name, "in"))
            for t in node.inputs:
                if t.name in made:
                    flow.add_edge((t.name, "out"), (out.name, "in"))
    for name in needed:
        flow.add_edge((name, "out"), "sink")
    if "source" not in flow:
        flow.add_node("source")
    _, (reachable, _) = nx.minimum_cut(flow, "source", "sink")
    return {name for name in made if (name, "in") in reachable and (name, "out") not in reachable}


def budget_saved(
    forward: list[gs.Node], needed: list[str], size: Mapping[str, int], budget: float, layers: Collection[str]
) -> set[str]:
    """What to save for ``budget`` (see the class docstring, case 2): the cut that keeps
    EXPENSIVE ops out of the recomputation if it fits, else the least one (each layer
    recomputed from its input), then activations saved again while the budget allows."""
    total = sum(size[name] for name in needed)
    cheap = min_cut_saved(forward, needed, size, banned=set(NEVER) | set(EXPENSIVE), kept=layers)
    least = min_cut_saved(forward, needed, size, banned=set(NEVER), kept=layers)
    target = max(budget * total, _bytes(least, size))
    base = cheap if _bytes(cheap, size) <= target else least
    producer = {t.name: n for n in forward for t in n.outputs}

    def cost_per_byte(name: str) -> float:
        return node_flops(producer[name]) / size[name]

    saved = set(base)
    for name in sorted((n for n in needed if n not in saved), key=cost_per_byte, reverse=True):
        if _bytes(saved | {name}, size) <= target:
            saved.add(name)
    return saved


def rewrite(graph: gs.Graph, forward: list[gs.Node], needed: Iterable[str], saved: Collection[str]) -> list[gs.Node]:
    """Give every backward reader of a needed, unsaved activation a recomputed copy of it:
    copies of the forward nodes from the saved tensors and the graph's inputs, placed just
    before the first backward node. Returns the copies."""
    producer = {id(t): n for n in forward for t in n.outputs}
    tensors = {t.name: t for n in forward for t in n.outputs}
    copies: dict[int, gs.Tensor] = {}  # forward tensor id -> its recomputed copy
    clones: list[gs.Node] = []

    def copy_of(root: gs.Tensor) -> gs.Tensor:
        stack = [root]
        while stack:  # iterative: a deep forward must not reach Python's recursion limit
            t = stack[-1]
            if id(t) in copies:
                stack.pop()
                continue
            node = producer[id(t)]
            pending = [i for i in node.inputs if id(i) in producer and i.name not in saved and id(i) not in copies]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            inputs = [copies.get(id(i), i) if id(i) in producer and i.name not in saved else i for i in node.inputs]
            outputs = [
                # (of the original's kind: a sequence, where the exporter split into one)
                gs.Variable(f"{roles.RECOMPUTE_PREFIX}{o.name}", dtype=o.dtype, shape=o.shape, type=o.type)
                if o.name
                else o
                for o in node.outputs
            ]
            clone = gs.Node(
                node.op,
                name=f"{roles.RECOMPUTE_PREFIX}{node.name or node.op}/{node.op}_{len(clones)}",
                attrs=dict(node.attrs),
                inputs=inputs,
                outputs=outputs,
                domain=node.domain,
            )
            clones.append(clone)
            for original, made in zip(node.outputs, outputs, strict=True):
                copies[id(original)] = made
        return copies[id(root)]

    unsaved = {name for name in needed if name not in saved}
    backward = [n for n in graph.nodes if (o := roles.node_origin(n.name or "")) and o[0] == "grad"]
    for node in backward:
        for i, t in enumerate(node.inputs):
            if t.name in unsaved and id(t) in producer:
                node.inputs[i] = copy_of(tensors[t.name])
    if clones:
        first_backward = id(backward[0])  # by identity: a node's == compares its fields
        first = next(i for i, n in enumerate(graph.nodes) if id(n) == first_backward)
        graph.nodes[first:first] = clones
    return clones


def saved_bytes(graph: gs.Graph, size: Mapping[str, int]) -> int:
    """Bytes of the forward activations the backward and the recomputed nodes now read."""
    forward = forward_nodes(graph)
    made = {t.name for n in forward for t in n.outputs}
    readers = [n for n in graph.nodes if (o := roles.node_origin(n.name or "")) and o[0] in ("grad", "recompute")]
    read = {t.name for n in readers for t in n.inputs if t.name in made}
    return sum(size.get(name, 0) for name in read)


def _bytes(names: Iterable[str], size: Mapping[str, int]) -> int:
    return sum(size.get(name, 0) for name in names)
