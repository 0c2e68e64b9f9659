"""Symbolic dims the caller does not give, sized from the program (graphforge.analysis.dims):
the loss pass's labels take the logits' export name (``rows``), which the cost and memory
models must size from the batch, as the runner will, or they count the backward as empty."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphforge.analysis.cost import model_flops
from graphforge.analysis.dims import DEFAULT_DIM, completed
from graphforge.analysis.memory import tensor_sizes
from graphforge.graph import Model
from graphforge.pass_manager import PassManager, parse_pipeline

HIDDEN, VOCAB = 16, 40


def _flattened_logits() -> onnx.ModelProto:
    """x [batch, seq, HIDDEN] @ w [HIDDEN, VOCAB], reshaped to logits [rows, VOCAB], as GPT-2
    exports with ``dynamic_axes={"logits": {0: "rows"}}`` are; ``extra`` has a dim nothing fixes."""
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(HIDDEN, VOCAB)).astype(np.float32), "w")
    target = numpy_helper.from_array(np.array([-1, VOCAB], np.int64), "target")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["scores"]),
            helper.make_node("Reshape", ["scores", "target"], ["logits"]),
            helper.make_node("ReduceSum", ["extra"], ["extra_sum"], keepdims=0),
        ],
        "flattened",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
            helper.make_tensor_value_info("extra", TensorProto.FLOAT, ["free"]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", VOCAB]),
            helper.make_tensor_value_info("extra_sum", TensorProto.FLOAT, []),
        ],
        [w, target],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _program() -> onnx.ModelProto:
    passes = parse_pipeline("loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.1)")
    return PassManager(passes).run(_flattened_logits()).model


def test_the_labels_dim_is_the_rows_the_batch_makes_and_an_unfixed_dim_stays_out():
    program = _program()
    labels = next(v for v in program.graph.input if v.name == "labels")
    assert [d.dim_param for d in labels.type.tensor_type.shape.dim] == ["rows"]
    assert completed(program, {"batch": 3, "seq": 5}) == {"batch": 3, "seq": 5, "rows": 15}
    assert completed(program, {"batch": 3, "seq": 5, "rows": 7})["rows"] == 7  # what the caller says stands
    assert "free" not in completed(program, {"batch": 3, "seq": 5})


def test_flops_count_the_output_projections_backward_without_the_rows_given():
    model = Model.from_proto(_program())
    given = model_flops(model, {"batch": 3, "seq": 5, "rows": 15})
    derived = model_flops(model, {"batch": 3, "seq": 5})
    assert derived == given
    projections = sum(
        derived[id(n)] for n in model.graph.nodes if n.op in ("MatMul", "Gemm") and "labels" not in n.name
    )
    # the forward and the gradient of w (x, an input, has none): 2 × 15 × 16 × 40 each
    assert projections == 2 * 2 * 15 * HIDDEN * VOCAB


def test_memory_sizes_the_labels_and_the_logits_gradient_by_the_batch():
    program = _program()
    sizes = tensor_sizes(program, {"batch": 3, "seq": 5})
    assert sizes["labels"] == 15 * 8  # int64 rows, not DEFAULT_DIM of them
    assert DEFAULT_DIM != 15
    assert sizes == tensor_sizes(program, {"batch": 3, "seq": 5, "rows": 15})
