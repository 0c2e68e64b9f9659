"""Table rows for control flow, ops defined by ONNX functions, decomposed ops (GridSample),
CumProd, MaxUnpool, quantization (straight-through, checked against torch), Dropout in
training mode (checked against its own mask), zeros in ReduceProd and rules at old opsets
(appended to op_cases.CASES)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from gradcheck import Case, away_from_zero, ints
from onnx import TensorProto, helper

rng = np.random.default_rng(11)
r = partial(away_from_zero, rng)


# ----------------------------------------------------------------------------- If


def _branch(name: str, nodes: list[tuple], initializers=()) -> object:
    """A branch reading outer0/outer1 from the enclosing scope; its last node writes the output."""
    made = [helper.make_node(op, ins, [f"{name}_{k}"]) for k, (op, ins) in enumerate(nodes)]
    out = helper.make_value_info(f"{name}_{len(nodes) - 1}", helper.make_tensor_type_proto(TensorProto.DOUBLE, None))
    return helper.make_graph(made, name, [], [out], list(initializers))


def _if(cond: bool, then_nodes, else_nodes, else_inits=(), **kwargs) -> Case:
    # float64 branches: the case casts its float inputs to float64 where onnxruntime has the kernels
    then = _branch("then", then_nodes)
    other = _branch("else", else_nodes, else_inits)
    return Case("If", [np.array(cond)], {"then_branch": then, "else_branch": other}, outer=[r(3, 4), r(4)], **kwargs)


_TWO = helper.make_tensor("two", TensorProto.DOUBLE, [], [2.0])
IF_CASES = [
    # both branches read both outer tensors; then-branch: outer0 * outer1, else: sin(outer0) + outer1
    _if(True, [("Mul", ["outer0", "outer1"])], [("Sin", ["outer0"]), ("Add", ["else_0", "outer1"])], id="If-then"),
    _if(False, [("Mul", ["outer0", "outer1"])], [("Sin", ["outer0"]), ("Add", ["else_0", "outer1"])], id="If-else"),
    # the taken branch does not read outer1 (zeros for it) and reads its own initializer
    _if(False, [("Mul", ["outer0", "outer1"])], [("Mul", ["outer0", "two"])], [_TWO], id="If-else-one-input"),
]

# ----------------------------------------------------------------------------- ONNX function ops

x3 = r(2, 3, 4)
FUNCTION_CASES = [
    Case("Swish", [r(3, 4)], {"alpha": 0.7}, opset=24),
    # as trainable initializers, whose small values the expansion once folded in: no gradient
    # reached them through the body's second reader (Swish: CastLike; RMSNormalization: X)
    Case("Swish", [r(4)], {"alpha": 2.0}, opset=24, params=(0,), id="Swish-parameter"),
    Case("RMSNormalization", [r(2, 3, 4), r(4)], opset=23),
    Case("RMSNormalization", [r(2, 3, 4), r(4)], opset=23, params=(0, 1), id="RMSNormalization-parameters"),
    Case("RMSNormalization", [r(2, 3, 4), r(3, 4)], {"axis": 1, "epsilon": 1e-3}, opset=23, id="RMSNormalization-2d"),
    Case("Attention", [r(2, 2, 3, 4), r(2, 2, 5, 4), r(2, 2, 5, 4)], opset=23),
    Case("Attention", [r(2, 2, 3, 4), r(2, 2, 3, 4), r(2, 2, 3, 4)], {"is_causal": 1}, opset=23, id="Attention-causal"),
    Case(
        "Attention",
        [r(2, 4, 3, 4), r(2, 2, 5, 4), r(2, 2, 5, 6), r(3, 5)],
        {"scale": 0.3, "softcap": 2.0},
        opset=23,
        id="Attention-gqa-mask-softcap",
    ),
    Case(
        "Attention",
        [r(2, 3, 8), r(2, 5, 8), r(2, 5, 8)],
        {"q_num_heads": 2, "kv_num_heads": 2},
        opset=23,
        symbolic=False,  # onnx's shape inference rejects the 3-D form with all dims symbolic
        id="Attention-3d",
    ),
    Case(
        "RotaryEmbedding",
        [r(1, 2, 3, 4), r(1, 3, 2, low=-1, high=1), r(1, 3, 2, low=-1, high=1)],
        opset=23,
        grad=[0],
    ),
    Case("CenterCropPad", [r(4, 5, 2), ints(3, 6)], {"axes": [0, 1]}, const=(1,), grad=[0], opset=18),
]

# ----------------------------------------------------------------------------- decomposed and new rules

_CUMPROD_ZEROS = np.array([[1.5, 0.0, 2.0, -1.0, 3.0], [0.5, 0.0, 0.0, 2.0, 1.5]])
DECOMPOSED_CASES = [
    Case("GridSample", [r(1, 2, 3, 4), r(1, 2, 3, 2, low=-1.2, high=1.2)], opset=16),
    Case(
        "GridSample",
        [r(2, 1, 3, 4), r(2, 3, 2, 2, low=-1.2, high=1.2)],
        {"align_corners": 1, "padding_mode": "border"},
        opset=16,
        id="GridSample-border-aligned",
    ),
    Case(
        "GridSample",
        [r(1, 2, 3, 4), r(1, 2, 3, 2, low=-1.2, high=1.2)],
        {"mode": "nearest"},
        grad=[0],  # the grid's gradient is zero: rounding
        opset=16,
        id="GridSample-nearest",
    ),
    Case(
        "GridSample", [r(1, 2, 3, 4), r(1, 2, 3, 2, low=-1, high=1)], {"mode": "linear"}, opset=20, id="GridSample-20"
    ),
    # the size is a constant input (torch's affine_grid takes it as numbers); 2-D and 3-D, both corner rules
    Case("AffineGrid", [r(2, 2, 3), ints(2, 1, 3, 4)], const=(1,), grad=[0], opset=20),
    Case(
        "AffineGrid",
        [r(1, 2, 3), ints(1, 2, 4, 3)],
        {"align_corners": 1},
        const=(1,),
        grad=[0],
        opset=20,
        id="AffineGrid-aligned",
    ),
    Case("AffineGrid", [r(2, 3, 4), ints(2, 1, 2, 3, 4)], const=(1,), grad=[0], opset=20, id="AffineGrid-3d"),
    Case(
        "AffineGrid",
        [r(1, 3, 4), ints(1, 1, 3, 2, 2)],
        {"align_corners": 1},
        const=(1,),
        grad=[0],
        opset=20,
        id="AffineGrid-3d-aligned",
    ),
    Case("CumProd", [r(2, 5), ints(1)], const=(1,), grad=[0], opset=26),
    # zeros: none, one, and two in a row, with exclusive and reverse running products
    Case("CumProd", [_CUMPROD_ZEROS, ints(1)], const=(1,), grad=[0], opset=26, id="CumProd-zeros"),
    Case(
        "CumProd",
        [_CUMPROD_ZEROS, ints(1)],
        {"exclusive": 1, "reverse": 1},
        const=(1,),
        grad=[0],
        opset=26,
        id="CumProd-zeros-exclusive-reverse",
    ),
    # torch.split as the dynamo exporter writes it: parts 0 and 2 of a split into sizes 2, 1, 3
    Case(
        "SplitToSequence",
        [r(2, 6), ints(2, 1, 3)],
        {"axis": 1},
        const=(1,),
        grad=[0],
        opset=13,
        after=(
            ("Constant", [], {"value": helper.make_tensor("p0", TensorProto.INT64, [], [0])}),
            ("SequenceAt", ["out0", "after0"], {}),
            ("Constant", [], {"value": helper.make_tensor("p2", TensorProto.INT64, [], [-1])}),
            ("SequenceAt", ["out0", "after2"], {}),
            ("Concat", ["after1", "after3"], {"axis": 1}),
        ),
    ),
    Case(
        "MaxUnpool",
        [r(1, 2, 2, 2), np.array([[[[0, 3], [9, 14]], [[17, 18], [24, 31]]]], np.int64)],
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        grad=[0],
    ),
    # zeros in a reduced slice: the reference is torch.prod (one zero, two zeros, none)
    Case(
        "ReduceProd",
        [np.array([[1.5, 0.0, 3.0], [2.0, 0.5, 4.0], [0.0, 0.0, 2.0]]), ints(1)],
        const=(1,),
        grad=[0],
        id="ReduceProd-zeros-vs-torch",
        reference=lambda feeds, outs, weights: _torch_grad(
            lambda t: t.prod(1, keepdim=True), feeds["in0"], weights["out0"]
        ),
    ),
]


def _torch_grad(fn, x: np.ndarray, weight: np.ndarray) -> dict[str, np.ndarray]:
    """d sum(fn(x) * weight) / dx by torch autograd."""
    t = torch.from_numpy(np.array(x)).requires_grad_()
    (fn(t) * torch.from_numpy(np.array(weight))).sum().backward()
    return {"in0": t.grad.numpy()}


# ----------------------------------------------------------------------------- straight-through quantization


def _fake_quant_per_tensor(qmin, qmax):
    def reference(feeds, outs, weights):
        scale, zero = float(_const["scale"]), int(_const["zero"])
        fn = lambda t: torch.fake_quantize_per_tensor_affine(t, scale, zero, qmin, qmax)  # noqa: E731
        return _torch_grad(fn, feeds["in0"], weights["after0"])

    return reference


def _fake_quant_per_channel(feeds, outs, weights):
    scale, zero = torch.tensor(_const["scales"]), torch.tensor(_const["zeros"], dtype=torch.int32)
    fn = lambda t: torch.fake_quantize_per_channel_affine(t, scale, zero, 1, -128, 127)  # noqa: E731
    return _torch_grad(fn, feeds["in0"], weights["after0"])


_const = {"scale": np.float32(0.02), "zero": 3, "scales": np.array([0.02, 0.05, 0.01, 0.03], np.float32),
          "zeros": np.array([3, -2, 0, 10], np.int8)}  # fmt: skip
_DQ = (("DequantizeLinear", ["out0", "in1", "in2"], {}),)
QUANTIZE_CASES = [
    Case(
        "QuantizeLinear",
        [r(3, 4), _const["scale"], np.int8(_const["zero"])],
        const=(1, 2),
        grad=[0],
        after=_DQ,
        opset=13,
        reference=_fake_quant_per_tensor(-128, 127),
        id="QuantizeLinear-int8",
    ),
    Case(
        "QuantizeLinear",
        [r(3, 4), _const["scales"], _const["zeros"]],
        {"axis": 1},
        const=(1, 2),
        grad=[0],
        after=(("DequantizeLinear", ["out0", "in1", "in2"], {"axis": 1}),),
        opset=13,
        reference=_fake_quant_per_channel,
        id="QuantizeLinear-per-channel",
    ),
    # no zero point: uint8, so every negative input saturates at 0 and gets no gradient
    Case(
        "QuantizeLinear",
        [r(3, 4), np.float32(0.01)],
        const=(1,),
        grad=[0],
        after=(("DequantizeLinear", ["out0", "in1"], {}),),
        opset=10,
        symbolic=False,
        reference=lambda f, o, w: _torch_grad(
            lambda t: torch.fake_quantize_per_tensor_affine(t, 0.01, 0, 0, 255), f["in0"], w["after0"]
        ),
        id="QuantizeLinear-uint8-opset10",
    ),
]
# DequantizeLinear has no row of its own: each row above checks it, after QuantizeLinear

# ----------------------------------------------------------------------------- Dropout in training mode


def _dropout_reference(ratio: float):
    # dx = dy * mask / (1 - ratio), with the mask the same run drew (x has no zeros: mask = y != 0)
    return lambda feeds, outs, weights: {"in0": weights["out0"] * (outs["out0"] != 0) / (1 - ratio)}


DROPOUT_CASES = [
    Case(
        "Dropout",
        [r(6, 8), np.array(0.3), np.array(True)],
        {"seed": 3},
        grad=[0],
        const=(1, 2),
        reference=_dropout_reference(0.3),
        id="Dropout-training",
    ),
    # training_mode as a run-time input, set to true
    Case(
        "Dropout",
        [r(6, 8), np.array(0.5), np.array(True)],
        grad=[0],
        const=(1,),
        reference=_dropout_reference(0.5),
        id="Dropout-training-input",
    ),
]

# ----------------------------------------------------------------------------- old opsets


def _away_from_bounds(x):
    return np.where(np.abs(np.abs(x) - 1) < 0.05, x * 1.2, x)


OLD_OPSET_CASES = [
    # axes as attributes: the opset sweep (test_rule_opsets.py) takes these down to opset 9
    Case(
        "ReduceProd",
        [np.array([[1.5, 0.0, 3.0], [2.0, 0.5, 4.0]])],
        {"axes": [1]},
        opset=11,
        symbolic=False,
        id="ReduceProd-opset11",
    ),
    Case("ReduceMax", [r(2, 3, 4)], {"axes": [1], "keepdims": 0}, opset=11, symbolic=False, id="ReduceMax-opset11"),
    Case("ReduceL2", [r(2, 3, 4)], {"axes": [2]}, opset=11, symbolic=False, id="ReduceL2-opset11"),
    # float32 (no double Clip-11 kernel): values kept away from the bounds by more than the step
    Case(
        "Clip",
        [_away_from_bounds(r(3, 4)), np.array(-1.0), np.array(1.0)],
        grad=[0],
        const=(1, 2),
        opset=11,
        symbolic=False,
        id="Clip-opset11",
    ),
    Case(
        "Clip",
        [_away_from_bounds(r(3, 4))],
        {"min": -1.0, "max": 1.0},
        opset=10,
        symbolic=False,
        id="Clip-opset10-attributes",
    ),
    Case(
        "Slice",
        [r(4, 6)],
        {"starts": [1, -5], "ends": [3, 100], "axes": [0, 1]},
        opset=9,
        symbolic=False,
        id="Slice-opset9-attributes",
    ),
    Case(
        "Slice",
        [r(4, 6), ints(1, -5), ints(3, 100), ints(0, 1)],
        const=(1, 2, 3),
        grad=[0],
        opset=10,
        symbolic=False,
        id="Slice-opset10",
    ),
]

# ----------------------------------------------------------------------------- Scan
# (last, so that the rows above keep the random values they were tuned with)


def _vi(name: str, shape, elem=TensorProto.DOUBLE):
    return helper.make_tensor_value_info(name, elem, shape)


def _scan(inputs, body_inputs, nodes, body_outputs, attrs=None, **kwargs) -> Case:
    """A Scan over ``inputs`` (initial states, then scan inputs; ``num_scan_inputs`` from the
    body's signature minus its outputs' states) whose body reads outer0 from the enclosing scope."""
    body = helper.make_graph([helper.make_node(op, ins, outs, **a) for op, ins, outs, a in nodes], "body",
                             body_inputs, body_outputs)  # fmt: skip
    states = len(inputs) - kwargs.pop("scanned", 1)
    attrs = {"body": body, "num_scan_inputs": len(inputs) - states, **(attrs or {})}
    return Case("Scan", inputs, attrs, outputs=len(body_outputs), **kwargs)


SCAN_CASES = [
    # an RNN written as a Scan: h' = tanh(h·W + x_t), y_t = h'·x_t; W read from the enclosing scope
    _scan(
        [r(2, 3), r(4, 2, 3, low=-1, high=1)],
        [_vi("h", [2, 3]), _vi("x", [2, 3])],
        [("MatMul", ["h", "outer0"], ["hw"], {}), ("Add", ["hw", "x"], ["pre"], {}), ("Tanh", ["pre"], ["h2"], {}),
         ("Mul", ["h2", "x"], ["y"], {})],
        [_vi("h2", [2, 3]), _vi("y", [2, 3])],
        outer=[r(3, 3, low=-0.8, high=0.8)],
        id="Scan-rnn",
    ),
    # two scan inputs, one read backwards along axis 1, an output stacked backwards on axis 1;
    # s' = s·a_t + sin(b_t·outer0), y_t = s·a_t
    _scan(
        [r(3), r(3, 4, low=-1, high=1), r(4, 3)],
        [_vi("s", [3]), _vi("a", [3]), _vi("b", [3])],
        [("Mul", ["s", "a"], ["sa"], {}), ("Mul", ["b", "outer0"], ["bw"], {}), ("Sin", ["bw"], ["sb"], {}),
         ("Add", ["sa", "sb"], ["s2"], {})],
        [_vi("s2", [3]), _vi("sa", [3])],
        {"scan_input_axes": [1, 0], "scan_input_directions": [1, 0], "scan_output_axes": [1],
         "scan_output_directions": [1]},
        scanned=2,
        outer=[r(3)],
        id="Scan-axes-directions",
    ),
    # only the final state reaches the loss, and an integer counter rides along as a state
    _scan(
        [r(2), np.array(0, np.int64), r(3, 2)],
        [_vi("s", [2]), _vi("i", [], TensorProto.INT64), _vi("x", [2])],
        [("Mul", ["s", "x"], ["sx"], {}), ("Add", ["sx", "outer0"], ["s2"], {}),
         ("Neg", ["i"], ["i2"], {}),
         ("Cos", ["x"], ["y"], {})],
        [_vi("s2", [2]), _vi("i2", [], TensorProto.INT64), _vi("y", [2])],
        outer=[r(2)],
        after=(("Identity", ["out0"], {}),),
        id="Scan-final-state-only",
    ),
    # the body reads the initial state in0 from the enclosing scope too: s' = s·x_t + in0
    _scan(
        [r(2), r(3, 2, low=-1, high=1)],
        [_vi("s", [2]), _vi("x", [2])],
        [("Mul", ["s", "x"], ["sx"], {}), ("Add", ["sx", "in0"], ["s2"], {}), ("Sin", ["s2"], ["y"], {})],
        [_vi("s2", [2]), _vi("y", [2])],
        id="Scan-input-read-in-body",
    ),
    # only the scan output reaches the loss, stacked on axis -1 (opset 11+); before opset 13 the
    # body's broadcast Mul cannot be un-broadcast over symbolic dims: static only
    _scan(
        [r(2), r(3, 2)],
        [_vi("s", [2]), _vi("x", [2])],
        [("Mul", ["s", "outer0"], ["s2"], {}), ("Mul", ["s2", "x"], ["y"], {})],
        [_vi("s2", [2]), _vi("y", [2])],
        {"scan_output_axes": [-1]},
        outer=[r(2)],
        after=(("Identity", ["out1"], {}),),
        opset=11,
        symbolic=False,
        id="Scan-negative-axis-outputs-only",
    ),
]  # fmt: skip

COMPOSITE_CASES = (
    IF_CASES + SCAN_CASES + FUNCTION_CASES + DECOMPOSED_CASES + QUANTIZE_CASES + DROPOUT_CASES + OLD_OPSET_CASES
)
