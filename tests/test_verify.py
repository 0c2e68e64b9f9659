"""verify_model: the ONNX checker with strict shape inference; check_loads: onnxruntime's loader beside it."""

from __future__ import annotations

import contextlib
import os
import tempfile

import numpy as np
import onnx
import pytest
from _io_models import affine_model, relu_model
from onnx import TensorProto, helper, numpy_helper

from graphforge import payloads
from graphforge.errors import GraphforgeError, InvalidModelError
from graphforge.ort_compat import runtime_limits
from graphforge.runtime.sessions import check_loads
from graphforge.verify import verify_model

vi = helper.make_tensor_value_info


def model_of(nodes, inputs, outputs, *, opset: int = 17, domains=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)]
    return helper.make_model(graph, opset_imports=opsets)


def dangling_input() -> onnx.ModelProto:
    return model_of(
        [helper.make_node("Relu", ["zz"], ["y"], name="r")],
        [vi("x", TensorProto.FLOAT, [2, 3])],
        [vi("y", TensorProto.FLOAT, [2, 3])],
    )


def wrong_type() -> onnx.ModelProto:
    return model_of(
        [helper.make_node("Add", ["x", "z"], ["y"], name="add")],
        [vi("x", TensorProto.FLOAT, [2, 3]), vi("z", TensorProto.INT64, [2, 3])],
        [vi("y", TensorProto.FLOAT, [2, 3])],
    )


def incompatible_matmul() -> onnx.ModelProto:
    return model_of(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [vi("x", TensorProto.FLOAT, [2, 3]), vi("w", TensorProto.FLOAT, [4, 5])],
        [vi("y", TensorProto.FLOAT, [2, 5])],
    )


def unknown_op() -> onnx.ModelProto:
    return model_of(
        [helper.make_node("Frobnicate", ["x"], ["y"], name="f")],
        [vi("x", TensorProto.FLOAT, [2, 3])],
        [vi("y", TensorProto.FLOAT, [2, 3])],
    )


def custom_domain_op() -> onnx.ModelProto:
    """Valid ONNX (the checker does not know custom domains), but no onnxruntime kernel."""
    return model_of(
        [helper.make_node("Foo", ["x"], ["y"], name="foo", domain="com.example")],
        [vi("x", TensorProto.FLOAT, [2, 3])],
        [vi("y", TensorProto.FLOAT, [2, 3])],
        domains=["com.example"],
    )


INVALID = {
    "dangling input": (
        dangling_input,
        "Nodes in a graph must be topologically sorted, however input 'zz' of node: name: r OpType: Relu "
        "is not output of any previous nodes.",
    ),
    "wrong type": (
        wrong_type,
        "[ShapeInferenceError] (op_type:Add, node name: add): B has inconsistent type tensor(int64)",
    ),
    "incompatible matmul": (
        incompatible_matmul,
        "[ShapeInferenceError] Inference error(s): (op_type:MatMul, node name: mm): [ShapeInferenceError] "
        "Incompatible dimensions for matrix multiplication",
    ),
    "unknown op": (
        unknown_op,
        "No Op registered for Frobnicate with domain_version of 17 (Bad node spec for node. Name: f OpType: Frobnicate)",
    ),
}


def test_valid_models_pass():
    for model in (relu_model(), affine_model()[0]):  # relu: IR 14 / opset 28, converted for onnxruntime
        assert verify_model(model) is None
        assert check_loads(model, where="model") is None
    assert verify_model(custom_domain_op()) is None


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_model_message_is_one_line_naming_the_problem(case):
    build, problem = INVALID[case]
    with pytest.raises(InvalidModelError) as info:
        verify_model(build())
    assert str(info.value) == f"model is not a valid ONNX model: {problem}"
    assert "\n" not in str(info.value)


def test_where_names_the_model_in_the_message():
    with pytest.raises(InvalidModelError, match=r"^the output of pass 3 \(fuse\) is not a valid ONNX model: "):
        verify_model(incompatible_matmul(), where="the output of pass 3 (fuse)")


def test_undeclared_output_shape_mismatch():
    model = model_of(
        [helper.make_node("Relu", ["x"], ["y"], name="r")],
        [vi("x", TensorProto.FLOAT, [2, 3])],
        [vi("y", TensorProto.FLOAT, [7])],
    )
    with pytest.raises(InvalidModelError) as info:
        verify_model(model)
    assert str(info.value) == (
        "model is not a valid ONNX model: [ShapeInferenceError] Inference error(s): (op_type:Relu, node name: r): "
        "[ShapeInferenceError] Inferred shape and existing shape differ in rank: (2) vs (1)"
    )


def test_output_nothing_produces():
    model = model_of([], [vi("x", TensorProto.FLOAT, [2])], [vi("y", TensorProto.FLOAT, [2])])
    with pytest.raises(InvalidModelError) as info:
        verify_model(model)
    assert str(info.value) == "model is not a valid ONNX model: Graph output 'y' is not an output of any node in graph."


def test_check_loads_catches_what_only_onnxruntime_refuses(capfd):
    model = custom_domain_op()
    verify_model(model)  # the checker accepts it
    with pytest.raises(InvalidModelError) as info:
        check_loads(model, where="the input model")
    message = str(info.value)
    assert message.startswith("onnxruntime cannot load the input model: [ONNXRuntimeError]")
    assert "com.example:Foo" in message and "\n" not in message
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_check_loads_passes_provider_errors_through_unchanged(monkeypatch):
    monkeypatch.setenv("GRAPHFORGE_PROVIDERS", "NoSuchExecutionProvider")
    with pytest.raises(GraphforgeError) as info:
        check_loads(relu_model(), where="model")
    assert not isinstance(info.value, InvalidModelError)
    assert str(info.value).startswith("$GRAPHFORGE_PROVIDERS names NoSuchExecutionProvider, which this onnxruntime")


def test_verify_does_not_mutate_the_model():
    for build in (relu_model, incompatible_matmul):
        model = build()
        before = model.SerializeToString()
        with contextlib.suppress(InvalidModelError):
            verify_model(model)
        with contextlib.suppress(InvalidModelError):
            check_loads(model, where="model")
        assert model.SerializeToString() == before


@pytest.fixture
def tiny_protobuf_limit(monkeypatch, tmp_path):
    """Pretend protobuf's limit is 4 KiB, so an 8 KiB weight takes the >2 GiB path; temp
    folders go to tmp_path/tmp so the test can see they are removed."""
    monkeypatch.setattr(payloads, "PROTOBUF_LIMIT", 4096)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp"


def test_model_over_the_limit_is_checked_from_a_file(tiny_protobuf_limit):
    model, _, _ = affine_model()
    assert payloads.exceeds_protobuf_limit(model)
    verify_model(model)
    check_loads(model, where="model")
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[0].input[0] = "nowhere"
    with pytest.raises(InvalidModelError) as info:
        verify_model(broken)
    assert str(info.value) == (
        "model is not a valid ONNX model: Nodes in a graph must be topologically sorted, however input 'nowhere' "
        "of node: name: matmul OpType: MatMul is not output of any previous nodes."
    )
    assert os.listdir(tiny_protobuf_limit) == []


def test_model_over_the_limit_is_checked_as_it_is_not_converted(tiny_protobuf_limit):
    """The temp copy is for the checker, not onnxruntime: a valid model at an opset onnxruntime
    cannot be converted down to still verifies."""
    if runtime_limits()[1] >= 28:
        pytest.skip("onnxruntime reads opset 28")
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("SwiGLU", ["x", "x"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"])],
            "swiglu",
            [vi("x", TensorProto.FLOAT, [2, 2048])],
            [vi("z", TensorProto.FLOAT, [2, 2048])],
            [numpy_helper.from_array(np.ones(2048, np.float32), "b")],
        ),
        opset_imports=[helper.make_opsetid("", 28)],
    )
    assert payloads.exceeds_protobuf_limit(model)
    verify_model(model)
    assert os.listdir(tiny_protobuf_limit) == []
