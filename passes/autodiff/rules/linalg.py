"""Matrix products: MatMul (with batch broadcasting and 1-D operands) and Gemm."""

from __future__ import annotations

from graphforge.passes.autodiff.registry import RULES

gradient = RULES.gradient


def _swap_last_two(ctx, t):
    r = len(t.shape)
    return ctx.b.transpose(t, [*range(r - 2), r - 1, r - 2])


@gradient("MatMul")
def matmul(ctx, dys):
    # numpy semantics: a 1-D left operand is a row vector, a 1-D right operand a column,
    # batch dims broadcast. A batched operand times a matrix: fold the batch into the
    # rows (or columns) so the matrix's gradient is one 2-D product, with no [batch, K, N]
    # intermediate to sum. Otherwise promote 1-D operands (and dy with them), take the
    # 2-D gradients, un-broadcast the batch dims, and drop the promoted axis again.
    b, a, w, dy = ctx.b, ctx.x(0), ctx.x(1), dys[0]
    ra, rw = ctx.rank(a), ctx.rank(w)
    if ra > 2 and rw == 2:  # activations [..., S, K] @ weight [K, N]: dW sums over the batch
        return [b.matmul(dy, _swap_last_two(ctx, w)), _gemm(ctx, _rows(ctx, a, ra), _rows(ctx, dy, ra), trans_a=1)]
    if ra == 2 and rw > 2:  # weight [M, K] @ activations [..., K, N]: dA sums over the batch
        return [_gemm(ctx, _cols(ctx, dy, rw), _cols(ctx, w, rw), trans_b=1), b.matmul(_swap_last_two(ctx, a), dy)]
    y_shape = list(ctx.y().shape)
    a2, w2 = a, w
    if ra == 1:
        axis = len(y_shape) - 1 if rw > 1 else 0
        a2, dy = _promoted(ctx, a, 0), b.unsqueeze(dy, [axis])
        y_shape.insert(axis, 1)
    if rw == 1:
        w2, dy = _promoted(ctx, w, 1), b.unsqueeze(dy, [len(y_shape)])
        y_shape.append(1)
    batch = y_shape[:-2]
    da = b.matmul(dy, _swap_last_two(ctx, w2))
    dw = b.matmul(_swap_last_two(ctx, a2), dy)
    da = ctx.unbroadcast(da, [*batch, *a2.shape[-2:]], a2)
    dw = ctx.unbroadcast(dw, [*batch, *w2.shape[-2:]], w2)
    if ra == 1:
        da = b.reshape_like(da, a)
    if rw == 1:
        dw = b.reshape_like(dw, w)
    return [da, dw]


def _rows(ctx, t, r: int):
    """``t`` [..., K] (rank ``r``) as the matrix [prod(...), K]: the batch folded into the rows."""
    return ctx.b.op("Flatten", t, axis=r - 1)


def _cols(ctx, t, r: int):
    """``t`` [..., M, N] (rank ``r``) as the matrix [M, prod(...) * N]: the batch folded into the columns."""
    moved = ctx.b.transpose(t, [r - 2, *range(r - 2), r - 1])
    return ctx.b.reshape(moved, [0, -1])


def _gemm(ctx, a, w, *, trans_a: int = 0, trans_b: int = 0, alpha: float = 1.0):
    """The 2-D product alpha * op(a) @ op(w), never a batched intermediate: Gemm once its C
    is optional (opset 11), MatMul of transposes before."""
    b = ctx.b
    if ctx.opset >= 11:
        attrs = {k: 1 for k, v in (("transA", trans_a), ("transB", trans_b)) if v}
        return b.op("Gemm", a, w, **attrs, **({"alpha": alpha} if alpha != 1.0 else {}))
    a = b.transpose(a, [1, 0]) if trans_a else a
    w = b.transpose(w, [1, 0]) if trans_b else w
    product = b.matmul(a, w)
    return product if alpha == 1.0 else b.mul(product, ctx.scalar(alpha, product if product.dtype else a))


def _promoted(ctx, t, axis: int):
    """``t`` (1-D) with a unit axis inserted, annotated with its shape for un-broadcasting."""
    out = ctx.b.unsqueeze(t, [axis])
    shape = list(t.shape)
    shape.insert(axis, 1)
    out.shape, out.dtype = shape, t.dtype
    return out


def _scaled_gemm(ctx, a, w, alpha: float, **gemm_attrs):
    """Gemm(a, w) without C (optional from opset 11), or ``_gemm``'s products of transposes before."""
    if ctx.opset >= 11:
        return ctx.b.op("Gemm", a, w, alpha=alpha, **gemm_attrs)
    return _gemm(ctx, a, w, trans_a=gemm_attrs.get("transA", 0), trans_b=gemm_attrs.get("transB", 0), alpha=alpha)


@gradient("Gemm")
def gemm(ctx, dys):
    # Y = alpha * A' B' + beta * C with A' = A^T if transA, B' = B^T if transB
    b, a, w, c, dy = ctx.b, ctx.x(0), ctx.x(1), ctx.x(2), dys[0]
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    ta, tb = ctx.attr("transA", 0), ctx.attr("transB", 0)
    if ta:
        da = _scaled_gemm(ctx, w, dy, alpha, transA=tb, transB=1)
    else:
        da = _scaled_gemm(ctx, dy, w, alpha, transB=0 if tb else 1)
    if tb:
        dw = _scaled_gemm(ctx, dy, a, alpha, transA=1, transB=ta)
    else:
        dw = _scaled_gemm(ctx, a, dy, alpha, transA=0 if ta else 1)
    dc = None
    if c is not None:
        scaled = dy if beta == 1.0 else b.mul(dy, ctx.scalar(beta, dy))
        dc = ctx.unbroadcast(scaled, ctx.y().shape, c)
    return [da, dw, dc]
