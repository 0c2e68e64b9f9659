"""Elementwise ops: unary activations and math, broadcasting binary and variadic ops."""

from __future__ import annotations

import math

from graphforge.passes.autodiff.registry import RULES

gradient, unary, nondifferentiable = RULES.gradient, RULES.unary, RULES.nondifferentiable


def _where_positive(ctx, dy, otherwise, tested=None):
    """dy where the input (or ``tested``) is > 0, ``otherwise`` elsewhere (ReLU-family masks)."""
    t = ctx.x(0) if tested is None else tested
    return ctx.b.op("Where", ctx.b.op("Greater", t, ctx.scalar(0.0, t)), dy, otherwise)


def _sqrt_of(ctx, t):
    return ctx.b.op("Sqrt", t)


def _one_minus_sq(ctx, t):
    return ctx.b.sub(ctx.scalar(1.0, t), ctx.b.mul(t, t))


# ----------------------------------------------------------------------------- unary

unary("Identity", lambda ctx, dy: dy)
unary("Neg", lambda ctx, dy: ctx.b.neg(dy))
unary("Abs", lambda ctx, dy: ctx.b.mul(dy, ctx.b.op("Sign", ctx.x(0))))
# Relu's mask from its output (y > 0 exactly where x > 0): then the input is not kept for the
# backward, and onnxruntime can fuse the producer with the Relu (Conv+Relu, Gemm+Relu)
unary("Relu", lambda ctx, dy: _where_positive(ctx, dy, ctx.scalar(0.0, dy), ctx.y()))
unary("LeakyRelu", lambda ctx, dy: _where_positive(ctx, dy, ctx.b.mul(dy, ctx.scalar(ctx.attr("alpha", 0.01), dy))))
unary(
    "Elu",
    lambda ctx, dy: _where_positive(ctx, dy, ctx.b.mul(dy, ctx.b.add(ctx.y(), ctx.scalar(ctx.attr("alpha", 1.0), dy)))),
)
unary("Exp", lambda ctx, dy: ctx.b.mul(dy, ctx.y()))
unary("Log", lambda ctx, dy: ctx.b.div(dy, ctx.x(0)))
unary("Sqrt", lambda ctx, dy: ctx.b.div(dy, ctx.b.mul(ctx.y(), ctx.scalar(2.0, dy))))
unary("Reciprocal", lambda ctx, dy: ctx.b.neg(ctx.b.mul(dy, ctx.b.mul(ctx.y(), ctx.y()))))
unary("Sigmoid", lambda ctx, dy: ctx.b.mul(dy, ctx.b.mul(ctx.y(), ctx.b.sub(ctx.scalar(1.0, dy), ctx.y()))))
unary("Tanh", lambda ctx, dy: ctx.b.mul(dy, _one_minus_sq(ctx, ctx.y())))
unary("Sin", lambda ctx, dy: ctx.b.mul(dy, ctx.b.op("Cos", ctx.x(0))))
unary("Cos", lambda ctx, dy: ctx.b.neg(ctx.b.mul(dy, ctx.b.op("Sin", ctx.x(0)))))
unary("Tan", lambda ctx, dy: ctx.b.mul(dy, ctx.b.add(ctx.scalar(1.0, dy), ctx.b.mul(ctx.y(), ctx.y()))))
unary("Asin", lambda ctx, dy: ctx.b.div(dy, _sqrt_of(ctx, _one_minus_sq(ctx, ctx.x(0)))))
unary("Acos", lambda ctx, dy: ctx.b.neg(ctx.b.div(dy, _sqrt_of(ctx, _one_minus_sq(ctx, ctx.x(0))))))
unary("Atan", lambda ctx, dy: ctx.b.div(dy, ctx.b.add(ctx.scalar(1.0, dy), ctx.b.mul(ctx.x(0), ctx.x(0)))))
unary("Sinh", lambda ctx, dy: ctx.b.mul(dy, ctx.b.op("Cosh", ctx.x(0))))
unary("Cosh", lambda ctx, dy: ctx.b.mul(dy, ctx.b.op("Sinh", ctx.x(0))))
unary(
    "Asinh", lambda ctx, dy: ctx.b.div(dy, _sqrt_of(ctx, ctx.b.add(ctx.b.mul(ctx.x(0), ctx.x(0)), ctx.scalar(1.0, dy))))
)
unary(
    "Acosh", lambda ctx, dy: ctx.b.div(dy, _sqrt_of(ctx, ctx.b.sub(ctx.b.mul(ctx.x(0), ctx.x(0)), ctx.scalar(1.0, dy))))
)
unary("Atanh", lambda ctx, dy: ctx.b.div(dy, _one_minus_sq(ctx, ctx.x(0))))
unary("Softplus", lambda ctx, dy: ctx.b.mul(dy, ctx.b.op("Sigmoid", ctx.x(0))))
unary(
    "Softsign", lambda ctx, dy: ctx.b.div(dy, _square(ctx, ctx.b.add(ctx.scalar(1.0, dy), ctx.b.op("Abs", ctx.x(0)))))
)
unary("ThresholdedRelu", lambda ctx, dy: _where_above(ctx, dy, ctx.attr("alpha", 1.0)))


def _square(ctx, t):
    return ctx.b.mul(t, t)


def _where_above(ctx, dy, threshold):
    b, x = ctx.b, ctx.x(0)
    return b.op("Where", b.op("Greater", x, ctx.scalar(threshold, x)), dy, ctx.scalar(0.0, dy))


@gradient("Erf")
def erf(ctx, dys):
    b, x = ctx.b, ctx.x(0)
    gauss = b.op("Exp", b.neg(b.mul(x, x)))
    return [b.mul(dys[0], b.mul(gauss, ctx.scalar(2.0 / math.sqrt(math.pi), x)))]


@gradient("Selu")
def selu(ctx, dys):
    alpha, gamma = ctx.attr("alpha", 1.67326319217681884765625), ctx.attr("gamma", 1.05070102214813232421875)
    b, dy = ctx.b, dys[0]
    negative = b.mul(dy, b.add(ctx.y(), ctx.scalar(alpha * gamma, dy)))
    return [_where_positive(ctx, b.mul(dy, ctx.scalar(gamma, dy)), negative)]


@gradient("Celu")
def celu(ctx, dys):
    b, x, dy = ctx.b, ctx.x(0), dys[0]
    alpha = ctx.attr("alpha", 1.0)
    return [_where_positive(ctx, dy, b.mul(dy, b.op("Exp", b.div(x, ctx.scalar(alpha, x)))))]


@gradient("HardSigmoid")
def hard_sigmoid(ctx, dys):
    b, x, dy = ctx.b, ctx.x(0), dys[0]
    alpha, beta = ctx.attr("alpha", 0.2), ctx.attr("beta", 0.5)
    z = b.add(b.mul(x, ctx.scalar(alpha, x)), ctx.scalar(beta, x))
    inside = b.op("And", b.op("Greater", z, ctx.scalar(0.0, x)), b.op("Less", z, ctx.scalar(1.0, x)))
    return [b.op("Where", inside, b.mul(dy, ctx.scalar(alpha, dy)), ctx.scalar(0.0, dy))]


@gradient("HardSwish", since=14)
def hard_swish(ctx, dys):
    # y = x * clip(x/6 + 1/2, 0, 1): slope 0 below -3, 1 above 3, x/3 + 1/2 between
    b, x, dy = ctx.b, ctx.x(0), dys[0]
    slope = b.add(b.div(x, ctx.scalar(3.0, x)), ctx.scalar(0.5, x))
    slope = b.op("Where", b.op("Less", x, ctx.scalar(-3.0, x)), ctx.scalar(0.0, x), slope)
    slope = b.op("Where", b.op("Greater", x, ctx.scalar(3.0, x)), ctx.scalar(1.0, x), slope)
    return [b.mul(dy, slope)]


@gradient("Mish", since=18)
def mish(ctx, dys):
    b, x = ctx.b, ctx.x(0)
    t = b.op("Tanh", b.op("Softplus", x))
    slope = b.add(t, b.mul(b.mul(x, b.op("Sigmoid", x)), _one_minus_sq(ctx, t)))
    return [b.mul(dys[0], slope)]


@gradient("Gelu", since=20)
def gelu(ctx, dys):
    b, x = ctx.b, ctx.x(0)
    if ctx.attr("approximate", "none") == "tanh":
        k = math.sqrt(2.0 / math.pi)
        x2 = b.mul(x, x)
        inner = b.mul(ctx.scalar(k, x), b.add(x, b.mul(ctx.scalar(0.044715, x), b.mul(x2, x))))
        t = b.op("Tanh", inner)
        d_inner = b.mul(ctx.scalar(k, x), b.add(ctx.scalar(1.0, x), b.mul(ctx.scalar(3 * 0.044715, x), x2)))
        slope = b.add(
            b.mul(ctx.scalar(0.5, x), b.add(ctx.scalar(1.0, x), t)),
            b.mul(b.mul(ctx.scalar(0.5, x), x), b.mul(_one_minus_sq(ctx, t), d_inner)),
        )
    else:
        cdf = b.mul(
            ctx.scalar(0.5, x), b.add(ctx.scalar(1.0, x), b.op("Erf", b.mul(x, ctx.scalar(1 / math.sqrt(2), x))))
        )
        pdf = b.mul(b.op("Exp", b.mul(b.mul(x, x), ctx.scalar(-0.5, x))), ctx.scalar(1 / math.sqrt(2 * math.pi), x))
        slope = b.add(cdf, b.mul(x, pdf))
    return [b.mul(dys[0], slope)]


@gradient("Cast")
def cast(ctx, dys):
    # back to the input's type; a cast from an integer input carries no gradient (the driver drops it)
    return [ctx.b.cast(dys[0], ctx.x(0).dtype) if ctx.x(0).dtype is not None else dys[0]]


@gradient("CastLike", since=15)
def cast_like(ctx, dys):
    return [ctx.b.cast_like(dys[0], ctx.x(0)), None]


@gradient("Clip", settings={1: "the lower bound, a number in torch", 2: "the upper bound, a number in torch"})
def clip(ctx, dys):
    # y = min(max(x, low), high), as torch's clamp: x takes dy where low <= x <= high (bounds
    # included); a tensor bound (opset 11+) takes the sum of dy where it is the result:
    # low where x < low <= high, high where max(x, low) > high (so all of it when low > high)
    b, x, dy = ctx.b, ctx.x(0), dys[0]
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
            keep = inside if keep is None else b.op("And", keep, inside)
    dx = dy if keep is None else b.op("Where", keep, dy, ctx.scalar(0.0, dy))
    grads = [dx, None, None]
    if ctx.opset >= 11 and low is not None and ctx.wants(low):
        below = b.op("Not", ctx.at_least(x, low))
        if high is not None:
            below = b.op("And", below, ctx.at_most(low, high))
        grads[1] = _sum_where(ctx, below, dy, low)
    if ctx.opset >= 11 and high is not None and ctx.wants(high):
        raised = x if low is None else b.op("Max", x, low)
        grads[2] = _sum_where(ctx, b.op("Not", ctx.at_most(raised, high)), dy, high)
    return grads[: len(ctx.node.inputs)]


def _sum_where(ctx, mask, dy, like):
    """The sum of dy where ``mask`` holds, shaped like ``like`` (a scalar bound)."""
    b = ctx.b
    total = b.axes_op("ReduceSum", b.op("Where", mask, dy, ctx.scalar(0.0, dy)), None, keepdims=0)
    return b.reshape_like(total, like)


@gradient("Dropout", since=12, settings={1: "ratio: a hyperparameter, a number in torch"})
def dropout(ctx, dys):
    # y = x * mask / (1 - ratio) in training mode, y = x otherwise
    b, dy = ctx.b, dys[0]
    training = ctx.const_value(2)
    if ctx.x(2) is None or (training is not None and not bool(training.reshape(-1)[0])):
        return [dy, *[None] * (len(ctx.node.inputs) - 1)]
    ratio = ctx.x(1) if ctx.x(1) is not None else ctx.scalar(0.5, dy)
    mask = ctx.ensure_output(1, "dropout_mask")
    scale = b.div(ctx.scalar(1.0, dy), b.sub(ctx.scalar(1.0, dy), b.cast_like(ratio, dy)))
    if training is None:  # decided at run time
        scale = b.op("Where", ctx.x(2), scale, ctx.scalar(1.0, dy))
    dx = b.mul(b.mul(dy, b.cast_like(mask, dy)), scale)
    return [dx, None, None]


# ----------------------------------------------------------------------------- binary, broadcasting

gradient("Add", broadcast=True)(lambda ctx, dys: [dys[0], dys[0]])
gradient("Sub", broadcast=True)(lambda ctx, dys: [dys[0], ctx.b.neg(dys[0])])
gradient("Mul", broadcast=True)(lambda ctx, dys: [ctx.b.mul(dys[0], ctx.x(1)), ctx.b.mul(dys[0], ctx.x(0))])
gradient("Div", broadcast=True)(
    lambda ctx, dys: [ctx.b.div(dys[0], ctx.x(1)), ctx.b.neg(ctx.b.div(ctx.b.mul(dys[0], ctx.y()), ctx.x(1)))]
)


@gradient("Pow", broadcast=True)
def pow_(ctx, dys):
    b, a, e, dy = ctx.b, ctx.x(0), ctx.x(1), dys[0]
    e_float = b.cast_like(e, a)
    da = b.mul(dy, b.mul(e_float, b.op("Pow", a, b.sub(e_float, ctx.scalar(1.0, a)))))
    # torch: d/de = y * log(a), taken as 0 where a == 0 (and e >= 0) instead of nan
    log_a = b.op("Log", a)
    de = b.op("Where", ctx.equal(a, ctx.scalar(0.0, a)), ctx.scalar(0.0, dy), b.mul(dy, b.mul(ctx.y(), log_a)))
    return [da, de]


@gradient("PRelu", broadcast=True)
def prelu(ctx, dys):
    b, x, slope, dy = ctx.b, ctx.x(0), ctx.x(1), dys[0]
    positive = b.op("Greater", x, ctx.scalar(0.0, x))
    return [
        b.op("Where", positive, dy, b.mul(dy, slope)),
        b.op("Where", positive, ctx.scalar(0.0, dy), b.mul(dy, x)),
    ]


@gradient("Where", broadcast=True)
def where(ctx, dys):
    b, cond, dy = ctx.b, ctx.x(0), dys[0]
    zero = ctx.scalar(0.0, dy)
    return [None, b.op("Where", cond, dy, zero), b.op("Where", cond, zero, dy)]


@gradient("Sum", broadcast=True)
def sum_(ctx, dys):
    return [dys[0]] * len(ctx.node.inputs)


@gradient("Mean", broadcast=True)
def mean(ctx, dys):
    share = ctx.b.div(dys[0], ctx.scalar(float(len(ctx.node.inputs)), dys[0]))
    return [share] * len(ctx.node.inputs)


def _select_extreme(ctx, dys):
    """Max/Min: the gradient goes to the inputs equal to the result, split evenly on ties
    (torch.maximum / torch.minimum do the same)."""
    b, y, dy = ctx.b, ctx.y(), dys[0]
    masks = [b.cast_like(ctx.equal(x, y), dy) for x in ctx.node.inputs]
    if len(masks) == 1:
        return [dy]
    share = b.div(dy, b.sum(masks))
    return [b.mul(share, m) for m in masks]


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
