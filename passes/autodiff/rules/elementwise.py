"""Elementwise ops: unary activations and math, broadcasting binary and variadic ops.

The formulas are written with the Values' operators; their parentheses are the association
the rounding follows (``dy * (y * (1 - y))`` is not ``dy * y * (1 - y)`` in floating point).
"""

from __future__ import annotations

import math

from graphforge.passes.autodiff.registry import RULES

gradient, linear, unary, nondifferentiable = RULES.gradient, RULES.linear, RULES.unary, RULES.nondifferentiable


def _where_positive(ctx, dy, otherwise):
    """dy where the input is > 0, ``otherwise`` elsewhere (ReLU-family masks)."""
    return ctx.where(ctx.x(0) > 0, dy, otherwise)


def _square(t):
    return t * t


# ----------------------------------------------------------------------------- unary

linear("Identity")(lambda ctx, dy: dy)
linear("Neg")(lambda ctx, dy: -dy)
unary("Abs", lambda ctx, dy: dy * ctx.x(0).sign())
# Relu's mask from its output (y > 0 exactly where x > 0): then the input is not kept for the
# backward, and onnxruntime can fuse the producer with the Relu (Conv+Relu, Gemm+Relu)
unary("Relu", lambda ctx, dy: ctx.where(ctx.y() > 0, dy, 0.0))
unary("LeakyRelu", lambda ctx, dy: _where_positive(ctx, dy, dy * ctx.attr("alpha", 0.01)))
unary("Elu", lambda ctx, dy: _where_positive(ctx, dy, dy * (ctx.y() + ctx.attr("alpha", 1.0))))
unary("Exp", lambda ctx, dy: dy * ctx.y())
unary("Log", lambda ctx, dy: dy / ctx.x(0))
unary("Sqrt", lambda ctx, dy: dy / (ctx.y() * 2))
unary("Reciprocal", lambda ctx, dy: -(dy * _square(ctx.y())))
unary("Sigmoid", lambda ctx, dy: dy * (ctx.y() * (1 - ctx.y())))
unary("Tanh", lambda ctx, dy: dy * (1 - _square(ctx.y())))
unary("Sin", lambda ctx, dy: dy * ctx.x(0).op("Cos"))
unary("Cos", lambda ctx, dy: -(dy * ctx.x(0).op("Sin")))
unary("Tan", lambda ctx, dy: dy * (1 + _square(ctx.y())))
unary("Asin", lambda ctx, dy: dy / (1 - _square(ctx.x(0))).sqrt())
unary("Acos", lambda ctx, dy: -(dy / (1 - _square(ctx.x(0))).sqrt()))
unary("Atan", lambda ctx, dy: dy / (1 + _square(ctx.x(0))))
unary("Sinh", lambda ctx, dy: dy * ctx.x(0).op("Cosh"))
unary("Cosh", lambda ctx, dy: dy * ctx.x(0).op("Sinh"))
unary("Asinh", lambda ctx, dy: dy / (_square(ctx.x(0)) + 1).sqrt())
unary("Acosh", lambda ctx, dy: dy / (_square(ctx.x(0)) - 1).sqrt())
unary("Atanh", lambda ctx, dy: dy / (1 - _square(ctx.x(0))))
unary("Softplus", lambda ctx, dy: dy * ctx.x(0).sigmoid())
unary("Softsign", lambda ctx, dy: dy / _square(1 + ctx.x(0).abs()))
unary("ThresholdedRelu", lambda ctx, dy: ctx.where(ctx.x(0) > ctx.attr("alpha", 1.0), dy, 0.0))


@gradient("Erf")
def erf(ctx, dys):
    x = ctx.x(0)
    return [dys[0] * ((-_square(x)).exp() * (2.0 / math.sqrt(math.pi)))]


@gradient("Selu")
def selu(ctx, dys):
    alpha, gamma = ctx.attr("alpha", 1.67326319217681884765625), ctx.attr("gamma", 1.05070102214813232421875)
    dy = dys[0]
    negative = dy * (ctx.y() + alpha * gamma)
    return [_where_positive(ctx, dy * gamma, negative)]


@gradient("Celu")
def celu(ctx, dys):
    x, dy = ctx.x(0), dys[0]
    return [_where_positive(ctx, dy, dy * (x / ctx.attr("alpha", 1.0)).exp())]


@gradient("HardSigmoid")
def hard_sigmoid(ctx, dys):
    x, dy = ctx.x(0), dys[0]
    alpha, beta = ctx.attr("alpha", 0.2), ctx.attr("beta", 0.5)
    z = x * alpha + beta
    return [ctx.where((z > 0) & (z < 1), dy * alpha, 0.0)]


@gradient("HardSwish", since=14)
def hard_swish(ctx, dys):
    # y = x * clip(x/6 + 1/2, 0, 1): slope 0 below -3, 1 above 3, x/3 + 1/2 between
    x = ctx.x(0)
    slope = x / 3 + 0.5
    slope = ctx.where(x < -3, 0.0, slope)
    slope = ctx.where(x > 3, 1.0, slope)
    return [dys[0] * slope]


@gradient("Mish", since=18)
def mish(ctx, dys):
    # y = x tanh(softplus(x)), softplus' = sigmoid
    x = ctx.x(0)
    t = x.op("Softplus").tanh()
    return [dys[0] * (t + x * x.sigmoid() * (1 - _square(t)))]


@gradient("Gelu", since=20)
def gelu(ctx, dys):
    x = ctx.x(0)
    if ctx.attr("approximate", "none") == "tanh":
        # y = x/2 (1 + tanh(u)), u = k (x + 0.044715 x^3)
        k = math.sqrt(2.0 / math.pi)
        x2 = x * x
        t = (k * (x + 0.044715 * (x2 * x))).tanh()
        du = k * (1 + (3 * 0.044715) * x2)
        slope = 0.5 * (1 + t) + (0.5 * x) * ((1 - _square(t)) * du)
    else:  # y = x Φ(x): slope Φ(x) + x φ(x)
        cdf = 0.5 * (1 + (x * (1 / math.sqrt(2))).op("Erf"))
        pdf = (_square(x) * -0.5).exp() * (1 / math.sqrt(2 * math.pi))
        slope = cdf + x * pdf
    return [dys[0] * slope]


# back to the input's type; a cast from an integer input carries no gradient (the driver drops it)
linear("Cast")(lambda ctx, dy: dy.cast(ctx.x(0).dtype) if ctx.x(0).dtype is not None else dy)
linear("CastLike", since=15)(lambda ctx, dy: dy.cast_like(ctx.x(0)))


@gradient("Clip", settings={1: "the lower bound, a number in torch", 2: "the upper bound, a number in torch"})
def clip(ctx, dys):
    # y = min(max(x, low), high), as torch's clamp: x takes dy where low <= x <= high (bounds
    # included); a tensor bound (opset 11+) takes the sum of dy where it is the result:
    # low where x < low <= high, high where max(x, low) > high (so all of it when low > high)
    x, dy = ctx.x(0), dys[0]
    if ctx.opset >= 11:
        low, high = ctx.x(1), ctx.x(2)
    else:
        low, high = ctx.attr("min"), ctx.attr("max")
        low = None if low is None else ctx.scalar(low, x)
        high = None if high is None else ctx.scalar(high, x)
    keep = None
    for bound, compare in ((low, ctx.at_least), (high, ctx.at_most)):
        if bound is not None:
            inside = compare(x, bound)
            keep = inside if keep is None else keep & inside
    grads = [dy if keep is None else ctx.where(keep, dy, 0.0), None, None]
    if ctx.opset >= 11 and low is not None and ctx.wants(low):
        below = ~ctx.at_least(x, low)
        if high is not None:
            below = below & ctx.at_most(low, high)
        grads[1] = _sum_where(ctx, below, dy, low)
    if ctx.opset >= 11 and high is not None and ctx.wants(high):
        raised = x if low is None else x.op("Max", low)
        grads[2] = _sum_where(ctx, ~ctx.at_most(raised, high), dy, high)
    return grads[: len(ctx.node.inputs)]


def _sum_where(ctx, mask, dy, like):
    """The sum of dy where ``mask`` holds, shaped like ``like`` (a scalar bound)."""
    return ctx.where(mask, dy, 0.0).sum(keepdims=False).reshape_like(like)


@gradient("Dropout", since=12, settings={1: "ratio: a hyperparameter, a number in torch"})
def dropout(ctx, dys):
    # y = x * mask / (1 - ratio) in training mode, y = x otherwise
    dy = dys[0]
    training = ctx.const_value(2)
    if ctx.x(2) is None or (training is not None and not bool(training.reshape(-1)[0])):
        return [dy, *[None] * (len(ctx.node.inputs) - 1)]
    ratio = ctx.x(1) if ctx.x(1) is not None else ctx.scalar(0.5, dy)
    mask = ctx.ensure_output(1, "dropout_mask")
    scale = 1 / (1 - ratio.cast_like(dy))
    if training is None:  # decided at run time
        scale = ctx.where(ctx.x(2), scale, 1.0)
    return [dy * mask.cast_like(dy) * scale, None, None]


# ----------------------------------------------------------------------------- binary, broadcasting

linear("Add", broadcast=True)(lambda ctx, dy: [dy, dy])
linear("Sub", broadcast=True)(lambda ctx, dy: [dy, -dy])
linear("Mul", broadcast=True)(lambda ctx, dy: [dy * ctx.x(1), dy * ctx.x(0)])
gradient("Div", broadcast=True)(lambda ctx, dys: [dys[0] / ctx.x(1), -(dys[0] * ctx.y() / ctx.x(1))])


@gradient("Pow", broadcast=True)
def pow_(ctx, dys):
    a, dy = ctx.x(0), dys[0]
    e = ctx.x(1).cast_like(a)
    da = dy * (e * a.op("Pow", e - 1))
    # torch: d/de = y * log(a), taken as 0 where a == 0 (and e >= 0) instead of nan
    log_a = a.log()
    return [da, ctx.where(ctx.equal(a, 0.0), 0.0, dy * (ctx.y() * log_a))]


@gradient("PRelu", broadcast=True)
def prelu(ctx, dys):
    x, slope, dy = ctx.x(0), ctx.x(1), dys[0]
    positive = x > 0
    return [ctx.where(positive, dy, dy * slope), ctx.where(positive, 0.0, dy * x)]


@gradient("Where", broadcast=True)
def where(ctx, dys):
    cond, dy = ctx.x(0), dys[0]
    zero = ctx.scalar(0.0, dy)
    return [None, ctx.where(cond, dy, zero), ctx.where(cond, zero, dy)]


linear("Sum", broadcast=True)(lambda ctx, dy: [dy] * len(ctx.node.inputs))
linear("Mean", broadcast=True)(lambda ctx, dy: [dy / float(len(ctx.node.inputs))] * len(ctx.node.inputs))


def _select_extreme(ctx, dys):
    """Max/Min: the gradient goes to the inputs equal to the result, split evenly on ties
    (torch.maximum / torch.minimum do the same)."""
    y, dy = ctx.y(), dys[0]
    masks = [ctx.equal(x, y).cast_like(dy) for x in ctx.node.inputs]
    if len(masks) == 1:
        return [dy]
    share = dy / ctx.sum(masks)
    return [share * m for m in masks]


gradient("Max", broadcast=True)(_select_extreme)
gradient("Min", broadcast=True)(_select_extreme)

# ----------------------------------------------------------------------------- no gradient

nondifferentiable(
    # integer or boolean results
    "Shape", "Size", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "ArgMax", "ArgMin", "NonZero", "IsNaN", "IsInf", "BitShift", "OneHot", "Range", "EyeLike", "ConstantOfShape",
    # a zero derivative almost everywhere
    "Sign", "Floor", "Ceil", "Round",
    # sampling: the result is not a function of the inputs' values
    "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial",
)  # fmt: skip
