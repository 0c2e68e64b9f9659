"""A model computed in float64, the reference float32 runtimes are measured against: every
float32 input, output, initializer, constant and cast made float64 (onnxruntime's CPU kernels
take doubles for what these models hold)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper


def in_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    del graph.value_info[:]
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for tensor in graph.initializer:
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                attribute.i = TensorProto.DOUBLE
            elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT:
                value = numpy_helper.to_array(attribute.t).astype(np.float64)
                attribute.t.CopyFrom(numpy_helper.from_array(value, attribute.t.name))
    return out
