"""The autodiff driver: the work every rule shares.

1. Which nodes matter: those on a path from a tensor we differentiate with respect to,
   through floating-point tensors, to the loss. Everything else is never visited.
2. Order: reverse of a topological order computed iteratively (networkx), never by
   recursion, so 100k-node graphs are fine.
3. Summing: a tensor read by several nodes gets the Sum of their contributions.
4. Stop-gradient: integer and bool tensors take no gradient; non-differentiable ops stop it.
5. Un-broadcasting for rules flagged ``broadcast`` (GradContext.unbroadcast: static
   ReduceSum when shapes are known, axes computed at run time when dims are symbolic).
6. Errors: an op without a rule names op type, domain, opset, node and the path from the loss.
7. Control flow: the outer tensors an If/Loop/Scan body reads count as inputs of its node
   (``node_inputs``) in every walk (relevance, order, summing); a rule returns one gradient
   per such input too. ``build_subgraph_gradients`` runs this same driver inside a body.
8. Hooks: what the model says of one node beyond its op (an embedding lookup whose padding row
   torch gives no gradient) rewrites the gradients reaching that node's outputs before its
   rule runs, so the rule stays the op's and the forward stays as it is.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.autodiff.context import GradContext
from graphforge.passes.autodiff.registry import RULES, RuleRegistry
from graphforge.passes.autodiff.values import raw

from graphforge import roles
from graphforge.builder import Builder
from graphforge.dag import outer_inputs, topological_order
from graphforge.errors import PassError
from graphforge.ir import gc_paused

GRAD_PREFIX = roles.GRAD_PREFIX
#: case 8: rewrites the gradients reaching a node's outputs (Values, None where none reaches one)
Hook = Callable[[GradContext, list], list]


class MissingGradientRule(PassError):
    """The loss depends on a parameter through an op that has no gradient rule."""


def is_differentiable_type(t: gs.Tensor) -> bool:
    """Floating-point tensors carry gradients; an unknown type is given the benefit of the doubt."""
    if t.dtype is None:
        return True
    try:
        return np.issubdtype(np.dtype(t.dtype), np.floating)
    except TypeError:  # onnx-only types (bfloat16, float8) come through as onnx enums
        return True


def build_gradients(
    graph: gs.Graph,
    loss: gs.Tensor,
    wrt: Sequence[gs.Tensor],
    *,
    registry: RuleRegistry = RULES,
    hooks: Mapping[int, Hook] | None = None,
) -> dict[int, gs.Tensor]:
    """Append the backward graph of ``loss`` to ``graph``.

    Returns ``id(tensor) -> gradient tensor`` for each tensor of ``wrt`` the loss depends
    on (tensors it does not depend on are absent). ``hooks``: id(node) -> its hook (case 8).
    """
    with gc_paused():
        builder = Builder(graph, prefix=GRAD_PREFIX)
        seeds = [(loss, _seed(builder, loss))]
        return _build(graph, builder, seeds, wrt, registry, graph.opset or 1, f"loss {loss.name!r}", hooks or {})


def build_subgraph_gradients(
    graph: gs.Graph,
    seeds: Sequence[tuple[gs.Tensor, gs.Tensor]],
    wrt: Sequence[gs.Tensor],
    *,
    opset: int,
    prefix: str,
    registry: RuleRegistry = RULES,
    hooks: Mapping[int, Hook] | None = None,
) -> dict[int, gs.Tensor]:
    """The backward graph of a (sub)graph whose tensors ``seeds[i][0]`` receive the gradients
    ``seeds[i][1]`` (tensors of an enclosing scope, say), appended to ``graph``; names start with ``prefix``."""
    builder = Builder(graph, prefix=prefix)
    builder.opset = opset
    return _build(graph, builder, seeds, wrt, registry, opset, "the body's outputs", hooks or {})


def node_inputs(node: gs.Node) -> list[gs.Tensor]:
    """A node's inputs, then the outer tensors its subgraphs read (initializers included)."""
    if not any(isinstance(v, gs.Graph) for v in node.attrs.values()):
        return node.inputs
    own = {id(t) for t in node.inputs}
    return [*node.inputs, *(t for t in outer_inputs(node, constants=True) if id(t) not in own)]


def _build(
    graph: gs.Graph,
    builder: Builder,
    seeds: Sequence[tuple[gs.Tensor, gs.Tensor]],
    wrt: Sequence[gs.Tensor],
    registry: RuleRegistry,
    opset: int,
    target: str,
    hooks: Mapping[int, Hook],
) -> dict[int, gs.Tensor]:
    order = [graph.nodes[i] for i in topological_order(graph)]
    inputs = {id(n): node_inputs(n) for n in order}
    relevant, relevant_tensors = _relevant(order, inputs, [t for t, _ in seeds], wrt, registry)
    grads: dict[int, list[gs.Tensor]] = {}
    for t, seed in seeds:
        grads.setdefault(id(t), []).append(seed)
    reached_from: dict[int, gs.Node] = {}  # tensor id -> the node whose rule sent it a gradient
    wrt_ids = {id(t) for t in wrt}
    totals: dict[int, gs.Tensor] = {}  # tensor id -> its total gradient, once its producer was visited
    forward_ids = {id(n) for n in order}
    constants: dict = {}  # GradContext.const_value's, for the whole walk

    for node in reversed(order):
        if id(node) not in relevant:
            continue
        dys = [_total(builder, grads.pop(id(y), None)) for y in node.outputs]
        for y, dy in zip(node.outputs, dys, strict=True):
            if dy is not None:
                totals[id(y)] = dy
            if dy is not None and id(y) in wrt_ids:  # a computed tensor asked for: keep its total
                grads[id(y)] = [dy]
        if all(dy is None for dy in dys):
            continue
        rule = registry.get(node.op, node.domain)
        if rule is None or not rule.covers(opset):
            raise _missing_rule(node, opset, registry, reached_from, target, inputs)
        if not rule.differentiable:
            continue
        xs = inputs[id(node)]
        with builder.scope(node.name or node.op):
            ctx = GradContext(
                node,
                builder,
                opset,
                totals=totals,
                forward_ids=forward_ids,
                wanted=relevant_tensors,
                inputs=xs,
                constants=constants,
            )
            hook = hooks.get(id(node))
            given = [ctx.value(dy) for dy in dys]
            dxs = list(rule.fn(ctx, hook(ctx, given) if hook is not None else given))
            # rules may list every optional input; trailing ones the node omits must get None
            while len(dxs) > len(xs) and dxs[-1] is None:
                dxs.pop()
            if len(dxs) != len(xs):
                raise PassError(
                    f"gradient rule for {node.op} returned {len(dxs)} gradients for {len(xs)} inputs",
                    node=node.name,
                    op_type=node.op,
                )
            for x, dx in zip(xs, dxs, strict=True):
                if dx is None or x.is_empty() or id(x) not in relevant_tensors:
                    continue
                if rule.broadcast:
                    peers = [t for t in node.inputs if t is not x and not t.is_empty()]
                    dx = ctx.unbroadcast(dx, node.outputs[0].shape, x, peers)
                grads.setdefault(id(x), []).append(raw(dx))
                reached_from.setdefault(id(x), node)

    result = {}
    for t in wrt:
        total = _total(builder, grads.get(id(t)))
        if total is not None:
            result[id(t)] = total
    return result


def _relevant(
    order: list[gs.Node], inputs: dict[int, list[gs.Tensor]], targets, wrt: Sequence[gs.Tensor], registry: RuleRegistry
) -> tuple[set[int], set[int]]:
    """(ids of nodes, ids of tensors) on a path from ``wrt`` to a target through tensors
    that carry gradients: floating-point ones, and the integer results of straight-through
    ops (QuantizeLinear, see Rule.straight_through)."""
    needs_grad = {id(t) for t in wrt if is_differentiable_type(t)}
    downstream = set()  # nodes reading a tensor that needs a gradient (a wrt tensor's own producer may not)
    for node in order:  # forward: what depends on a wrt tensor through float tensors
        if any(id(t) in needs_grad for t in inputs[id(node)]):
            downstream.add(id(node))
            rule = registry.get(node.op, node.domain)
            through = rule is not None and rule.straight_through
            needs_grad.update(id(t) for t in node.outputs if through or is_differentiable_type(t))
    feeds_loss = {id(t) for t in targets}
    nodes = set()
    for node in reversed(order):  # backward: what the targets depend on
        if any(id(t) in feeds_loss for t in node.outputs):
            if id(node) in downstream:
                nodes.add(id(node))
            feeds_loss.update(id(t) for t in inputs[id(node)])
    return nodes, needs_grad & feeds_loss


def _seed(builder: Builder, loss: gs.Tensor) -> gs.Tensor:
    """dL/dloss = 1, named ``seed_name(loss)`` (loss scaling multiplies the scale into it)."""
    dtype = loss.dtype if loss.dtype is not None else np.float32
    shape = tuple(d if isinstance(d, int) else 1 for d in (loss.shape or ()))
    seed = builder.constant(np.ones(shape, dtype=dtype))
    seed.name = seed_name(loss)
    return seed


def seed_name(loss: gs.Tensor) -> str:
    return f"{GRAD_PREFIX}{loss.name}/seed"


def _total(builder: Builder, contributions: list[gs.Tensor] | None) -> gs.Tensor | None:
    if not contributions:
        return None
    return builder.sum(contributions)


#: ONNX ops without a rule, by the rules family (rules/<family>.py) where their kin live,
#: with what to do about them where there is something better to say than "no rule"
_UNSUPPORTED = {
    "Loop": ("control_flow", "gradients through Loop bodies are not supported yet (If and Scan are); "
             "export with the loop unrolled (static trip count) or keep parameters out of its body"),
    "DeformConv": ("conv", None), "ConvInteger": ("conv", None), "QLinearConv": ("conv", None),
    "Col2Im": ("conv", None), "MaxRoiPool": ("pool", None), "RoiAlign": ("pool", None),
    "MatMulInteger": ("linalg", None), "QLinearMatMul": ("linalg", None),
    "DynamicQuantizeLinear": ("quantize", None),
}  # fmt: skip


#: families whose rules live in more than one module
_KIN = {"pool": ("pool", "pooling_extra")}


def _family(rule) -> str:
    return rule.module.rsplit(".", 1)[-1]


def _missing_rule(
    node: gs.Node, opset: int, registry: RuleRegistry, reached_from: dict, target: str, inputs: dict
) -> PassError:
    path = [f"{node.op} {node.name!r}"]
    current = node
    seen = {id(current)}
    while True:
        nxt = next((reached_from[id(t)] for t in current.outputs if id(t) in reached_from), None)
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        path.append(f"{nxt.op} {nxt.name!r}")
        current = nxt
    path.append(target)
    rule = registry.get(node.op, node.domain)
    if rule is not None:
        covered = f"{rule.since}+" if rule.until is None else f"{rule.since}-{rule.until}"
        reason = f"the rule for {node.op} covers opsets {covered}, the model uses opset {opset}"
    else:
        reason = "no gradient rule is registered" + _what_is_supported(node, registry, inputs)
    domain = node.domain or "ai.onnx"
    return MissingGradientRule(
        f"cannot differentiate op {node.op} (domain {domain}, opset {opset}) in node {node.name!r}: {reason}. "
        f"Path from the {target.split(' ')[0]}: {' <- '.join(reversed(path))}"
    )


def _what_is_supported(node: gs.Node, registry: RuleRegistry, inputs: dict) -> str:
    """What helps with a node that has no rule: a hint for its kind of op, the supported
    ops of its family, and those of its neighbours in the graph (what a rewrite could use)."""
    if node.domain not in (None, "", "ai.onnx"):  # a runtime's fusion of standard ops, usually named after them
        similar = difflib.get_close_matches(node.op, registry.op_types(), n=3, cutoff=0.5)
        return (f"; ops of domain {node.domain!r} are a runtime's fusions: export without them (no onnxruntime "
                f"transformer optimizations before training)" + (f"; ai.onnx ops named like it: {', '.join(similar)}"
                if similar else ""))  # fmt: skip
    family, hint = _UNSUPPORTED.get(node.op, (None, None))
    parts = [hint] if hint else []
    if family is not None:
        modules = _KIN.get(family, (family,))
        kin = sorted(r.op_type for r in registry if _family(r) in modules and r.differentiable)
        parts.append(f"supported {family} ops: {', '.join(kin)}" if kin else f"no {family} op has a rule")
    producers = [t.inputs[0].op for t in inputs.get(id(node), node.inputs) if t.inputs]
    consumers = [n.op for t in node.outputs for n in t.outputs]
    near = sorted({op for op in producers + consumers if registry.get(op) is not None})
    if near:
        parts.append(f"its neighbours' ops, which have rules: {', '.join(near)}")
    return "".join(f"; {p}" for p in parts)
