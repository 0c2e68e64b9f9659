"""The per-op table: one or more rows per gradient rule (see gradcheck.Case).

Inputs are small and seeded; ranges keep away from kinks and domain edges (Relu at 0,
Log at 0, Acosh below 1) so central differences are a fair oracle.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from gradcheck import Case, away_from_zero, ints

rng = np.random.default_rng(0)
r = partial(away_from_zero, rng)


def pos(*shape, low=0.5, high=2.0):
    return rng.uniform(low, high, size=shape)


UNARY = [
    ("Identity", r(3, 4)), ("Neg", r(3, 4)), ("Abs", r(3, 4)), ("Relu", r(3, 4)), ("Exp", r(3, 4)),
    ("Log", pos(3, 4)), ("Sqrt", pos(3, 4)), ("Reciprocal", pos(3, 4)), ("Sigmoid", r(3, 4)), ("Tanh", r(3, 4)),
    ("Sin", r(3, 4)), ("Cos", r(3, 4)), ("Tan", r(3, 4, low=-1, high=1)), ("Asin", r(3, 4, low=-0.9, high=0.9)),
    ("Acos", r(3, 4, low=-0.9, high=0.9)), ("Atan", r(3, 4)), ("Sinh", r(3, 4)), ("Cosh", r(3, 4)),
    ("Asinh", r(3, 4)), ("Acosh", pos(3, 4, low=1.2, high=3)), ("Atanh", r(3, 4, low=-0.9, high=0.9)),
    ("Softplus", r(3, 4)), ("Softsign", r(3, 4)), ("Erf", r(3, 4)), ("Elu", r(3, 4)), ("Selu", r(3, 4)),
    ("Celu", r(3, 4)), ("HardSigmoid", r(3, 4, low=-4, high=4)), ("HardSwish", r(3, 4, low=-5, high=5)),
    ("Mish", r(3, 4)), ("ThresholdedRelu", r(3, 4)),
]  # fmt: skip

CASES: list[Case] = [Case(op, [x]) for op, x in UNARY]
CASES += [
    Case("LeakyRelu", [r(3, 4)], {"alpha": 0.2}),
    Case("Gelu", [r(3, 4)], opset=20, id="Gelu-erf"),
    Case("Gelu", [r(3, 4)], {"approximate": "tanh"}, opset=20, id="Gelu-tanh"),
    # float64 -> float32 -> float64: the oracle sees float32 rounding, hence the looser tolerance
    Case("Cast", [r(3, 4)], {"to": 1}, eps=1e-3, rtol=1e-3, atol=1e-3, id="Cast-to-float"),
    Case("CastLike", [r(3, 4), np.zeros((1,), np.float32)], grad=[0]),
    Case("Clip", [r(3, 4), np.array(-1.0), np.array(1.0)], grad=[0], const=(1, 2)),
    Case("Clip", [r(3, 4), None, np.array(0.5)], grad=[0], const=(2,), id="Clip-max-only"),
    # tensor bounds take the sum of dy where they are the result (torch's clamp)
    Case("Clip", [r(3, 4), np.array(-0.6), np.array(0.7)], id="Clip-bounds"),
    Case("Clip", [r(3, 4), np.array(0.4), np.array(-0.3)], id="Clip-min-above-max"),
    Case("Clip", [r(3, 4), None, np.array(0.5)], grad=[0, 2], id="Clip-max-only-bound"),
    Case("Dropout", [r(3, 4), np.array(0.3), np.array(False)], grad=[0], const=(1, 2), id="Dropout-inference"),
    # binary, broadcasting: same shapes, a row vector, a scalar, leading dims
    Case("Add", [r(3, 4), r(3, 4)]),
    Case("Add", [r(2, 3, 4), r(4)], id="Add-broadcast"),
    Case("Sub", [r(3, 1), r(1, 4)], id="Sub-outer"),
    Case("Mul", [r(2, 3, 4), r(3, 1)], id="Mul-broadcast"),
    Case("Div", [r(3, 4), pos(4)], id="Div-broadcast"),
    Case("Pow", [pos(3, 4), r(3, 4, low=-1.5, high=1.5)], id="Pow"),
    Case("Pow", [r(3, 4), np.array(2.0)], grad=[0], const=(1,), id="Pow-square"),
    Case("PRelu", [r(2, 3, 4), r(3, 1)]),
    Case("Where", [rng.random((3, 4)) > 0.5, r(3, 4), r(4)]),
    Case("Sum", [r(3, 4), r(4), r(3, 1)]),
    Case("Mean", [r(3, 4), r(4), r(3, 1)]),
    Case("Max", [r(3, 4), r(3, 4), r(4)]),
    Case("Min", [r(3, 4), r(3, 4), r(4)]),
    # linear algebra
    Case("MatMul", [r(3, 4), r(4, 5)]),
    Case("MatMul", [r(2, 3, 4), r(4, 5)], id="MatMul-batched-left"),
    Case("MatMul", [r(2, 1, 3, 4), r(3, 4, 2)], id="MatMul-batch-broadcast"),
    Case("MatMul", [r(4), r(2, 4, 3)], id="MatMul-vector-left"),
    Case("MatMul", [r(2, 3, 4), r(4)], id="MatMul-vector-right"),
    Case("MatMul", [r(4), r(4)], id="MatMul-dot"),
    Case("Gemm", [r(3, 4), r(4, 5), r(5)], {"alpha": 0.5, "beta": 2.0}),
    Case("Gemm", [r(4, 3), r(5, 4), r(3, 1)], {"transA": 1, "transB": 1}, id="Gemm-transposed"),
    Case("Gemm", [r(3, 4), r(5, 4)], {"transB": 1}, id="Gemm-no-bias"),
    # reductions (opset 18: axes are inputs)
    Case("ReduceSum", [r(2, 3, 4), ints(1)], const=(1,), grad=[0]),
    Case("ReduceSum", [r(2, 3, 4), ints(0, 2)], {"keepdims": 0}, const=(1,), grad=[0], id="ReduceSum-drop"),
    Case("ReduceSum", [r(2, 3, 4)], {"keepdims": 0}, id="ReduceSum-all"),
    Case("ReduceMean", [r(2, 3, 4), ints(-1)], {"keepdims": 0}, const=(1,), grad=[0]),
    Case("ReduceMean", [r(2, 3, 4)], id="ReduceMean-all"),
    Case("ReduceSumSquare", [r(2, 3, 4), ints(1)], const=(1,), grad=[0]),
    Case("ReduceL1", [r(2, 3, 4), ints(2)], const=(1,), grad=[0]),
    Case("ReduceL2", [r(2, 3, 4), ints(2)], {"keepdims": 0}, const=(1,), grad=[0]),
    Case("ReduceLogSumExp", [r(2, 3, 4), ints(1)], const=(1,), grad=[0]),
    Case("ReduceLogSum", [pos(2, 3, 4), ints(1)], const=(1,), grad=[0]),
    Case("ReduceProd", [r(2, 3, 4), ints(1)], const=(1,), grad=[0]),
    Case("ReduceMax", [r(2, 3, 4), ints(1)], {"keepdims": 0}, const=(1,), grad=[0]),
    Case("ReduceMin", [r(2, 3, 4), ints(0, 2)], const=(1,), grad=[0]),
    # data movement
    Case("Reshape", [r(2, 3, 4), ints(4, -1)], const=(1,), grad=[0]),
    Case("Flatten", [r(2, 3, 4)], {"axis": 2}),
    Case("Squeeze", [r(2, 1, 4), ints(1)], const=(1,), grad=[0]),
    Case("Unsqueeze", [r(2, 4), ints(0, 3)], const=(1,), grad=[0]),
    Case("Transpose", [r(2, 3, 4)], {"perm": [2, 0, 1]}),
    Case("Transpose", [r(2, 3, 4)], id="Transpose-default"),
    Case("Expand", [r(3, 1), ints(2, 3, 4)], const=(1,), grad=[0]),
    Case("Concat", [r(2, 3), r(2, 1), r(2, 2)], {"axis": 1}),
    Case("Concat", [r(2, 3), r(1, 3)], {"axis": -2}, id="Concat-negative-axis"),
    Case("Split", [r(2, 6), ints(2, 4)], {"axis": 1}, const=(1,), grad=[0], outputs=2),
    Case("Split", [r(4, 3)], {"axis": 0, "num_outputs": 2}, outputs=2, id="Split-even"),
    Case("Slice", [r(4, 6), ints(1, -5), ints(3, 100), ints(0, 1), ints(1, 2)], const=(1, 2, 3, 4), grad=[0]),
    Case("Slice", [r(5, 3), ints(-1), ints(-100), ints(0), ints(-2)], const=(1, 2, 3, 4), grad=[0], id="Slice-reverse"),
    Case("Gather", [r(5, 3), np.array([[0, 2], [2, -1]], np.int64)], grad=[0]),
    Case("Gather", [r(2, 5, 3), np.array([4, 0, 4], np.int64)], {"axis": 1}, grad=[0], id="Gather-axis1"),
    Case("Gather", [r(5, 3), np.array([1, 1, 3], np.int64)], grad=[0], opset=13, id="Gather-onehot-opset13"),
    Case("GatherElements", [r(3, 4), np.array([[0, 1, 1, 2], [2, 2, 0, 0]], np.int64)], grad=[0]),
    Case("GatherND", [r(3, 4, 2), np.array([[0, 1], [2, 3], [0, 1]], np.int64)], grad=[0]),
    # neural-network ops
    Case("Softmax", [r(2, 3, 4)], {"axis": 1}),
    # before opset 13 symbolic dims cannot be un-broadcast (no run-time axes): static only
    Case("Softmax", [r(3, 4)], opset=11, symbolic=False, id="Softmax-opset11"),
    Case("LogSoftmax", [r(2, 3, 4)]),
    Case("LayerNormalization", [r(2, 3, 4), r(4), r(4)], {"epsilon": 1e-3}),
    Case("LayerNormalization", [r(2, 3, 4), r(3, 4)], {"axis": 1}, id="LayerNormalization-2d-no-bias"),
    # the loss reads Mean and InvStdDev too (the rule once dropped what reached them); they are
    # float32 (stash_type 1) even for float64 inputs: a larger eps keeps the oracle above that rounding
    Case(
        "LayerNormalization",
        [r(2, 3, 4), r(4), r(4)],
        {"epsilon": 1e-3},
        outputs=3,
        eps=1e-3,
        rtol=2e-3,
        atol=2e-3,
        id="LayerNormalization-statistics",
    ),
    Case(
        "LayerNormalization",
        [r(2, 3, 4), r(3, 4)],
        {"axis": 1},
        outputs=3,
        eps=1e-3,
        rtol=2e-3,
        atol=2e-3,
        id="LayerNormalization-2d-statistics",
    ),
    # losses
    Case("NegativeLogLikelihoodLoss", [r(4, 3), np.array([0, 2, 1, 2], np.int64)], grad=[0]),
    Case(
        "NegativeLogLikelihoodLoss",
        [r(4, 3, 2), np.array([[0, 2], [1, -1], [2, 2], [-1, 0]], np.int64), pos(3)],
        {"reduction": "mean", "ignore_index": -1},
        grad=[0],
        id="NLL-weighted-ignore",
    ),
    Case(
        "NegativeLogLikelihoodLoss", [r(4, 3), np.array([0, 2, 1, 2], np.int64)], {"reduction": "none"}, id="NLL-none"
    ),
    Case("SoftmaxCrossEntropyLoss", [r(4, 3), np.array([0, 2, 1, 2], np.int64)]),
    Case(
        "SoftmaxCrossEntropyLoss",
        [r(4, 3), np.array([0, 2, 1, 2], np.int64)],
        {"reduction": "sum", "ignore_index": 1},
        outputs=2,
        id="SoftmaxCrossEntropyLoss-logprob",
    ),
]

# Non-differentiable ops: a row feeds a float input through the op; the loss must get
# no gradient from it.
NONDIFFERENTIABLE_CASES: list[Case] = [
    Case(op, inputs, attrs)
    for op, inputs, attrs in [
        ("Shape", [r(2, 3)], {}), ("Size", [r(2, 3)], {}), ("Equal", [r(3), r(3)], {}), ("Less", [r(3), r(3)], {}),
        ("LessOrEqual", [r(3), r(3)], {}), ("Greater", [r(3), r(3)], {}), ("GreaterOrEqual", [r(3), r(3)], {}),
        ("ArgMax", [r(3, 4)], {}), ("ArgMin", [r(3, 4)], {}), ("NonZero", [r(3, 4)], {}), ("IsNaN", [r(3)], {}),
        ("IsInf", [r(3)], {}), ("Sign", [r(3)], {}), ("Floor", [r(3)], {}), ("Ceil", [r(3)], {}), ("Round", [r(3)], {}),
        ("RandomNormalLike", [r(3)], {}), ("RandomUniformLike", [r(3)], {}), ("Bernoulli", [pos(3, low=0, high=1)], {}),
        ("EyeLike", [r(3, 3)], {}), ("ConstantOfShape", [ints(2, 3)], {}),
        ("Range", [np.array(0.0), np.array(3.0), np.array(1.0)], {}),
        ("OneHot", [ints(0, 2), ints(3), np.array([0.0, 1.0])], {}),
        ("Multinomial", [np.log(pos(2, 3))], {}),
        ("Not", [np.array([True, False])], {}), ("And", [np.array([True]), np.array([False])], {}),
        ("Or", [np.array([True]), np.array([False])], {}), ("Xor", [np.array([True]), np.array([False])], {}),
        ("BitShift", [np.array([4], np.uint32), np.array([1], np.uint32)], {"direction": "LEFT"}),
    ]
]  # fmt: skip

from op_cases_misc import MISC_CASES, MISC_NONDIFFERENTIABLE  # noqa: E402

CASES += MISC_CASES
NONDIFFERENTIABLE_CASES += MISC_NONDIFFERENTIABLE
from op_cases_cnn import CNN_CASES  # noqa: E402

CASES += CNN_CASES
from op_cases_composite import COMPOSITE_CASES  # noqa: E402

CASES += COMPOSITE_CASES
from op_cases_recurrent import RECURRENT_CASES  # noqa: E402

CASES += RECURRENT_CASES
