"""Control flow: If. (Loop and Scan have no rule yet: the driver's error says so.)"""

from __future__ import annotations

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
    grads = ctx.b.op("If", ctx.x(0), outputs=len(outer), **branches)
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
