"""graphforge.constants' evaluator on protos, which the memory model folds shapes with: each
value against onnxruntime running the same nodes on the same inputs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from graphforge.constants import evaluate, shape_value


def _onnxruntime(nodes, values: dict[str, np.ndarray], output: str, opset: int = 17) -> np.ndarray:
    """``output`` as onnxruntime computes it from ``values`` (fed as inputs) through ``nodes``."""
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in values.items()
    ]
    graph = helper.make_graph(nodes, "oracle", inputs, [helper.make_value_info(output, helper.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run([output], values)[0]


@pytest.mark.parametrize(
    ("start", "end"),
    [(None, None), (1, None), (-2, None), (0, -1), (1, 3), (-9, 9), (2, -5), (3, 1)],
)
def test_shape_value_is_what_shape_gives(start, end):
    shape = [2, 3, 1, 5]
    attributes = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    node = helper.make_node("Shape", ["x"], ["s"], **attributes)
    expected = _onnxruntime([node], {"x": np.zeros(shape, np.float32)}, "s")
    got = shape_value("Shape", shape, 0 if start is None else start, end)
    assert got.dtype == np.int64 and got.tolist() == expected.tolist()


@pytest.mark.parametrize("shape", [[2, 3, 5], [7], [], [4, 0]])
def test_shape_value_is_what_size_gives(shape):
    expected = _onnxruntime([helper.make_node("Size", ["x"], ["n"])], {"x": np.zeros(shape, np.float32)}, "n")
    got = shape_value("Size", shape)
    assert got.dtype == np.int64 and got.shape == () and int(got) == int(expected)


def test_evaluate_runs_several_nodes_over_the_values_given():
    """positions = Range(0, n, 1) reshaped to [1, n]: the chain exporters write for a
    position embedding, which ONNX's own inference does not follow through Range."""
    nodes = [
        helper.make_node("Gather", ["shape", "one"], ["n"], axis=0),
        helper.make_node("Range", ["zero", "n", "one"], ["positions"]),
        helper.make_node("Unsqueeze", ["positions", "axes"], ["row"]),
    ]
    values = {
        "shape": np.array([4, 6], np.int64),
        "zero": np.array(0, np.int64),
        "one": np.array(1, np.int64),
        "axes": np.array([0], np.int64),
    }
    got = evaluate(nodes, values, "row", 17)
    expected = _onnxruntime(nodes, values, "row")
    assert got.dtype == expected.dtype and got.tolist() == expected.tolist() == [[0, 1, 2, 3, 4, 5]]


def test_evaluate_gives_the_values_of_a_node_without_inputs():
    node = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([3, 1], np.int64)))
    assert evaluate([node], {}, "c", 17).tolist() == [3, 1]


def test_evaluate_gives_none_where_the_evaluator_cannot_run_the_nodes():
    unknown = helper.make_node("Frobnicate", ["x"], ["y"], domain="example.custom")
    assert evaluate([unknown], {"x": np.ones(2, np.float32)}, "y", 17) is None
    mismatched = helper.make_node("Add", ["a", "b"], ["c"])  # shapes that do not broadcast
    assert evaluate([mismatched], {"a": np.ones(2, np.int64), "b": np.ones(3, np.int64)}, "c", 17) is None
