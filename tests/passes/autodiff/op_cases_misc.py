"""Table rows for the algebra, indexing and special-math rules (appended to op_cases.CASES)."""

from __future__ import annotations

from functools import partial

import numpy as np
from gradcheck import Case, away_from_zero, ints

rng = np.random.default_rng(7)
r = partial(away_from_zero, rng)


def einsum(equation: str, *inputs, **kwargs) -> Case:
    return Case("Einsum", list(inputs), {"equation": equation}, id=f"Einsum[{equation}]", **kwargs)


EINSUM_CASES = [
    einsum("ij,jk->ik", r(3, 4), r(4, 2)),
    einsum("ij,jk", r(3, 4), r(4, 2)),  # implicit output: ik
    einsum("bhqd,bhkd->bhqk", r(2, 2, 3, 4), r(2, 2, 5, 4)),
    einsum("...ij,...jk->...ik", r(2, 1, 3, 4), r(2, 3, 4, 2)),
    einsum("...ij,jk->...ik", r(2, 3, 4), r(4, 2)),  # B has no ellipsis: its gradient sums the batch
    einsum("i...j,j->i...", r(3, 2, 4), r(4)),  # ellipsis in the middle
    einsum("ij->i", r(3, 4)),  # j only in the operand: a ones tensor broadcasts it back
    einsum("ij->", r(3, 4)),
    einsum("i,j->ij", r(3), r(4)),
    einsum("ij,ij->ij", r(3, 4), r(3, 4)),
    einsum("ijk->kji", r(2, 3, 4)),
    einsum("ii->i", r(3, 3)),  # diagonal: an identity ties the repeated letter
    einsum("ii", r(3, 3)),  # trace
    einsum("...ii->...i", r(2, 3, 3)),
    einsum("iij,jk->ik", r(3, 3, 4), r(4, 2)),
    einsum("ij,->ji", r(3, 4), np.array(1.5)),  # a scalar operand
    einsum("ij,jk,kl->il", r(2, 3), r(3, 4), r(4, 2)),  # three operands
]


def _marker(op: str):
    """graphforge's marker op ``op`` as a model-local function: an Identity, as the passes define it."""
    from onnx import helper

    body = [helper.make_node("Identity", ["x"], ["y"])]
    return helper.make_function("graphforge", op, ["x"], ["y"], body, [helper.make_opsetid("", 18)], ["group"])


#: tensor parallelism's f and g: an Identity on one process, each the other's gradient
MARKER_CASES = [
    Case(op, [r(3, 4)], {"group": 1}, domain="graphforge", functions=(_marker(op),), id=f"graphforge.{op}")
    for op in ("TensorParallelCopy", "TensorParallelReduce")
]

MISC_CASES: list[Case] = [
    *MARKER_CASES,
    *EINSUM_CASES,
    # the matrix size must be static (the minors are gathered with fixed indices)
    Case("Det", [r(3, 3)], symbolic=False),
    Case("Det", [r(2, 4, 4)], symbolic=False, id="Det-batched"),
    Case("Det", [r(2, 1, 1)], symbolic=False, id="Det-1x1"),
    Case("CumSum", [r(3, 4), ints(1)], const=(1,), grad=[0]),
    Case("CumSum", [r(3, 4), ints(0)], {"exclusive": 1, "reverse": 1}, const=(1,), grad=[0], id="CumSum-excl-rev"),
    Case("CumSum", [r(5), ints(-1)], {"exclusive": 1}, grad=[0], id="CumSum-axis-input"),
    Case("Trilu", [r(2, 4, 5)]),
    Case("Trilu", [r(4, 5), ints(-1)], {"upper": 0}, grad=[0], id="Trilu-lower-k"),
    Case("ScatterElements", [r(3, 4), np.array([[2, 0], [0, 3]], np.int64), r(2, 2)], {"axis": 1}, grad=[0, 2]),
    Case(
        "ScatterElements",
        [r(3, 4), np.array([[1, 1, 0, 2]], np.int64), r(1, 4)],
        {"reduction": "add"},
        grad=[0, 2],
        id="ScatterElements-add",
    ),
    Case("ScatterND", [r(4, 3), np.array([[2], [0]], np.int64), r(2, 3)], grad=[0, 2]),
    Case(
        "ScatterND",
        [r(2, 3, 4), np.array([[0, 1], [1, 2], [0, 1]], np.int64), r(3, 4)],
        {"reduction": "add"},
        grad=[0, 2],
        id="ScatterND-add",
    ),
    Case("Tile", [r(2, 3), ints(2, 3)], const=(1,), grad=[0]),
    Case("Tile", [r(2, 1, 3), ints(1, 4, 2)], grad=[0], id="Tile-repeats-input"),
    Case("TopK", [r(3, 5), ints(2)], grad=[0], outputs=2),
    Case("TopK", [r(4, 3), ints(3)], {"axis": 0, "largest": 0}, const=(1,), grad=[0], outputs=2, id="TopK-smallest"),
    Case("Compress", [r(3, 4), np.array([True, False, True, True])], {"axis": 1}),
    Case("Compress", [r(3, 2), np.array([False, True, True, False, True])], id="Compress-flat"),
    Case("ReverseSequence", [r(4, 3, 2), ints(4, 1, 2)], grad=[0]),
    Case("ReverseSequence", [r(3, 5), ints(2, 5, 3)], {"batch_axis": 0, "time_axis": 1}, grad=[0], id="ReverseSeq-b0"),
    # quotients stay clear of integers, where fmod jumps
    Case("Mod", [np.array([[5.3, -5.3, 2.6], [-0.7, 7.4, 3.3]]), np.array([2.1, -1.6, 1.4])], {"fmod": 1}),
    # onnxruntime's double Shrink computes in float32: steps large enough to see past that
    # (the function is piecewise linear and no value is within 1e-3 of a kink)
    Case("Shrink", [r(3, 4)], {"bias": 0.3, "lambd": 0.6}, eps=1e-3, rtol=1e-4, atol=1e-5),
    # the default axes, spelled out: onnx 1.23's shape inference fails on an MVN without them
    Case("MeanVarianceNormalization", [r(2, 3, 4, 2)], {"axes": [0, 2, 3]}),
    Case("MeanVarianceNormalization", [r(2, 3, 4)], {"axes": [-1]}, id="MVN-last-axis"),
    # pooling and resampling the main pooling module leaves out
    Case("GlobalLpPool", [r(2, 3, 4, 5)]),
    Case("GlobalLpPool", [r(2, 3, 6)], {"p": 3}, id="GlobalLpPool-p3"),
    Case("LpPool", [r(2, 3, 5, 6)], {"kernel_shape": [2, 3], "strides": [2, 2]}),
    Case(
        "LpPool",
        [r(1, 2, 8)],  # ceil_mode adds a last window that starts on x's last element
        {"kernel_shape": [3], "strides": [2], "pads": [1, 1], "p": 3, "ceil_mode": 1},
        id="LpPool-padded-ceil-p3",
    ),
    Case("LpPool", [r(1, 2, 6, 5)], {"kernel_shape": [2, 2], "dilations": [2, 1]}, id="LpPool-dilated"),
    # opset 9: symbolic dims cannot be un-broadcast there (the table's loss Mul needs it): static only
    Case(
        "Upsample", [r(1, 2, 3, 2), np.array([1, 1, 2, 3], np.float32)], const=(1,), grad=[0], opset=9, symbolic=False
    ),
    Case(
        "Upsample",
        [r(1, 2, 3, 2), np.array([1, 1, 2, 1.5], np.float32)],
        {"mode": "linear"},
        const=(1,),
        grad=[0],
        opset=9,
        symbolic=False,
        id="Upsample-linear",
    ),
]

# ops that pass no gradient: a row each for the test that the loss gets none through them
MISC_NONDIFFERENTIABLE: list[Case] = [
    Case("Hardmax", [r(3, 4)]),
    # the vocabulary-parallel softmax's shift: the loss does not depend on it
    Case(
        "TensorParallelMax",
        [r(3, 4)],
        {"group": 1},
        domain="graphforge",
        functions=(_marker("TensorParallelMax"),),
        id="graphforge.TensorParallelMax",
    ),
    Case(
        "NonMaxSuppression",
        [
            np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, 2, 1, 3]]], np.float32),
            np.array([[[0.9, 0.8, 0.7]]], np.float32),
        ],
    ),
]
