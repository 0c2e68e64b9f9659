"""Tensor algebra beyond MatMul/Gemm: Einsum (any equation onnxruntime runs) and Det.

Einsum is multilinear, so the gradient of each operand is one more Einsum: the output's
gradient contracted with the other operands into that operand's subscripts. Two things
an einsum cannot write directly are added as extra operands of that same Einsum:

* a letter repeated in the operand (a diagonal, ``ii->i``): the copies get fresh letters
  and an identity matrix ties each copy to the original (``...,ik`` with ``I``);
* a letter only that operand has (summed away, ``ij->i``): a ones tensor over those
  letters broadcasts the gradient back along them.
"""

from __future__ import annotations

import string

import numpy as np
from graphforge.passes.autodiff.registry import RULES
from onnx import numpy_helper

gradient, linear = RULES.gradient, RULES.linear

_ELLIPSIS = "."  # one token for "..." once a term is tokenized


def _tokens(term: str) -> list[str]:
    return list(term.replace(" ", "").replace("...", _ELLIPSIS))


def _terms(ctx) -> tuple[list[list[str]], list[str]]:
    """(input terms, output term) as token lists; implicit outputs spelled out as ONNX
    defines them: the letters used exactly once, in alphabetical order, after any ellipsis."""
    lhs, arrow, rhs = ctx.attr("equation").replace(" ", "").partition("->")
    inputs = [_tokens(t) for t in lhs.split(",")]
    if arrow:
        return inputs, _tokens(rhs)
    letters = [t for term in inputs for t in term if t != _ELLIPSIS]
    once = sorted(t for t in set(letters) if letters.count(t) == 1)
    return inputs, ([_ELLIPSIS] if any(_ELLIPSIS in term for term in inputs) else []) + once


def _axis_of(term: list[str], position: int, rank: int) -> int:
    """The tensor axis of the token at ``position`` (an ellipsis spans rank - len(term) + 1 axes)."""
    if _ELLIPSIS in term and position > term.index(_ELLIPSIS):
        return position - len(term) + rank
    return position


def _dims(term: list[str], shape) -> dict:
    """label -> dim for one operand; ellipsis axes are labelled ('.', k)."""
    shape = list(shape)
    out = {}
    for pos, token in enumerate(term):
        if token == _ELLIPSIS:
            span = len(shape) - len(term) + 1
            for k in range(span):
                out[(_ELLIPSIS, k)] = shape[pos + k]
        else:
            out[token] = shape[_axis_of(term, pos, len(shape))]
    return out


def _filled(ctx, like, dims: list, value):
    """A tensor of ``like``'s dtype and shape ``dims`` (ints or 1-element int64 tensors)."""
    dtype = like.dtype if like.dtype is not None else np.float32
    if all(isinstance(d, int) for d in dims):
        return ctx.const(np.eye(dims[0], dtype=dtype) if value == "eye" else np.ones(dims, dtype=dtype))
    shape = ctx.concat([ctx.ints([d]) if isinstance(d, int) else d for d in dims], axis=0)
    fill = numpy_helper.from_array(np.array([0.0 if value == "eye" else 1.0], dtype=dtype))
    filled = shape.op("ConstantOfShape", value=fill)
    return filled.op("EyeLike") if value == "eye" else filled


def _dim(ctx, x, axis: int):
    """Size of ``x`` along ``axis``: an int when static, else a 1-element int64 tensor."""
    d = x.shape[axis]
    return int(d) if isinstance(d, int | np.integer) else ctx.shape(x, axis, axis + 1)


@linear("Einsum", since=12)
def einsum(ctx, dy):
    # multilinear: each operand's gradient is the Einsum of dy with the others
    inputs, output = _terms(ctx)
    return [_einsum_operand_grad(ctx, inputs, output, k, dy) for k in range(len(inputs))]


def _einsum_operand_grad(ctx, inputs, output, k: int, dy):
    a = ctx.x(k)
    term, rank = inputs[k], ctx.rank(a)
    used = {t for tt in [*inputs, output] for t in tt}
    fresh = [c for c in string.ascii_letters if c not in used]
    operands = [dy, *[ctx.x(i) for i in range(len(inputs)) if i != k]]
    terms = [output, *[inputs[i] for i in range(len(inputs)) if i != k]]
    # a repeated letter (a diagonal): the copy gets a fresh letter and an identity ties them
    renamed, seen = [], set()
    for pos, token in enumerate(term):
        if token != _ELLIPSIS and token in seen:
            if not fresh:
                ctx.fail(f"Einsum {ctx.attr('equation')!r}: no letter left to name a repeated subscript's copy")
            new = fresh.pop(0)
            operands.append(_filled(ctx, a, [_dim(ctx, a, _axis_of(term, pos, rank))] * 2, "eye"))
            terms.append([token, new])
            token = new
        seen.add(token)
        renamed.append(token)
    # letters no other operand has: a ones tensor broadcasts the gradient along them
    elsewhere = {t for tt in terms for t in tt}
    missing = [(pos, t) for pos, t in enumerate(renamed) if t != _ELLIPSIS and t not in elsewhere]
    if missing:
        operands.append(_filled(ctx, a, [_dim(ctx, a, _axis_of(term, pos, rank)) for pos, _ in missing], "ones"))
        terms.append([t for _, t in missing])
    # inputs that have an ellipsis make the result have one: an operand without it gets
    # the ellipsis axes in front, and the driver-style un-broadcast below sums them away
    lead = any(_ELLIPSIS in t for t in terms) and _ELLIPSIS not in renamed
    result = [_ELLIPSIS, *renamed] if lead else renamed
    equation = ",".join("".join(t).replace(_ELLIPSIS, "...") for t in terms)
    grad = ctx.op("Einsum", *operands, equation=f"{equation}->{''.join(result).replace(_ELLIPSIS, '...')}")
    shapes = [ctx.y().shape, *[o.shape for o in operands[1:]]]  # dy is shaped like y
    return ctx.unbroadcast(grad, _result_shape(shapes, terms, term, a, lead), a)


def _result_shape(shapes, terms, term, a, lead: bool) -> list | None:
    """The gradient Einsum's result shape as far as it is known: ``a``'s dim where every
    other operand agrees with it (or is 1), None where the operands broadcast ``a``."""
    mine = _dims(term, a.shape)
    others: dict = {}
    for shape, t in zip(shapes, terms, strict=True):
        if shape is not None:
            for label, d in _dims(t, shape).items():
                others.setdefault(label, []).append(d)
    shape = []
    for token in term:
        labels = [(_ELLIPSIS, i) for i in range(len(a.shape) - len(term) + 1)] if token == _ELLIPSIS else [token]
        for label in labels:
            d = mine[label]
            agree = all(o == d or o == 1 for o in others.get(label, []))
            shape.append(d if agree else None)
    if lead:
        span = next(
            (len(s) - len(t) + 1 for s, t in zip(shapes, terms, strict=True) if s is not None and _ELLIPSIS in t), None
        )
        if span is None:
            return None  # unknown: the un-broadcast is decided at run time
        shape = [None] * span + shape
    return shape


@gradient("Det", since=11)
def det(ctx, dys):
    # d det(A) / dA is the cofactor matrix: C_ij = (-1)^(i+j) det(A without row i, column j).
    # ai.onnx has no matrix inverse (det * inv(A)^T), and cofactors hold for singular A too.
    # The minors come from two static Gathers, so the matrix size must be static.
    a, dy = ctx.x(0), dys[0]
    r, n = ctx.rank(a), a.shape[-1]
    if not isinstance(n, int | np.integer):
        ctx.fail("Det gradients need a static matrix size (the minors are gathered with fixed indices)")
    if n == 1:
        return [dy.reshape_like(a)]
    keep = ctx.const(np.array([[j for j in range(n) if j != i] for i in range(n)], dtype=np.int64))
    rows = a.op("Gather", keep, axis=r - 2)  # [..., i, n-1, n]
    minors = rows.op("Gather", keep, axis=r)  # [..., i, n-1, j, n-1]
    minors = minors.transpose([*range(r - 2), r - 2, r, r - 1, r + 1])  # [..., i, j, n-1, n-1]
    signs = (-1.0) ** np.add.outer(np.arange(n), np.arange(n))
    cofactors = minors.op("Det") * ctx.const(signs.astype(a.dtype if a.dtype is not None else np.float32))
    return [cofactors * dy.unsqueeze([r - 2, r - 1])]
