"""Matrix products: MatMul (with batch broadcasting and 1-D operands) and Gemm.

Both are linear in each operand with the other fixed, so each operand's gradient is dy
through the transposed product: dA = dY Bᵀ, dB = Aᵀ dY.
"""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES

linear = RULES.linear


@linear("MatMul")
def matmul(ctx, dy):
    # dA = dY Bᵀ, dB = Aᵀ dY. A batch times a matrix folds the batch into the matrix's rows
    # (or columns): its gradient is one 2-D product, with no [batch, K, N] intermediate to sum
    a, w = ctx.x(0), ctx.x(1)
    ra, rw = ctx.rank(a), ctx.rank(w)
    if ra > 2 and rw == 2:  # activations [..., K] @ weight [K, N]
        return [dy @ w.T, _gemm(ctx, a.flatten(ra - 1), dy.flatten(ra - 1), trans_a=1)]
    if ra == 2 and rw > 2:  # weight [M, K] @ activations [..., K, N]
        return [_gemm(ctx, _columns(dy, rw), _columns(w, rw), trans_b=1), a.T @ dy]
    return _batched(ctx, a, w, dy, ra, rw)


def _batched(ctx, a, w, dy, ra: int, rw: int):
    """MatMul's gradients as numpy defines the product: batch dims broadcast, a 1-D left operand
    is a row vector and a 1-D right one a column. The 1-D operands are promoted (dy with them),
    the batched gradients summed over the batch dims their operand was broadcast along, and
    the unit axes dropped again."""
    y_shape = list(ctx.y().shape)
    a2, w2 = a, w
    if ra == 1:
        axis = len(y_shape) - 1 if rw > 1 else 0
        a2, dy = _promoted(a, 0), dy.unsqueeze([axis])
        y_shape.insert(axis, 1)
    if rw == 1:
        w2, dy = _promoted(w, 1), dy.unsqueeze([len(y_shape)])
        y_shape.append(1)
    batch = y_shape[:-2]
    da, dw = dy @ w2.mT, a2.mT @ dy
    da = ctx.unbroadcast(da, [*batch, *a2.shape[-2:]], a2)
    dw = ctx.unbroadcast(dw, [*batch, *w2.shape[-2:]], w2)
    return [da.reshape_like(a) if ra == 1 else da, dw.reshape_like(w) if rw == 1 else dw]


def _columns(t, r: int):
    """``t`` [..., M, N] (rank ``r``) as the matrix [M, prod(...) * N]: the batch folded into the columns."""
    return t.transpose([r - 2, *range(r - 2), r - 1]).reshape([0, -1])


def _promoted(t, axis: int):
    """``t`` (1-D) with a unit axis inserted, annotated with its shape for un-broadcasting."""
    out = t.unsqueeze([axis])
    shape = list(t.shape)
    shape.insert(axis, 1)
    out.shape, out.dtype = shape, t.dtype
    return out


def _gemm(ctx, a, w, *, trans_a: int = 0, trans_b: int = 0, alpha: float = 1.0):
    """The 2-D product alpha * op(a) @ op(w), never a batched intermediate: Gemm without C
    (optional from opset 11), a MatMul of transposes before."""
    if ctx.opset >= 11:
        flags = {k: 1 for k, v in (("transA", trans_a), ("transB", trans_b)) if v}
        return ctx.op("Gemm", a, w, **flags, **({"alpha": alpha} if alpha != 1.0 else {}))
    product = (a.transpose([1, 0]) if trans_a else a) @ (w.transpose([1, 0]) if trans_b else w)
    return product if alpha == 1.0 else product * ctx.scalar(alpha, product if product.dtype else a)


def _scaled_gemm(ctx, a, w, alpha: float, **gemm_attrs):
    """Gemm(a, w) without C (optional from opset 11), or ``_gemm``'s products of transposes before."""
    if ctx.opset >= 11:
        return ctx.op("Gemm", a, w, alpha=alpha, **gemm_attrs)
    return _gemm(ctx, a, w, trans_a=gemm_attrs.get("transA", 0), trans_b=gemm_attrs.get("transB", 0), alpha=alpha)


@linear("Gemm")
def gemm(ctx, dy):
    # Y = alpha * A' B' + beta * C with A' = A^T if transA, B' = B^T if transB:
    # dA' = alpha dY B'^T and dB' = alpha A'^T dY, each written for the operand as it is stored
    a, w, c = ctx.x(0), ctx.x(1), ctx.x(2)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    ta, tb = ctx.attr("transA", 0), ctx.attr("transB", 0)
    if ta:  # dA = alpha B' dY^T
        da = _scaled_gemm(ctx, w, dy, alpha, transA=tb, transB=1)
    else:
        da = _scaled_gemm(ctx, dy, w, alpha, transB=0 if tb else 1)
    if tb:  # dB = alpha dY^T A'
        dw = _scaled_gemm(ctx, dy, a, alpha, transA=1, transB=ta)
    else:
        dw = _scaled_gemm(ctx, a, dy, alpha, transA=0 if ta else 1)
    dc = None if c is None else ctx.unbroadcast(dy if beta == 1.0 else dy * beta, ctx.y().shape, c)
    return [da, dw, dc]
