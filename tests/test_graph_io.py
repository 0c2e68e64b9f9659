"""Model I/O: load, save, the Model wrapper, runtime compatibility, external data, atomic saves."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from _io_models import (
    affine_model,
    bias_model,
    bias_values,
    inputs,
    ort_loads,
    ort_run,
    relu_model,
    set_location,
)
from onnx import TensorProto, external_data_helper, helper, numpy_helper

import graphforge
from graphforge import model_io, ort_compat, payloads, tempfiles
from graphforge.errors import ModelLoadError, ModelSaveError
from graphforge.graph import Model
from graphforge.model_io import load, save
from graphforge.ort_compat import make_runtime_compatible, runtime_limits


def compatible_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return make_runtime_compatible(out)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def external_tensors(model: onnx.ModelProto) -> list[str]:
    return [t.name for t in model.graph.initializer if external_data_helper.uses_external_data(t)]


# --------------------------------------------------------------------------- loading


def test_load_from_path_str_pathlike_bytes_and_bytearray_give_the_same_model(tmp_path):
    model = compatible_copy(affine_model()[0])
    path = tmp_path / "affine.onnx"
    path.write_bytes(model.SerializeToString())
    for source in (path, str(path), path.read_bytes(), bytearray(path.read_bytes())):
        loaded = load(source)
        assert loaded == model, type(source)


def test_load_of_a_modelproto_returns_a_copy_and_leaves_the_caller_alone():
    model = relu_model()
    before = model.SerializeToString()
    loaded = load(model)
    assert loaded is not model
    assert loaded == model
    loaded.graph.node[0].op_type = "Sigmoid"
    loaded.ir_version = 3
    assert model.graph.node[0].op_type == "Relu"
    assert model.SerializeToString() == before


def test_exporting_a_model_leaves_the_proto_it_was_imported_from_alone():
    """Tensor attributes (ConstantOfShape's value, a Constant's) are exported from copies:
    onnx-graphsurgeon names the TensorProto it exports, which set a field in the source."""
    value = TensorProto(data_type=TensorProto.FLOAT, dims=[1], raw_data=np.float32(1).tobytes())  # no name set
    fill = helper.make_node("ConstantOfShape", ["shape"], ["y"])
    fill.attribute.add(name="value", type=onnx.AttributeProto.TENSOR).t.CopyFrom(value)
    graph = helper.make_graph(
        [fill],
        "g",
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert not proto.graph.node[0].attribute[0].t.HasField("name")
    before = proto.SerializeToString()
    model = Model.from_proto(proto)
    model.to_proto()
    model.to_proto(values=False)
    assert proto.SerializeToString() == before


def test_load_of_a_missing_file_names_it(tmp_path):
    path = tmp_path / "nope.onnx"
    with pytest.raises(ModelLoadError) as info:
        load(path)
    assert str(info.value) == f"{path}: no such file"


def test_load_of_a_folder_says_so(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        load(tmp_path)
    assert str(info.value) == f"{tmp_path}: is a folder, expected an .onnx file"


def test_load_of_an_unreadable_file_names_it_and_the_reason(tmp_path, monkeypatch):
    path = tmp_path / "locked.onnx"
    path.write_bytes(relu_model().SerializeToString())
    real_read_bytes = Path.read_bytes

    def refuse(self):
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(ModelLoadError) as info:
        load(path)
    assert str(info.value) == f"{path}: cannot read (Permission denied)"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_load_of_a_file_without_read_permission(tmp_path):
    path = tmp_path / "locked.onnx"
    path.write_bytes(relu_model().SerializeToString())
    path.chmod(0)
    try:
        with pytest.raises(ModelLoadError) as info:
            load(path)
    finally:
        path.chmod(0o600)
    assert str(info.value) == f"{path}: cannot read (Permission denied)"


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("random.onnx", np.random.default_rng(0).bytes(4096), "the bytes do not parse as a ModelProto"),
        ("notes.onnx", b"hello world, this is a text file and not a model\n", "the bytes do not parse as a ModelProto"),
        ("empty.onnx", b"", "no IR version, graph or opset import"),
        # parses as a ModelProto (field 1 = ir_version 7) but is no model
        ("stub.onnx", b"\x08\x07", "no IR version, graph or opset import"),
    ],
)
def test_load_of_a_file_that_is_not_onnx_names_it(tmp_path, name, content, reason):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as info:
        load(path)
    assert str(info.value) == f"{path}: not an ONNX model ({reason})"
    with pytest.raises(ModelLoadError) as info:
        load(content)
    assert str(info.value) == f"<bytes>: not an ONNX model ({reason})"


def test_load_of_random_bytes_always_raises_model_load_error():
    rng = np.random.default_rng(1234)
    for _ in range(300):
        data = rng.bytes(int(rng.integers(1, 400)))
        with pytest.raises(ModelLoadError, match=r"^<bytes>: not an ONNX model \("):
            load(data)


def test_load_of_a_truncated_model_file(tmp_path):
    data = compatible_copy(affine_model()[0]).SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=rf"^{path}: not an ONNX model"):
        load(path)


# --------------------------------------------------------------------------- IR version and opset


def test_runtime_limits_are_exactly_what_onnxruntime_loads():
    max_ir, max_opset = runtime_limits()
    assert isinstance(max_ir, int) and isinstance(max_opset, int)
    assert 7 <= max_ir <= onnx.IR_VERSION
    assert 13 <= max_opset <= onnx.defs.onnx_opset_version()
    at_limits = relu_model()
    at_limits.ir_version = max_ir
    at_limits.opset_import[0].version = max_opset
    assert ort_loads(at_limits)
    if max_ir < onnx.IR_VERSION:
        above = onnx.ModelProto()
        above.CopyFrom(at_limits)
        above.ir_version = max_ir + 1
        assert not ort_loads(above)
    if max_opset < onnx.defs.onnx_opset_version():
        above = onnx.ModelProto()
        above.CopyFrom(at_limits)
        above.opset_import[0].version = max_opset + 1
        assert not ort_loads(above)
    if max_ir == onnx.IR_VERSION and max_opset == onnx.defs.onnx_opset_version():
        pytest.skip("onnxruntime reads everything this onnx writes: nothing above the limits to refuse")


def test_default_onnx_model_is_saved_readable_by_onnxruntime(tmp_path):
    model, w, b = affine_model()  # helper.make_model: onnx's newest IR version and opset
    assert model.ir_version == onnx.IR_VERSION
    before = model.SerializeToString()
    path = save(model, tmp_path / "affine.onnx")
    max_ir, max_opset = runtime_limits()
    written = onnx.load(path)
    assert written.ir_version <= max_ir
    assert written.opset_import[0].version <= max_opset
    assert model.SerializeToString() == before  # the caller's model keeps IR 14 / its opset
    x = inputs()
    np.testing.assert_allclose(ort_run(path, {"x": x})[0], x @ w + b, rtol=1e-5, atol=1e-5)


def test_opset_above_the_runtime_is_converted(tmp_path):
    model = relu_model()
    max_ir, max_opset = runtime_limits()
    if model.opset_import[0].version <= max_opset:
        pytest.skip(f"onnxruntime reads opset {model.opset_import[0].version}: nothing to convert")
    path = save(model, tmp_path / "relu.onnx")
    written = onnx.load(path)
    assert [(o.domain, o.version) for o in written.opset_import] == [("", max_opset)]
    assert written.ir_version == max_ir
    assert written.producer_name == "graphforge-tests"
    x = inputs(shape=(4, 3))
    np.testing.assert_array_equal(ort_run(path, {"x": x})[0], np.maximum(x, 0))


def test_model_onnxruntime_already_reads_is_left_as_it_is():
    model = relu_model()
    model.ir_version = 8
    model.opset_import[0].version = 17
    copy = compatible_copy(model)
    assert copy == model


def test_make_runtime_compatible_mutates_and_returns_its_argument():
    model = relu_model()
    assert make_runtime_compatible(model) is model
    assert model.ir_version == runtime_limits()[0]


def test_opset_that_cannot_be_converted_gives_a_clear_save_error(tmp_path):
    max_opset = runtime_limits()[1]
    if max_opset >= 28:
        pytest.skip("onnxruntime reads opset 28: SwiGLU needs no conversion")
    model = onnx.parser.parse_model(
        '<ir_version: 14, opset_import: ["" : 28]> g (float[2, 4] a, float[2, 4] b) => (float[2, 4] y) { y = SwiGLU(a, b) }'
    )
    onnx.checker.check_model(model, full_check=True)  # a valid model: only the conversion fails
    (tmp_path / "keep.txt").write_text("x")
    path = tmp_path / "swiglu.onnx"
    with pytest.raises(ModelSaveError) as info:
        save(model, path)
    message = str(info.value)
    assert message.startswith(
        f"{path}: the model uses ai.onnx opset 28, onnxruntime reads at most {max_opset}, and converting it failed: "
    )
    assert "SwiGLU" in message and "\n" not in message
    assert listing(tmp_path) == ["keep.txt"]


def ml_model(node: str) -> onnx.ModelProto:
    """A model importing ai.onnx.ml at opset 6, newer than onnxruntime reads (5)."""
    return onnx.parser.parse_model(
        f'<ir_version: 10, opset_import: ["" : 17, "ai.onnx.ml" : 6]> g (float[2] x) => (float[2] y) {{ {node} }}'
    )


def test_unused_import_of_a_domain_onnxruntime_does_not_read_is_dropped(tmp_path):
    # regression: only ai.onnx was checked, and onnxruntime refused the file written
    assert ort_compat.runtime_reads_opset("ai.onnx.ml", 5) and not ort_compat.runtime_reads_opset("ai.onnx.ml", 6)
    model = ml_model("y = Relu(x)")
    assert not ort_compat.is_runtime_compatible(model)
    path = save(model, tmp_path / "ml.onnx")
    assert [(o.domain, o.version) for o in onnx.load(path).opset_import] == [("", 17)]
    assert ort_loads(onnx.load(path))
    x = inputs(shape=(2,))
    np.testing.assert_array_equal(graphforge.create_session(model).run(None, {"x": x})[0], np.maximum(x, 0))


def test_used_domain_onnxruntime_does_not_read_is_a_clear_save_error(tmp_path):
    model = ml_model('y = ai.onnx.ml.Normalizer<norm = "L2">(x)')
    path = tmp_path / "ml.onnx"
    with pytest.raises(ModelSaveError) as info:
        save(model, path)
    assert str(info.value) == (
        f"{path}: the model uses ai.onnx.ml opset 6, onnxruntime reads at most 5, and onnx converts only the "
        "ai.onnx domain; rewrite its ai.onnx.ml nodes for opset 5"
    )
    assert listing(tmp_path) == []


LOCAL_FUNCTION_28 = """
<ir_version: 11, opset_import: ["" : 28, "local" : 1]>
g (float[3] x) => (float[3] y) {{ y = local.f<alpha = 0.5>(x) }}
<domain: "local", opset_import: ["" : 28]>
f <alpha> (a) => (b) {{
  r = Relu(a)
  {extra}
}}
"""


@pytest.mark.parametrize(
    "extra",
    [
        "b = Mul(r, r)",  # no op changed between the opsets: the import is relabelled
        "i = Cast<to = 7>(r)  b = Cast<to = 1>(i)",  # Cast changed at 28: the body is converted
    ],
)
def test_local_functions_survive_an_opset_conversion(tmp_path, extra):
    # regression: onnx's version converter drops local functions, and the file written called a missing one
    if runtime_limits()[1] >= 28:
        pytest.skip("onnxruntime reads opset 28: nothing to convert")
    model = onnx.parser.parse_model(LOCAL_FUNCTION_28.format(extra=extra))
    path = save(model, tmp_path / "f.onnx")
    (function,) = onnx.load(path).functions
    assert [(o.domain, o.version) for o in function.opset_import] == [("", runtime_limits()[1])]
    assert [n.op_type for n in function.node] == [n.op_type for n in model.functions[0].node]
    x = np.array([1.5, -2.0, 3.0], np.float32)
    expected = np.maximum(x, 0) ** 2 if "Mul" in extra else np.trunc(np.maximum(x, 0))
    np.testing.assert_array_equal(ort_run(path, {"x": x})[0], expected)


def test_local_function_that_cannot_be_converted_is_a_clear_save_error(tmp_path):
    if runtime_limits()[1] >= 28:
        pytest.skip("onnxruntime reads opset 28: nothing to convert")
    model = onnx.parser.parse_model(LOCAL_FUNCTION_28.format(extra="b = Celu<alpha: float = @alpha>(r)"))
    path = tmp_path / "f.onnx"
    with pytest.raises(ModelSaveError) as info:
        save(model, path)
    assert str(info.value) == (
        f"{path}: local function local:f uses ai.onnx opset 28 (Celu), onnxruntime reads at most opset "
        f"{runtime_limits()[1]}, and onnx's version converter cannot convert a function whose nodes read its "
        "attributes"
    )
    assert listing(tmp_path) == []


# --------------------------------------------------------------------------- external data


def test_external_data_round_trip(tmp_path):
    model, w, b = affine_model()
    before = model.SerializeToString()
    path = save(model, tmp_path / "affine.onnx", external_data=True)
    assert path == tmp_path / "affine.onnx"
    assert listing(tmp_path) == ["affine.onnx", "affine.onnx.data"]
    assert model.SerializeToString() == before
    assert (tmp_path / "affine.onnx").stat().st_size < 1024  # the 8 KiB of W went to the data file
    assert (tmp_path / "affine.onnx.data").stat().st_size >= w.nbytes

    lazy = load(path, load_external_data=False)
    assert external_tensors(lazy) == ["W"]  # b (128 bytes) stays inline
    entries = {e.key: e.value for e in lazy.graph.initializer[0].external_data}
    assert entries["location"] == "affine.onnx.data"
    assert int(entries["length"]) == w.nbytes

    loaded = load(path)
    assert external_tensors(loaded) == []
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), w)
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[1]), b)
    x = inputs()
    np.testing.assert_allclose(ort_run(path, {"x": x})[0], x @ w + b, rtol=1e-5, atol=1e-5)


def test_external_data_takes_tensors_kept_in_typed_fields(tmp_path):
    model = bias_model()
    assert not model.graph.initializer[0].HasField("raw_data")  # the parser wrote float_data
    path = save(model, tmp_path / "bias.onnx", external_data=True)
    assert listing(tmp_path) == ["bias.onnx", "bias.onnx.data"]
    assert external_tensors(load(path, load_external_data=False)) == ["b"]
    np.testing.assert_array_equal(numpy_helper.to_array(load(path).graph.initializer[0]), bias_values())
    x = inputs(shape=(2, 512))
    np.testing.assert_array_equal(ort_run(path, {"x": x})[0], x + bias_values())


def _without_default_locations(model: onnx.ModelProto) -> onnx.ModelProto:
    # loading external data marks each tensor's data_location DEFAULT explicitly
    for tensor in model.graph.initializer:
        if tensor.data_location == TensorProto.DEFAULT:
            tensor.ClearField("data_location")
    return model


def test_external_save_keeps_every_other_field(tmp_path):
    model, _, _ = affine_model()
    model.producer_name, model.producer_version = "tests", "1.2"
    model.doc_string, model.domain, model.model_version = "doc", "ai.graphforge.tests", 3
    model.metadata_props.add(key="graphforge.parameters", value="W,b")
    model.graph.doc_string = "graph doc"
    weight = model.graph.initializer[0]
    weight.doc_string = "the weight"
    weight.metadata_props.add(key="role", value="parameter")
    model.graph.value_info.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, ["N", 32]))
    path = save(model, tmp_path / "m.onnx", external_data=True)
    assert external_tensors(load(path, load_external_data=False)) == ["W"]
    assert _without_default_locations(load(path)) == compatible_copy(model)


def test_external_data_for_initializers_of_subgraphs(tmp_path):
    rng = np.random.default_rng(4)
    then_w, else_w = rng.standard_normal(512).astype(np.float32), rng.standard_normal(512).astype(np.float32)

    def branch(name, w):
        return helper.make_graph(
            [helper.make_node("Add", ["x", name], [name + "_out"])],
            name,
            [],
            [helper.make_tensor_value_info(name + "_out", TensorProto.FLOAT, [512])],
            [numpy_helper.from_array(w, name)],
        )

    graph = helper.make_graph(
        [
            helper.make_node(
                "If", ["c"], ["y"], then_branch=branch("then_w", then_w), else_branch=branch("else_w", else_w)
            )
        ],
        "if",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [512]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [512])],
    )
    model = helper.make_model(graph)
    path = save(model, tmp_path / "if.onnx", external_data=True)
    lazy = load(path, load_external_data=False)
    branches = {a.name: a.g.initializer[0] for a in lazy.graph.node[0].attribute}
    assert all(external_data_helper.uses_external_data(t) for t in branches.values())
    assert _without_default_locations_in_subgraphs(load(path)) == compatible_copy(model)
    x = inputs(shape=(512,))
    for cond, w in ((True, then_w), (False, else_w)):
        np.testing.assert_array_equal(ort_run(path, {"c": np.array(cond), "x": x})[0], x + w)


def _without_default_locations_in_subgraphs(model: onnx.ModelProto) -> onnx.ModelProto:
    for attribute in model.graph.node[0].attribute:
        for tensor in attribute.g.initializer:
            tensor.ClearField("data_location")
    return model


def test_external_data_with_only_small_tensors_writes_no_data_file(tmp_path):
    path = save(relu_model(), tmp_path / "relu.onnx", external_data=True)
    assert listing(tmp_path) == ["relu.onnx"]
    assert load(path).graph.node[0].op_type == "Relu"


def test_external_data_save_does_not_depend_on_the_current_folder(tmp_path, monkeypatch):
    # onnx's own helper tests the data file name against the current folder and refused a re-save
    monkeypatch.chdir(tmp_path)
    model, w, _ = affine_model()
    save(model, "affine.onnx", external_data=True)
    save(model, "affine.onnx", external_data=True)
    assert listing(tmp_path) == ["affine.onnx", "affine.onnx.data"]
    assert (tmp_path / "affine.onnx.data").stat().st_size == w.nbytes
    np.testing.assert_array_equal(numpy_helper.to_array(load("affine.onnx").graph.initializer[0]), w)


def test_external_data_offsets_are_page_aligned(tmp_path):
    rng = np.random.default_rng(3)
    tensors = [rng.standard_normal(n).astype(np.float32) for n in (300, 1000, 700)]
    graph = helper.make_graph(
        [helper.make_node("Concat", ["a", "b", "c"], ["y"], axis=0)],
        "concat",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2000])],
        [numpy_helper.from_array(t, n) for t, n in zip(tensors, "abc", strict=True)],
    )
    path = save(helper.make_model(graph), tmp_path / "concat.onnx", external_data=True)
    lazy = load(path, load_external_data=False)
    offsets = [int(next(e.value for e in t.external_data if e.key == "offset")) for t in lazy.graph.initializer]
    assert offsets == [0, 4096, 8192]
    np.testing.assert_array_equal(ort_run(path, {})[0], np.concatenate(tensors))


@pytest.mark.parametrize("location", ["../secret.data", "sub/../../secret.data", "ABSOLUTE"])
def test_external_data_outside_the_folder_is_refused_before_reading(tmp_path, monkeypatch, location):
    model = affine_model()[0]
    folder = tmp_path / "model"
    folder.mkdir()
    save(model, folder / "m.onnx", external_data=True)
    # a real file where the location points, holding the right bytes: only the check stops the read
    shutil.copy(folder / "m.onnx.data", tmp_path / "secret.data")
    if location == "ABSOLUTE":
        location = str(tmp_path / "secret.data")
    bad = set_location(load(folder / "m.onnx", load_external_data=False), location)
    (folder / "bad.onnx").write_bytes(bad.SerializeToString())

    def must_not_read(*args, **kwargs):
        raise AssertionError("external data was read before the location was checked")

    monkeypatch.setattr(external_data_helper, "load_external_data_for_model", must_not_read)
    expected = (
        f"{folder / 'bad.onnx'}: tensor 'W' stores its data at {location!r}, outside the model's "
        f"folder {folder.resolve()}; refusing to read it"
    )
    for lazy in (False, True):
        with pytest.raises(ModelLoadError) as info:
            load(folder / "bad.onnx", load_external_data=not lazy)
        assert str(info.value) == expected


def test_external_data_through_a_symlink_out_of_the_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    save(affine_model()[0], folder / "m.onnx", external_data=True)
    os.replace(folder / "m.onnx.data", tmp_path / "elsewhere.data")
    (folder / "m.onnx.data").symlink_to(tmp_path / "elsewhere.data")
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        load(folder / "m.onnx")


def test_external_data_inside_a_subfolder_is_read(tmp_path):
    model, w, _ = affine_model()
    save(model, tmp_path / "m.onnx", external_data=True)
    (tmp_path / "weights").mkdir()
    os.replace(tmp_path / "m.onnx.data", tmp_path / "weights" / "w.bin")
    moved = set_location(load(tmp_path / "m.onnx", load_external_data=False), "weights/../weights/w.bin")
    (tmp_path / "m.onnx").write_bytes(moved.SerializeToString())
    np.testing.assert_array_equal(numpy_helper.to_array(load(tmp_path / "m.onnx").graph.initializer[0]), w)


def test_external_data_without_a_location(tmp_path):
    save(affine_model()[0], tmp_path / "m.onnx", external_data=True)
    lazy = load(tmp_path / "m.onnx", load_external_data=False)
    del lazy.graph.initializer[0].external_data[:]
    (tmp_path / "m.onnx").write_bytes(lazy.SerializeToString())
    with pytest.raises(ModelLoadError) as info:
        load(tmp_path / "m.onnx")
    assert str(info.value) == f"{tmp_path / 'm.onnx'}: tensor 'W' is marked as external data but names no file"


def test_missing_or_truncated_data_file(tmp_path):
    path = save(affine_model()[0], tmp_path / "m.onnx", external_data=True)
    data = (tmp_path / "m.onnx.data").read_bytes()
    (tmp_path / "m.onnx.data").write_bytes(data[:100])
    with pytest.raises(ModelLoadError) as info:
        load(path)
    assert str(info.value).startswith(f"{path}: cannot read its external data (")
    assert "exceeds available data" in str(info.value)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(ModelLoadError) as info:
        load(path)
    assert str(info.value).startswith(f"{path}: cannot read its external data (")
    assert "m.onnx.data" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("form", ["bytes", "proto"])
def test_model_in_memory_that_refers_to_external_data_is_refused(tmp_path, form):
    path = save(affine_model()[0], tmp_path / "m.onnx", external_data=True)
    lazy = load(path, load_external_data=False)
    source = lazy.SerializeToString() if form == "bytes" else lazy
    where = "<bytes>" if form == "bytes" else "<ModelProto>"
    with pytest.raises(ModelLoadError) as info:
        load(source)
    assert str(info.value) == (
        f"{where}: tensor 'W' keeps its data in the external file 'm.onnx.data', which a model held in "
        f"memory has no folder to read from; load the model from its path instead"
    )
    assert external_tensors(load(source, load_external_data=False)) == ["W"]


def test_saving_a_model_whose_external_data_is_not_loaded_is_refused(tmp_path):
    path = save(affine_model()[0], tmp_path / "m.onnx", external_data=True)
    lazy = load(path, load_external_data=False)
    target = tmp_path / "copy.onnx"
    with pytest.raises(ModelSaveError) as info:
        save(lazy, target)
    assert str(info.value) == (
        f"{target}: tensor 'W' still refers to external data ('m.onnx.data'); "
        f"load the model with its external data before saving it"
    )
    assert not target.exists()


def test_save_chooses_external_data_over_the_protobuf_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(payloads, "PROTOBUF_LIMIT", 4096)  # the 8 KiB weight is "too big" for one protobuf
    model, w, b = affine_model()
    path = save(model, tmp_path / "m.onnx")
    assert listing(tmp_path) == ["m.onnx", "m.onnx.data"]
    x = inputs()
    np.testing.assert_allclose(ort_run(path, {"x": x})[0], x @ w + b, rtol=1e-5, atol=1e-5)
    small = save(relu_model(), tmp_path / "relu.onnx")
    assert listing(tmp_path) == ["m.onnx", "m.onnx.data", "relu.onnx"]
    assert load(small).graph.node[0].op_type == "Relu"


def test_save_without_external_data_over_the_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(payloads, "PROTOBUF_LIMIT", 4096)
    path = tmp_path / "m.onnx"
    with pytest.raises(ModelSaveError) as info:
        save(affine_model()[0], path, external_data=False)
    assert str(info.value) == f"{path}: the model is over 2 GiB and must be saved with external data"
    assert listing(tmp_path) == []


def test_exceeds_protobuf_limit(monkeypatch):
    model, w, _ = affine_model()
    assert not payloads.exceeds_protobuf_limit(model)
    monkeypatch.setattr(payloads, "PROTOBUF_LIMIT", w.nbytes - 1)  # the payload alone is over
    assert payloads.exceeds_protobuf_limit(model)
    monkeypatch.setattr(payloads, "PROTOBUF_LIMIT", model.ByteSize() - 1)  # payload under, whole model over
    assert payloads.exceeds_protobuf_limit(model)
    # weights held by Constant nodes, as some exporters write them, count too
    held = helper.make_model(
        helper.make_graph(
            [helper.make_node("Constant", [], ["y"], value=numpy_helper.from_array(w, "w"))],
            "constant_weights",
            [],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(w.shape))],
        )
    )
    monkeypatch.setattr(payloads, "PROTOBUF_LIMIT", w.nbytes - 1)
    assert payloads.exceeds_protobuf_limit(held)
    monkeypatch.setattr(payloads, "PROTOBUF_LIMIT", held.ByteSize())
    assert not payloads.exceeds_protobuf_limit(held)


def test_raw_data_size_is_read_from_dims_and_type():
    """exceeds_protobuf_limit sizes payloads without reading them: check it against the real length."""
    import ml_dtypes

    rng = np.random.default_rng(8)
    tensors = [
        numpy_helper.from_array(rng.standard_normal((3, 5)).astype(dtype), str(dtype))
        for dtype in (np.float32, np.float16, np.float64, np.int8, np.uint64, np.bool_, np.complex64)
    ]
    tensors.append(numpy_helper.from_array(rng.standard_normal(7).astype(ml_dtypes.bfloat16), "bf16"))
    tensors.append(numpy_helper.from_array(np.arange(-4, 3).astype(ml_dtypes.int4), "int4 (packed, odd count)"))
    tensors.append(numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty"))
    for tensor in tensors:
        assert tensor.HasField("raw_data"), tensor.name
        assert payloads.raw_data_size(tensor) == len(tensor.raw_data), tensor.name
    assert payloads.raw_data_size(helper.make_tensor("typed", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])) == 0


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


@pytest.mark.slow
def test_model_over_2_gib_round_trip(tmp_path):
    """A real >2 GiB model: save picks external data by itself, load reads it, a session runs it.

    Two 1.004 GiB float32 tensors (protobuf cannot hold one message over 2 GiB). The model is at
    onnx's default opset, so the opset conversion must cope with the size too.
    """
    if shutil.disk_usage(tmp_path).free < 8 * 2**30:
        pytest.skip("needs 8 GiB of free disk for a 2.1 GiB model")
    if _available_memory() < 10 * 2**30:
        pytest.skip("needs 10 GiB of available memory (/proc/meminfo) for a 2.1 GiB model and its copies")
    n = (2**30 + 2**22) // 4
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["W1", "idx"], ["g1"], axis=0),
            helper.make_node("Gather", ["W2", "idx"], ["g2"], axis=0),
            helper.make_node("Add", ["g1", "g2"], ["s"]),
            helper.make_node("Add", ["s", "x"], ["y"]),
        ],
        "big",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph)
    for name, last in (("W1", 3.0), ("W2", 4.0)):
        w = np.zeros(n, np.float32)
        w[-1] = last
        tensor = model.graph.initializer.add()  # built in place: appending would serialize it
        tensor.name, tensor.data_type = name, TensorProto.FLOAT
        tensor.dims.append(n)
        tensor.raw_data = w.tobytes()
        del w
    assert payloads.exceeds_protobuf_limit(model)

    path = save(model, tmp_path / "big.onnx")
    assert listing(tmp_path) == ["big.onnx", "big.onnx.data"]
    assert (tmp_path / "big.onnx").stat().st_size < 4096
    assert (tmp_path / "big.onnx.data").stat().st_size >= 2 * n * 4 > 2**31
    # the caller's model is untouched: still inline, still onnx's IR version
    assert model.ir_version == onnx.IR_VERSION
    assert [t.HasField("raw_data") and not t.external_data for t in model.graph.initializer] == [True, True]
    del model

    loaded = load(path)
    assert external_tensors(loaded) == []
    assert np.frombuffer(loaded.graph.initializer[1].raw_data[-8:], np.float32).tolist() == [0.0, 4.0]
    del loaded

    session = graphforge.create_session(path)
    (y,) = session.run(None, {"x": np.array([1, 2], np.float32), "idx": np.array([0, n - 1], np.int64)})
    np.testing.assert_array_equal(y, [1.0, 9.0])


# --------------------------------------------------------------------------- atomic save


@pytest.fixture
def saved(tmp_path):
    """An existing model file (plus data file) at tmp_path/m.onnx, and their bytes."""
    model, _, _ = affine_model(seed=5)
    path = save(model, tmp_path / "m.onnx", external_data=True)
    return path, path.read_bytes(), (tmp_path / "m.onnx.data").read_bytes()


def assert_unchanged(saved) -> None:
    path, model_bytes, data_bytes = saved
    assert listing(path.parent) == ["m.onnx", "m.onnx.data"]  # no temp files or folders left
    assert path.read_bytes() == model_bytes
    assert (path.parent / "m.onnx.data").read_bytes() == data_bytes


@pytest.mark.parametrize("external", [False, True])
def test_failed_rename_leaves_the_destination_unchanged(saved, monkeypatch, external):
    def fail(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(model_io.os, "replace", fail)
    with pytest.raises(ModelSaveError) as info:
        save(affine_model(seed=6)[0], saved[0], external_data=external)
    assert str(info.value) == f"{saved[0]}: cannot write ({os.strerror(errno.EXDEV)})"
    monkeypatch.undo()
    assert_unchanged(saved)


def test_failed_rename_of_the_model_after_its_data_restores_the_old_data(saved, monkeypatch):
    real_replace = os.replace

    def fail_for_the_model(src, dst):
        if Path(dst) == saved[0]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_replace(src, dst)

    monkeypatch.setattr(model_io.os, "replace", fail_for_the_model)
    with pytest.raises(ModelSaveError, match="Input/output error"):
        save(affine_model(seed=6)[0], saved[0], external_data=True)
    monkeypatch.undo()
    assert_unchanged(saved)
    np.testing.assert_array_equal(numpy_helper.to_array(load(saved[0]).graph.initializer[0]), affine_model(seed=5)[1])


def test_disk_full_while_writing_leaves_the_destination_unchanged(saved, monkeypatch):
    real_write_bytes = Path.write_bytes

    def half_then_fail(self, data):
        real_write_bytes(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_bytes", half_then_fail)
    with pytest.raises(ModelSaveError) as info:
        save(affine_model(seed=6)[0], saved[0])
    assert str(info.value) == f"{saved[0]}: cannot write (No space left on device)"
    monkeypatch.undo()
    assert_unchanged(saved)


def test_serializer_failure_leaves_the_destination_unchanged(saved, monkeypatch):
    def refuse(proto, data_file, **kwargs):
        data_file.write_bytes(b"partial")
        raise ValueError("Message onnx.ModelProto exceeds maximum protobuf size of 2GB")

    monkeypatch.setattr(model_io, "_move_tensors_to_file", refuse)
    with pytest.raises(ModelSaveError) as info:
        save(affine_model(seed=6)[0], saved[0], external_data=True)
    assert str(info.value) == f"{saved[0]}: cannot write (Message onnx.ModelProto exceeds maximum protobuf size of 2GB)"
    monkeypatch.undo()
    assert_unchanged(saved)


def test_folder_that_refuses_a_temp_folder(saved, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfiles.tempfile, "mkdtemp", refuse)
    with pytest.raises(ModelSaveError) as info:
        save(affine_model(seed=6)[0], saved[0])
    assert str(info.value) == f"{saved[0]}: cannot write (Permission denied)"
    monkeypatch.undo()
    assert_unchanged(saved)


def test_successful_save_replaces_both_files_and_leaves_nothing_else(saved):
    model, w, _ = affine_model(seed=6)
    save(model, saved[0], external_data=True)
    assert listing(saved[0].parent) == ["m.onnx", "m.onnx.data"]
    np.testing.assert_array_equal(numpy_helper.to_array(load(saved[0]).graph.initializer[0]), w)


def test_save_into_a_missing_folder(tmp_path):
    path = tmp_path / "missing" / "m.onnx"
    with pytest.raises(ModelSaveError) as info:
        save(relu_model(), path)
    assert str(info.value) == f"{path}: folder {tmp_path / 'missing'} does not exist"
    assert listing(tmp_path) == []


def test_save_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "m.onnx"
    with pytest.raises(ModelSaveError) as info:
        save(relu_model(), path)
    assert str(info.value) == f"{path}: folder {tmp_path / 'file'} is not a folder"


def test_save_onto_a_folder(tmp_path):
    (tmp_path / "m.onnx").mkdir()
    with pytest.raises(ModelSaveError, match=rf"^{tmp_path / 'm.onnx'}: cannot write \("):
        save(relu_model(), tmp_path / "m.onnx")
    assert listing(tmp_path) == ["m.onnx"]


@pytest.mark.parametrize("external", [None, False, True])
def test_save_does_not_mutate_the_callers_model(tmp_path, external):
    model, _, _ = affine_model()
    model.metadata_props.add(key="graphforge.role", value="forward")
    before = model.SerializeToString()
    save(model, tmp_path / "m.onnx", external_data=external)
    assert model.SerializeToString() == before
    assert model.ir_version == onnx.IR_VERSION
    assert all(t.HasField("raw_data") and not t.external_data for t in model.graph.initializer)


def test_save_returns_the_path_and_accepts_a_string(tmp_path):
    path = save(relu_model(), str(tmp_path / "relu.onnx"))
    assert path == tmp_path / "relu.onnx"
    assert isinstance(path, Path)


# --------------------------------------------------------------------------- Model


def _model_with_fields() -> onnx.ModelProto:
    model, _, _ = affine_model(seed=7)
    model.doc_string = "an affine layer"
    model.domain = "ai.graphforge.tests"
    model.model_version = 42
    for key, value in (("graphforge.parameters", "W,b"), ("author", "tests"), ("graphforge.loss", "")):
        model.metadata_props.add(key=key, value=value)
    return model


def test_model_from_proto_keeps_model_level_fields():
    model = Model.from_proto(_model_with_fields())
    assert model.metadata == {"graphforge.parameters": "W,b", "author": "tests", "graphforge.loss": ""}
    assert model.doc_string == "an affine layer"
    assert model.domain == "ai.graphforge.tests"
    assert model.model_version == 42
    assert [n.op for n in model.graph.nodes] == ["MatMul", "Add"]


def test_model_round_trip_preserves_fields_and_outputs(tmp_path):
    proto = _model_with_fields()
    back = Model.from_proto(proto).to_proto()
    assert {p.key: p.value for p in back.metadata_props} == {p.key: p.value for p in proto.metadata_props}
    assert [p.key for p in back.metadata_props] == sorted(p.key for p in proto.metadata_props)
    assert (back.doc_string, back.domain, back.model_version) == ("an affine layer", "ai.graphforge.tests", 42)
    assert [(o.domain, o.version) for o in back.opset_import] == [(o.domain, o.version) for o in proto.opset_import]
    x = inputs()
    expected = ort_run(compatible_copy(proto), {"x": x})[0]
    np.testing.assert_array_equal(ort_run(compatible_copy(back), {"x": x})[0], expected)
    # and through save(Model) + load
    path = save(Model.from_proto(proto), tmp_path / "m.onnx")
    again = load(path)
    assert (again.doc_string, again.domain, again.model_version) == ("an affine layer", "ai.graphforge.tests", 42)
    assert {p.key: p.value for p in again.metadata_props} == {p.key: p.value for p in proto.metadata_props}
    np.testing.assert_array_equal(ort_run(path, {"x": x})[0], expected)


def test_model_to_proto_replaces_stale_metadata():
    model = Model.from_proto(_model_with_fields())
    del model.metadata["author"]
    model.metadata["graphforge.loss"] = "loss"
    assert {p.key: p.value for p in model.to_proto().metadata_props} == {
        "graphforge.parameters": "W,b",
        "graphforge.loss": "loss",
    }


def test_model_copy_is_independent():
    model = Model.from_proto(_model_with_fields())
    copy = model.copy()
    copy.metadata["new"] = "1"
    copy.graph.nodes[0].op = "Sub"
    copy.model_version = 1
    assert "new" not in model.metadata
    assert model.graph.nodes[0].op == "MatMul"
    assert model.model_version == 42


def test_model_from_proto_leaves_the_proto_alone():
    proto = _model_with_fields()
    before = proto.SerializeToString()
    Model.from_proto(proto).to_proto()
    assert proto.SerializeToString() == before


def test_public_api_exports_the_io_functions():
    assert graphforge.load is load
    assert graphforge.save is save
    assert graphforge.Model is Model


def test_initializers_that_are_inputs_stay_inputs_through_a_pass():
    """An overridable initializer (IR >= 4: an initializer also listed as an input) keeps its
    place among the inputs, and its default, after a pass rewrites the graph."""
    from onnx import numpy_helper

    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "W"], ["y"]), onnx.helper.make_node("Identity", ["y"], ["z"])],
        "g",
        [
            onnx.helper.make_tensor_value_info("W", onnx.TensorProto.FLOAT, [2]),
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
        ],
        [onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.ones(2, np.float32), "W")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    result = graphforge.compile(model, "identity_elimination")
    assert [v.name for v in result.model.graph.input] == ["W", "x"]
    session = graphforge.create_session(result.model)
    x = np.array([1.0, 2.0], np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x + 1)
    np.testing.assert_array_equal(session.run(None, {"x": x, "W": np.full(2, 3, np.float32)})[0], x + 3)
