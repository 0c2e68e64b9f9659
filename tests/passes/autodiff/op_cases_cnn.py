"""Table rows for the CNN-family rules: convolutions, pooling, resampling, padding and
normalizations (see gradcheck.Case).

Most of these ops have only float32 kernels in onnxruntime's CPU provider, so most rows
are checked in float32 (eps 1e-2, rtol 2e-2, atol 2e-3 from Case); the ops are linear
or smooth in their inputs, so central differences stay well inside that. Inputs are tiny:
the oracle runs the model twice per element.
"""

from __future__ import annotations

import numpy as np
from gradcheck import Case, ints

rng = np.random.default_rng(7)


def r(*shape):
    return rng.uniform(-1.0, 1.0, size=shape)


def pos(*shape, low=0.5, high=2.0):
    return rng.uniform(low, high, size=shape)


def distinct(*shape):
    """Values 0.1 apart in random order: a maximum stays unique when the oracle nudges by eps."""
    return (rng.permutation(int(np.prod(shape))) * 0.1 - 1.0).reshape(shape)


CONV = [
    Case("Conv", [r(1, 2, 5, 5), r(3, 2, 3, 3), r(3)], {"pads": [1, 1, 1, 1]}, id="Conv-2d"),
    Case("Conv", [r(2, 2, 7), r(3, 2, 2), r(3)], {"strides": [2], "pads": [1, 2], "dilations": [2]}, id="Conv-1d"),
    Case("Conv", [r(1, 2, 4, 3, 3), r(2, 2, 2, 2, 2)], {"strides": [1, 2, 1], "pads": [1, 0, 0, 1, 1, 0]},
         id="Conv-3d-no-bias"),
    Case("Conv", [r(1, 4, 5, 5), r(6, 2, 3, 3), r(6)], {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]},
         id="Conv-grouped"),
    Case("Conv", [r(1, 3, 5, 4), r(3, 1, 3, 3), r(3)], {"group": 3, "dilations": [2, 1], "pads": [2, 1, 2, 1]},
         id="Conv-depthwise-dilated"),
    Case("Conv", [r(1, 2, 5, 6), r(2, 2, 3, 2), r(2)], {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
         id="Conv-same-upper"),
    Case("Conv", [r(1, 2, 5, 5), r(2, 2, 2, 2)], {"strides": [1, 2], "auto_pad": "SAME_LOWER"},
         id="Conv-same-lower"),
    Case("Conv", [r(1, 2, 7, 5), r(2, 2, 2, 2)], {"strides": [3, 2], "auto_pad": "VALID"}, id="Conv-valid-leftover"),
    # before opset 13 the table's loss cannot be differentiated over symbolic dims: static only
    Case("Conv", [r(1, 2, 5, 4), r(2, 2, 2, 3), r(2)], {"strides": [2, 1]}, opset=9, symbolic=False, id="Conv-opset9"),
    # 8+ input channels: the weight gradient as one GEMM per kernel offset; fewer channels with
    # a kernel over 3x3: the swapped Conv (rows above with 2 channels: one stacked GEMM)
    Case("Conv", [r(2, 8, 5, 4), r(3, 8, 3, 2), r(3)], {"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 0, 2]},
         id="Conv-wide-2d"),
    Case("Conv", [r(2, 8, 5, 5), r(4, 8, 1, 1)], {"strides": [2, 2]}, id="Conv-wide-1x1-strided"),
    Case("Conv", [r(1, 8, 5, 6), r(2, 8, 3, 2), r(2)], {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
         id="Conv-wide-same-upper"),
    Case("Conv", [r(1, 8, 3, 4, 3), r(2, 8, 2, 2, 2)], {"pads": [0, 1, 0, 1, 0, 1]}, id="Conv-wide-3d"),
    Case("Conv", [r(1, 2, 6, 6), r(2, 2, 5, 4), r(2)], {"pads": [2, 1, 2, 2]}, id="Conv-narrow-5x4"),
    Case("ConvTranspose", [r(1, 3, 3, 3), r(3, 8, 3, 3), r(8)],
         {"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 1]}, id="ConvTranspose-wide-2d"),
    Case("ConvTranspose", [r(1, 2, 3, 3), r(2, 3, 3, 3), r(3)],
         {"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 1]}, id="ConvTranspose-2d"),
    Case("ConvTranspose", [r(1, 4, 3, 3), r(4, 1, 2, 2)], {"group": 2, "dilations": [2, 1], "strides": [1, 2]},
         id="ConvTranspose-grouped-dilated"),
    Case("ConvTranspose", [r(2, 2, 4), r(2, 2, 3), r(2)], {"strides": [3], "pads": [2, 1]}, id="ConvTranspose-1d"),
    Case("ConvTranspose", [r(1, 2, 3, 3), r(2, 2, 3, 3)], {"strides": [2, 2], "output_shape": [6, 8]},
         symbolic=False, id="ConvTranspose-output-shape"),
    Case("ConvTranspose", [r(1, 2, 3, 2), r(2, 2, 3, 2)],
         {"strides": [2, 2], "auto_pad": "SAME_UPPER", "kernel_shape": [3, 2]}, id="ConvTranspose-same-upper"),
    Case("ConvTranspose", [r(1, 1, 2, 3, 2), r(1, 2, 2, 2, 2), r(2)],
         {"strides": [2, 1, 2], "pads": [0, 1, 0, 1, 0, 1]}, id="ConvTranspose-3d"),
]  # fmt: skip

# max pooling: distinct inputs, so each window's maximum is unique even after a nudge
POOL = [
    Case("MaxPool", [distinct(1, 2, 5, 5)], {"kernel_shape": [3, 3], "strides": [2, 2]}, id="MaxPool-overlapping"),
    # windows that do not overlap need no scatter-add: opset 11+ is enough
    Case("MaxPool", [distinct(2, 2, 6)], {"kernel_shape": [2], "strides": [2]}, opset=13,
         id="MaxPool-1d-disjoint-opset13"),
    Case("MaxPool", [distinct(1, 1, 5, 6)],
         {"kernel_shape": [2, 3], "pads": [1, 1, 0, 1], "ceil_mode": 1, "strides": [2, 2]}, id="MaxPool-pads-ceil"),
    Case("MaxPool", [distinct(1, 2, 6, 5)], {"kernel_shape": [2, 2], "dilations": [2, 1]}, id="MaxPool-dilated"),
    Case("MaxPool", [distinct(1, 2, 4, 5)], {"kernel_shape": [2, 2], "storage_order": 1}, id="MaxPool-column-major"),
    Case("MaxPool", [distinct(1, 1, 3, 4, 4)], {"kernel_shape": [2, 2, 2], "strides": [1, 2, 1]}, id="MaxPool-3d"),
    # onnx's test_maxpool_3d_dilations, reported as twice the central differences: it matches
    Case("MaxPool", [distinct(1, 1, 4, 4, 4)], {"kernel_shape": [2, 2, 2], "dilations": [2, 2, 2]},
         id="MaxPool-3d-dilations"),
    Case("AveragePool", [r(1, 2, 5, 5)], {"kernel_shape": [3, 3], "strides": [2, 2]}, id="AveragePool"),
    Case("AveragePool", [r(1, 1, 6, 6)],
         {"kernel_shape": [3, 3], "pads": [1, 0, 1, 0], "count_include_pad": 0, "ceil_mode": 1, "strides": [2, 2]},
         id="AveragePool-pads-exclude-ceil"),
    Case("AveragePool", [r(1, 1, 5, 6)],
         {"kernel_shape": [3, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1, "ceil_mode": 1, "strides": [2, 3]},
         id="AveragePool-pads-include-ceil"),
    Case("AveragePool", [r(2, 2, 7)], {"kernel_shape": [3], "dilations": [2], "pads": [1, 1]}, opset=19,
         id="AveragePool-1d-dilated"),
    Case("AveragePool", [r(1, 1, 5, 4)], {"kernel_shape": [2, 3], "auto_pad": "SAME_UPPER", "strides": [2, 1]},
         id="AveragePool-same-upper"),
    Case("AveragePool", [r(1, 2, 5, 4)], {"kernel_shape": [2, 2], "pads": [1, 0, 0, 1]}, opset=9, symbolic=False,
         id="AveragePool-opset9"),
    Case("AveragePool", [r(1, 1, 3, 4, 3)], {"kernel_shape": [2, 2, 2], "strides": [1, 2, 1]}, id="AveragePool-3d"),
    Case("GlobalAveragePool", [r(2, 3, 3, 4)]),
    Case("GlobalMaxPool", [distinct(2, 3, 3, 4)]),
    Case("GlobalMaxPool", [distinct(2, 3, 5)], id="GlobalMaxPool-1d"),
]  # fmt: skip

# Resize: scales are constants (the rule reads them to skip unscaled axes); values stay in
# float32 as the op requires for scales and sizes
SCALES = np.array([1.0, 1.0, 2.0, 1.5], np.float32)
RESIZE = [
    Case("Resize", [r(1, 2, 3, 4), None, SCALES], {"mode": "nearest"}, const=(2,), grad=[0], id="Resize-nearest"),
    Case("Resize", [r(1, 2, 3, 4), None, SCALES], {"mode": "linear"}, const=(2,), grad=[0], id="Resize-linear"),
    Case("Resize", [r(1, 1, 4, 3), None, np.array([1, 1, 0.75, 1.7], np.float32)],
         {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, const=(2,), grad=[0],
         id="Resize-linear-align-corners"),
    Case("Resize", [r(1, 1, 4, 3), None, SCALES],
         {"mode": "cubic", "coordinate_transformation_mode": "pytorch_half_pixel", "cubic_coeff_a": -0.5},
         const=(2,), grad=[0], id="Resize-cubic"),
    Case("Resize", [r(1, 1, 5, 4), None, None, ints(1, 1, 3, 7)],
         {"mode": "cubic", "exclude_outside": 1, "coordinate_transformation_mode": "asymmetric"},
         const=(3,), grad=[0], id="Resize-cubic-sizes-exclude-outside"),
    Case("Resize", [r(1, 1, 6, 5), None, None, ints(1, 1, 3, 3)], {"mode": "linear", "antialias": 1},
         const=(3,), grad=[0], id="Resize-linear-antialias-down"),
    Case("Resize", [r(1, 1, 4, 5), None, None, ints(1, 1, 7, 3)],
         {"mode": "nearest", "nearest_mode": "ceil", "coordinate_transformation_mode": "half_pixel"},
         const=(3,), grad=[0], id="Resize-nearest-ceil-sizes"),
    Case("Resize", [r(1, 1, 4, 4), np.array([0, 0, 0.2, 0.1, 1, 1, 0.9, 0.7], np.float32), None, ints(1, 1, 3, 5)],
         {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 3.0},
         const=(1, 3), grad=[0], id="Resize-tf-crop-and-resize"),
    Case("Resize", [r(1, 2, 3, 4), None, np.array([2.0, 0.6], np.float32)], {"mode": "linear", "axes": [2, 3]},
         const=(2,), grad=[0], id="Resize-axes"),
    Case("Resize", [r(1, 2, 5), None, np.array([1, 1, 0.6], np.float32)], {"mode": "linear"}, const=(2,), grad=[0],
         id="Resize-linear-1d"),
    # before opset 13 the table's loss cannot be differentiated over symbolic dims: static only
    Case("Resize", [r(1, 2, 3, 3), SCALES], {"mode": "linear"}, const=(1,), grad=[0], opset=10,
         symbolic=False, id="Resize-opset10"),
    Case("Resize", [r(1, 2, 3, 3), np.zeros(0, np.float32), SCALES], {"mode": "nearest"}, const=(1, 2), grad=[0],
         opset=11, symbolic=False, id="Resize-opset11"),
]  # fmt: skip

SPATIAL = [
    Case("Pad", [r(2, 3, 4), ints(0, 1, 2, 0, 2, -1)], const=(1,), grad=[0], id="Pad-constant-crop"),
    Case("Pad", [r(2, 3, 4), ints(0, 1, 2, 0, 2, 1), np.array(1.5)], const=(1, 2), grad=[0], id="Pad-constant-value"),
    # the value takes the sum of dy over the cells it fills (crop on one axis, pad on others)
    Case("Pad", [r(2, 3, 4), ints(0, 1, 2, 0, 2, -1), np.array(1.5)], const=(1,), grad=[0, 2],
         id="Pad-constant-value-differentiated"),
    Case("Pad", [r(1, 3, 4), ints(0, 2, 2, 0, 2, -1)], {"mode": "reflect"}, const=(1,), grad=[0], id="Pad-reflect"),
    Case("Pad", [r(1, 3, 4), ints(0, 3, 1, 0, 2, 4)], {"mode": "edge"}, const=(1,), grad=[0], id="Pad-edge"),
    Case("Pad", [r(1, 3, 4), ints(0, 2, 5, 1, 0, -1)], {"mode": "wrap"}, const=(1,), grad=[0], opset=19,
         id="Pad-wrap"),
    Case("Pad", [r(2, 3, 4), ints(1, 1, 2, -1), None, ints(2, -2)], {"mode": "reflect"}, const=(1, 3), grad=[0],
         id="Pad-axes-reflect"),
    Case("Pad", [r(2, 3, 4), ints(1, 2, 2, 1), None, ints(0, 2)], const=(1, 3), grad=[0], id="Pad-axes-constant"),
    Case("Pad", [r(2, 3), ints(1, 0, 0, 2)], const=(1,), grad=[0], opset=11, symbolic=False, id="Pad-opset11"),
    Case("Pad", [r(2, 3), ints(1, 0, 0, 2)], {"mode": "edge"}, const=(1,), grad=[0], opset=16, id="Pad-edge-opset16"),
    Case("DepthToSpace", [r(2, 8, 2, 3)], {"blocksize": 2}, id="DepthToSpace-DCR"),
    Case("DepthToSpace", [r(1, 8, 3, 2)], {"blocksize": 2, "mode": "CRD"}, id="DepthToSpace-CRD"),
    Case("SpaceToDepth", [r(2, 2, 4, 6)], {"blocksize": 2}),
]  # fmt: skip

# BatchNormalization in training mode must list its running statistics as outputs, and
# the table's loss reads every output: momentum=1 keeps them equal to the given mean and
# variance, so the loss depends on x only through Y (running stats are not differentiated).
BN = [r(4, 3, 2, 2), pos(3), r(3), r(3), pos(3)]
NORM = [
    Case("BatchNormalization", BN, {"training_mode": 1, "epsilon": 1e-3, "momentum": 1.0}, grad=[0, 1, 2],
         outputs=3, opset=15, id="BatchNormalization-training"),
    Case("BatchNormalization", [r(5, 2, 3), pos(2), r(2), r(2), pos(2)], {"training_mode": 1, "momentum": 1.0},
         grad=[0, 1, 2], outputs=3, opset=14, id="BatchNormalization-training-1d"),
    Case("BatchNormalization", BN, {"epsilon": 1e-3}, grad=[0, 1, 2], opset=15, id="BatchNormalization-inference"),
    Case("InstanceNormalization", [r(2, 3, 2, 3), pos(3), r(3)], {"epsilon": 1e-3}),
    # opset 21 only: GroupNormalization-18 (per-group scale) is deprecated and the ONNX checker
    # refuses it. stash_type=1 (the only one onnxruntime runs) computes in float32 even for float64 inputs:
    # a larger eps keeps the oracle above that rounding
    Case("GroupNormalization", [r(2, 6, 2, 2), pos(6), r(6)], {"num_groups": 3, "epsilon": 1e-3}, opset=21,
         eps=1e-3, rtol=2e-3, atol=2e-3),
    Case("GroupNormalization", [r(2, 4, 3), pos(4), r(4)], {"num_groups": 2}, opset=21, eps=1e-3, rtol=2e-3,
         atol=2e-3, id="GroupNormalization-1d"),
    Case("LpNormalization", [r(2, 3, 4)], {"axis": 1}),
    Case("LpNormalization", [r(3, 4)], {"p": 1}, id="LpNormalization-p1"),
    Case("LRN", [pos(2, 5, 2, 2)], {"size": 3, "alpha": 0.1, "beta": 0.75, "bias": 1.5}),
    Case("LRN", [r(1, 6, 2, 2)], {"size": 5, "alpha": 0.2}, id="LRN-size5"),
]  # fmt: skip

CNN_CASES: list[Case] = CONV + POOL + RESIZE + SPATIAL + NORM
