"""Control flow: If and Scan. (Loop has no rule yet: the driver's error says so.)"""

from __future__ import annotations

import onnx_graphsurgeon as gs
from graphforge.passes.autodiff.driver import build_subgraph_gradients, is_differentiable_type
from graphforge.passes.autodiff.expand import body_reads, copy_body, gradients_through
from graphforge.passes.autodiff.registry import RULES

from graphforge.builder import Builder

gradient = RULES.gradient


@gradient("If")
def if_(ctx, dys):
    # an If on the same condition whose branches hold each branch's gradient with respect to
    # the outer tensors the If reads (zeros from a branch that does not read one)
    outer = [t for t in ctx.inputs[1:] if ctx.wants(t)]
    if not outer:
        return [None] * len(ctx.inputs)
    branches = {k: _branch_gradient(ctx, ctx.attr(k), dys, outer, k) for k in ("then_branch", "else_branch")}
    grads = ctx.op("If", ctx.x(0), outputs=len(outer), **branches)
    grads = grads if isinstance(grads, list) else [grads]
    by_id = {id(t): g for t, g in zip(outer, grads, strict=True)}
    return [None, *(by_id.get(id(t)) for t in ctx.inputs[1:])]


def _branch_gradient(ctx, branch, dys, outer, label):
    prefix = ctx.b.fresh_name(label) + "/"
    body = copy_body(branch, prefix)
    reads = {id(t) for t in body_reads(body)}
    grads = gradients_through(ctx, body, dys, [t for t in outer if id(t) in reads], prefix)
    b = Builder(body, prefix=prefix + "grad")
    b.opset = ctx.opset
    outputs = []
    for t in outer:
        g = grads.get(id(t))
        g = b.op("Identity", g if g is not None else b.zeros_like(t))
        g.dtype, g.shape = t.dtype, list(t.shape) if t.shape is not None else None
        outputs.append(g)
    body.outputs = outputs
    return body


@gradient("Scan", since=9)
def scan(ctx, dys):
    # Backpropagation through the iterations: the forward Scan also stacks each iteration's
    # states (its inputs to the body); a Scan running the other way recomputes the body from
    # (state_i, x_i) and runs the driver's gradient of it, carrying the states' gradients,
    # summing the outer tensors' and stacking the scan inputs'. Stashing only the states keeps
    # memory at one state per step, not every intermediate; the body runs twice.
    node, body, m = ctx.node, ctx.attr("body"), ctx.attr("num_scan_inputs")
    n, k = len(node.inputs) - m, len(body.outputs) - len(node.inputs) + m
    # what the body reads from the enclosing scope, by its position in ctx.inputs (a tensor
    # that is also a state or scan input has the position of that input)
    first = {}
    for i, t in enumerate(ctx.inputs):
        first.setdefault(id(t), i)
    outer = [first[id(t)] for t in body_reads(body) if id(t) in first and ctx.wants(t)]
    wanted_x = [j for j in range(m) if ctx.wants(node.inputs[n + j])]
    if not outer and not wanted_x and not any(ctx.wants(t) for t in node.inputs[:n]):
        return [None] * len(ctx.inputs)
    prefix = ctx.b.fresh_name("scan_body") + "/"
    backward = copy_body(body, prefix)  # before the stash changes the body
    inputs, outputs = _scan_axes(ctx, n, m, k)
    stash = _stash_states(ctx, n, outputs)
    carried = _backward_body(ctx, backward, prefix, n, dys[n:], [ctx.inputs[i] for i in outer], wanted_x)
    starts = [dys[i] if dys[i] is not None else ctx.zeros_like(node.inputs[i]) for i in carried]
    starts += [ctx.zeros_like(ctx.inputs[i]) for i in outer]
    slices = [*stash, *node.inputs[n:], *[dy for dy in dys[n:] if dy is not None]]
    read = [(0, 0)] * n + inputs + [a for a, dy in zip(outputs, dys[n:], strict=True) if dy is not None]
    results = ctx.op(
        "Scan", *starts, *slices, outputs=len(starts) + len(wanted_x), body=backward, num_scan_inputs=len(slices),
        scan_input_axes=[a for a, _ in read], scan_input_directions=[1 - d for _, d in read],
        scan_output_axes=[inputs[j][0] for j in wanted_x], scan_output_directions=[1 - inputs[j][1] for j in wanted_x],
    )  # fmt: skip
    results = results if isinstance(results, list) else [results]
    parts: dict[int, list] = {}
    for position, g in zip([*carried, *outer, *[n + j for j in wanted_x]], results, strict=True):
        g.dtype = ctx.inputs[position].dtype
        parts.setdefault(position, []).append(g)
    return [ctx.sum(parts[i]) if i in parts and ctx.wants(t) else None for i, t in enumerate(ctx.inputs)]


def _scan_axes(ctx, n: int, m: int, k: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(axis, direction) of each scan input and each scan output, axes made non-negative."""
    body = ctx.attr("body")

    def read(prefix: str, slices) -> list[tuple[int, int]]:
        axes = list(ctx.attr(f"scan_{prefix}_axes") or [0] * len(slices))
        directions = list(ctx.attr(f"scan_{prefix}_directions") or [0] * len(slices))
        axes = [a + ctx.rank(t) + 1 if a < 0 else a for a, t in zip(axes, slices, strict=True)]  # stacked: one more
        return list(zip(axes, directions, strict=True))

    return read("input", body.inputs[n : n + m]), read("output", body.outputs[n : n + k])


def _stash_states(ctx, n: int, outputs: list[tuple[int, int]]) -> list[gs.Tensor]:
    """Make the forward Scan also output its states as they enter each iteration, stacked in
    iteration order on axis 0 (what the backward Scan recomputes each iteration from)."""
    node, body = ctx.node, ctx.attr("body")
    b = Builder(body, prefix=ctx.b.fresh_name("stash") + "/")
    b.opset = ctx.opset
    stacked = []
    for t in body.inputs[:n]:
        each = b.op("Identity", t)
        each.dtype, each.shape = t.dtype, t.shape
        body.outputs.append(each)
        stacked.append(gs.Variable(ctx.b.fresh_name("stashed_state"), dtype=t.dtype))
    while len(node.outputs) < n + len(outputs):
        node.outputs.append(gs.Variable.empty())
    node.outputs.extend(stacked)
    node.attrs["scan_output_axes"] = [a for a, _ in outputs] + [0] * n
    node.attrs["scan_output_directions"] = [d for _, d in outputs] + [0] * n
    return stacked


def _backward_body(ctx, graph: gs.Graph, prefix: str, n: int, dys, outer, wanted_x) -> list[int]:
    """Turn ``graph`` (a copy of the Scan's body) into one iteration of the backward Scan:
    inputs (the states' gradients, the outer tensors' so far; state_i, x_i, dy_i), outputs
    (the states' gradients one iteration earlier, the outer tensors' summed, dx_i).
    Returns the states that carry a gradient (the floating-point ones)."""
    states_in, xs_in = graph.inputs[:n], graph.inputs[n:]
    states_out, ys_out = graph.outputs[:n], graph.outputs[n:]
    b = Builder(graph, prefix=prefix + "grad/")
    b.opset = ctx.opset
    carried = [i for i, t in enumerate(states_in) if is_differentiable_type(t)]
    carries = [_like(b, states_in[i], "d_state") for i in carried]
    dy_in = [_like(b, y, "d_output") if dy is not None else None for y, dy in zip(ys_out, dys, strict=True)]
    sums = [_like(b, t, "d_outer") for t in outer]
    seeds = [(states_out[i], c) for i, c in zip(carried, carries, strict=True)]
    seeds += [(y, d) for y, d in zip(ys_out, dy_in, strict=True) if d is not None]
    wrt = [states_in[i] for i in carried] + [xs_in[j] for j in wanted_x] + list(outer)
    grads = build_subgraph_gradients(graph, seeds, wrt, opset=ctx.opset, prefix=prefix + "grad/")

    def total(t):
        g = grads.get(id(t))
        out = b.op("Identity", g) if g is not None else b.zeros_like(t)
        out.dtype = t.dtype
        return out

    results = [total(states_in[i]) for i in carried]
    results += [
        b.add(s, grads[id(t)]) if id(t) in grads else b.op("Identity", s) for s, t in zip(sums, outer, strict=True)
    ]
    results += [total(xs_in[j]) for j in wanted_x]
    for out, like in zip(results[len(carried) : len(carried) + len(sums)], outer, strict=True):
        out.dtype = like.dtype
    graph.inputs = [*carries, *sums, *states_in, *xs_in, *[d for d in dy_in if d is not None]]
    graph.outputs = results
    graph.cleanup(recurse_subgraphs=False)  # the forward outputs nothing reads any more
    return carried


def _like(b: Builder, t: gs.Tensor, what: str) -> gs.Variable:
    """A new body input of ``t``'s type and shape."""
    return gs.Variable(b.fresh_name(what), dtype=t.dtype, shape=t.shape)
