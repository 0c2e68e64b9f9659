"""graphforge.ir helpers the passes share."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import parser

from graphforge.constants import constant_value


def test_constant_value_reads_every_constant_form_and_nothing_else():
    graph = gs.import_onnx(
        parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17, "custom" : 1]>
        g (float[2] x) => (float[2] y) <int64[2] init = {3, 4}> {
          t = Constant <value = float[2] {1.5, 2.5}> ()
          i = Constant <value_int = 7> ()
          s = Constant <value_floats = [0.5, 0.25]> ()
          c = custom.Constant <value_int = 1> ()
          n = Identity(init)
          y = Add(x, t)
        }
    """)
    )
    tensors = graph.tensors()
    np.testing.assert_array_equal(constant_value(tensors["init"]), [3, 4])
    np.testing.assert_array_equal(constant_value(tensors["t"]), np.array([1.5, 2.5], np.float32))
    assert constant_value(tensors["i"]).dtype == np.int64 and int(constant_value(tensors["i"])) == 7
    assert constant_value(tensors["s"]).dtype == np.float32  # ONNX's value_floats are float32
    assert constant_value(tensors["c"]) is None  # another domain's "Constant" is not ONNX's
    assert constant_value(tensors["x"]) is None and constant_value(tensors["y"]) is None
