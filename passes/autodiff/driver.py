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
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.autodiff.context import GradContext
from graphforge.passes.autodiff.registry import RULES, RuleRegistry

from graphforge.analysis import topological_order
from graphforge.builder import Builder
from graphforge.errors import PassError
from graphforge.ir import gc_paused

GRAD_PREFIX = "grad::"


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
) -> dict[int, gs.Tensor]:
    """Append the backward graph of ``loss`` to ``graph``.

    Returns ``id(tensor) -> gradient tensor`` for each tensor of ``wrt`` the loss depends
    on (tensors it does not depend on are absent).
    """
    with gc_paused():
        return _build(graph, loss, wrt, registry)


def _build(graph: gs.Graph, loss: gs.Tensor, wrt: Sequence[gs.Tensor], registry: RuleRegistry) -> dict[int, gs.Tensor]:
    opset = graph.opset or 1
    order = [graph.nodes[i] for i in topological_order(graph)]
    relevant, relevant_tensors = _relevant(order, loss, wrt)
    builder = Builder(graph, prefix=GRAD_PREFIX)
    grads: dict[int, list[gs.Tensor]] = {id(loss): [_seed(builder, loss)]}
    reached_from: dict[int, gs.Node] = {}  # tensor id -> the node whose rule sent it a gradient
    wrt_ids = {id(t) for t in wrt}
    totals: dict[int, gs.Tensor] = {}  # tensor id -> its total gradient, once its producer was visited
    forward_ids = {id(n) for n in order}

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
            raise _missing_rule(node, opset, registry, reached_from, loss)
        if not rule.differentiable:
            continue
        with builder.scope(node.name or node.op):
            ctx = GradContext(node, builder, opset, totals=totals, forward_ids=forward_ids)
            dxs = list(rule.fn(ctx, dys))
            # rules may list every optional input; trailing ones the node omits must get None
            while len(dxs) > len(node.inputs) and dxs[-1] is None:
                dxs.pop()
            if len(dxs) != len(node.inputs):
                raise PassError(
                    f"gradient rule for {node.op} returned {len(dxs)} gradients for {len(node.inputs)} inputs",
                    node=node.name,
                    op_type=node.op,
                )
            for x, dx in zip(node.inputs, dxs, strict=True):
                if dx is None or x.is_empty() or id(x) not in relevant_tensors or not is_differentiable_type(x):
                    continue
                if rule.broadcast:
                    peers = [t for t in node.inputs if t is not x and not t.is_empty()]
                    dx = ctx.unbroadcast(dx, node.outputs[0].shape, x, peers)
                grads.setdefault(id(x), []).append(dx)
                reached_from.setdefault(id(x), node)

    result = {}
    for t in wrt:
        total = _total(builder, grads.get(id(t)))
        if total is not None:
            result[id(t)] = total
    return result


def _relevant(order: list[gs.Node], loss: gs.Tensor, wrt: Sequence[gs.Tensor]) -> tuple[set[int], set[int]]:
    """(ids of nodes, ids of tensors) on a path from ``wrt`` to ``loss`` through float tensors."""
    needs_grad = {id(t) for t in wrt}
    downstream = set()  # nodes reading a tensor that needs a gradient (a wrt tensor's own producer may not)
    for node in order:  # forward: what depends on a wrt tensor through float tensors
        if any(id(t) in needs_grad for t in node.inputs):
            downstream.add(id(node))
            needs_grad.update(id(t) for t in node.outputs if is_differentiable_type(t))
    feeds_loss = {id(loss)}
    nodes = set()
    for node in reversed(order):  # backward: what the loss depends on
        if any(id(t) in feeds_loss for t in node.outputs):
            if id(node) in downstream:
                nodes.add(id(node))
            feeds_loss.update(id(t) for t in node.inputs)
    return nodes, needs_grad & feeds_loss


def _seed(builder: Builder, loss: gs.Tensor) -> gs.Tensor:
    dtype = loss.dtype if loss.dtype is not None else np.float32
    shape = tuple(d if isinstance(d, int) else 1 for d in (loss.shape or ()))
    return builder.constant(np.ones(shape, dtype=dtype))


def _total(builder: Builder, contributions: list[gs.Tensor] | None) -> gs.Tensor | None:
    if not contributions:
        return None
    return builder.sum(contributions)


def _missing_rule(node: gs.Node, opset: int, registry: RuleRegistry, reached_from: dict, loss: gs.Tensor) -> PassError:
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
    path.append(f"loss {loss.name!r}")
    rule = registry.get(node.op, node.domain)
    if rule is not None:
        covered = f"{rule.since}+" if rule.until is None else f"{rule.since}-{rule.until}"
        reason = f"the rule for {node.op} covers opsets {covered}, the model uses opset {opset}"
    else:
        near = difflib.get_close_matches(node.op, registry.op_types(), n=5, cutoff=0.5)
        reason = "no gradient rule is registered" + (f"; supported ops near it: {', '.join(near)}" if near else "")
    domain = node.domain or "ai.onnx"
    return MissingGradientRule(
        f"cannot differentiate op {node.op} (domain {domain}, opset {opset}) in node {node.name!r}: {reason}. "
        f"Path from the loss: {' <- '.join(reversed(path))}"
    )
