"""Exports that leave large weights out (stand-ins), and what relies on them: shape
inference, the checker, the PassManager's verification. The oracle each time is the same
work done on the whole model, as onnx and onnx-graphsurgeon do it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, numpy_helper

import graphforge
from graphforge import graph as gio
from graphforge import stand_ins, verify
from graphforge.errors import InvalidModelError
from graphforge.graph import Model
from graphforge.shapes import infer_shapes
from graphforge.stand_ins import is_stand_in
from graphforge.verify import verify_model

#: W (64 x 32 float32, 8 KiB in raw_data), a float16 weight of 4 KiB, a small bias, an int64
#: shape that Reshape reads, float Resize scales, a Constant node, and an initializer that is
#: also a graph input
MIXED = """
<ir_version: 8, opset_import: ["" : 17]>
mixed (float[N, 64] x, float[32] b) => (float[N, 1, 4, 8] y, float16[2048] h)
<float[32] b = {BIAS}, int64[4] shape = {-1, 1, 4, 8}, float[4] scales = {1.0, 1.0, 1.0, 1.0}>
{
    t = MatMul(x, W)
    u = Add(t, b)
    half = Constant <value_float = 0.5> ()
    v = Mul(u, half)
    r = Reshape(v, shape)
    y = Resize <mode = "nearest"> (r, , scales)
    h = Identity(H)
}
"""


def mixed_model() -> onnx.ModelProto:
    model = onnx.parser.parse_model(MIXED.replace("BIAS", ", ".join(str(i / 32) for i in range(32))))
    rng = np.random.default_rng(0)
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.standard_normal(2048).astype(np.float16), "H"),
        ]
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def with_numpy_constant(model: Model) -> Model:
    """Add a large NumPy-valued constant (as a pass's builder makes them) to the graph."""
    graph = model.graph
    y = next(t for t in graph.outputs if t.name == "y")
    big = gs.Constant("offsets", np.linspace(0, 1, 2048, dtype=np.float32).reshape(1, 64, 4, 8))  # 8 KiB
    out = gs.Variable("y2", dtype=np.float32)
    graph.nodes.append(gs.Node("Add", inputs=[y, big], outputs=[out]))
    graph.outputs.append(out)
    return model


def fields(proto: onnx.ModelProto) -> dict[str, list[bytes]]:
    g = proto.graph
    return {f: [x.SerializeToString() for x in getattr(g, f)] for f in ("node", "initializer", "input", "output")}


# --------------------------------------------------------------------------- Model.to_proto


def test_export_writes_what_onnx_graphsurgeon_writes():
    model = with_numpy_constant(Model.from_proto(mixed_model()))
    ours = model.to_proto()
    theirs = gs.export_onnx(model.graph, do_type_check=False)
    model._restore_initializer_inputs(theirs)
    assert fields(ours) == fields(theirs)


@pytest.mark.parametrize("values", [True, False])
def test_export_renames_a_copy_never_the_tensor_it_reads(values):
    source = mixed_model()
    original = source.SerializeToString()
    model = Model.from_proto(source)
    tensors = model.graph.tensors()
    for name in ("W", "b"):  # W is left out of an export without values, b (128 bytes) is not
        tensors[name].name = f"{name}_renamed"
    exported = {t.name: t for t in model.to_proto(values=values).graph.initializer}
    expected = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    assert np.array_equal(numpy_helper.to_array(exported["b_renamed"]), expected["b"])
    if values:
        assert np.array_equal(numpy_helper.to_array(exported["W_renamed"]), expected["W"])
    else:
        assert is_stand_in(exported["W_renamed"])
    assert [t.name for t in source.graph.initializer] == ["b", "shape", "scales", "W", "H"]
    assert source.SerializeToString() == original


def test_export_without_values_leaves_only_large_floats_out():
    model = with_numpy_constant(Model.from_proto(mixed_model()))
    light = model.to_proto(values=False)
    left_out = {t.name: t for t in light.graph.initializer if is_stand_in(t)}
    assert sorted(left_out) == ["H", "W", "offsets"]  # b is 128 bytes; shape and scales are small
    assert (list(left_out["W"].dims), left_out["W"].data_type) == ([64, 32], TensorProto.FLOAT)
    assert (list(left_out["H"].dims), left_out["H"].data_type) == ([2048], TensorProto.FLOAT16)
    assert all(not t.HasField("raw_data") for t in left_out.values())
    # the model's own constants are untouched by the export
    assert not any(is_stand_in(t) for t in model.to_proto().graph.initializer)


def _rename(model: Model, name: str, new: str) -> None:
    next(c for c in stand_ins.exported_constants(model.graph) if c.name == name).name = new


def _drop_h(model: Model) -> None:  # H is read by an Identity whose output is a graph output
    graph = model.graph
    graph.outputs = [t for t in graph.outputs if t.name != "h"]
    graph.cleanup()


def _share_w(model: Model) -> None:  # a second constant reading the same TensorProto as W
    graph = model.graph
    w = graph.tensors()["W"]
    twin = gs.Constant("W_twin", np.zeros(1, np.float32))
    twin._values = w._values
    out = gs.Variable("t2", dtype=np.float32)
    graph.nodes.append(gs.Node("MatMul", inputs=[graph.inputs[0], twin], outputs=[out]))
    graph.outputs.append(out)


@pytest.mark.parametrize(
    "make, edit",
    [
        (mixed_model, lambda m: None),
        (mixed_model, lambda m: _rename(m, "W", "W_renamed")),
        (mixed_model, with_numpy_constant),
        (mixed_model, _drop_h),
        (mixed_model, _share_w),
        (lambda: if_model(), lambda m: _rename(m, "w", "w_renamed")),  # defined below
    ],
    ids=["as is", "renamed", "new NumPy constant", "one dropped", "two constants, one tensor", "subgraphs"],
)
def test_an_export_written_over_its_source_is_the_plain_export_and_keeps_its_tensors(make, edit):
    source = make()
    model = Model.from_proto(source)
    edit(model)
    plain = model.to_proto()
    main = list(source.graph.initializer)  # (a subgraph's own initializer stays in its body)
    reads = {c.name: stand_ins.lazy_tensor(c) for c in stand_ins.exported_constants(model.graph)}
    reads = {name: tensor for name, tensor in reads.items() if tensor is not None}
    reads = {name: tensor for name, tensor in reads.items() if any(tensor is t for t in main)}
    written = model.to_proto(over=source)
    assert written is source
    assert written.SerializeToString() == plain.SerializeToString()
    stayed = {t.name for t in written.graph.initializer if any(t is tensor for tensor in reads.values())}
    assert stayed == set(reads) - {"W_twin"}  # W_twin's bytes are a copy: W keeps the tensor


def test_from_proto_takes_the_values_back_shared_not_copied():
    model = with_numpy_constant(Model.from_proto(mixed_model()))
    back = Model.from_proto(model.to_proto(values=False), values_from=model)
    originals = {t.name: t for t in model.graph.tensors().values() if isinstance(t, gs.Constant)}
    for name in ("W", "H", "offsets"):
        assert back.graph.tensors()[name]._values is originals[name]._values
    assert fields(back.to_proto()) == fields(model.to_proto())


def _read_from_a_tensor(name: str, array: np.ndarray) -> gs.Constant:
    """A constant whose values are still read from a TensorProto, as an import leaves it."""
    constant = gs.Constant(name, np.zeros(1, np.float32))
    stand_ins.store_values(constant, numpy_helper.from_array(array, name))
    return constant


#: constants of each kind -> (a stand-in in an export with values, in one without)
EXPORTED_AS = {
    "read, large float": (lambda: _read_from_a_tensor("a", np.ones(512, np.float32)), True, True),
    "read, large integer": (lambda: _read_from_a_tensor("b", np.ones(512, np.int64)), True, False),
    "read, small float": (lambda: _read_from_a_tensor("c", np.ones(4, np.float32)), True, False),
    "NumPy, large float": (lambda: gs.Constant("d", np.ones((16, 32), np.float16)), True, True),
    "NumPy, large integer": (lambda: gs.Constant("e", np.ones(512, np.int32)), True, False),
    "NumPy, small float": (lambda: gs.Constant("f", np.ones(4, np.float32)), False, False),
}


@pytest.mark.parametrize("values", [True, False], ids=["with values", "without"])
@pytest.mark.parametrize("kind", sorted(EXPORTED_AS))
def test_which_constants_an_export_writes_as_stand_ins(kind, values):
    """With values, every constant read from a TensorProto (the export never touches it) and
    every large NumPy one; without, the large floating-point ones alone."""
    make, with_values, without = EXPORTED_AS[kind]
    constant = make()
    stand_in = stand_ins.export_stand_in(constant, values)
    assert (stand_in is not None) == (with_values if values else without)
    if stand_in is not None:
        assert is_stand_in(stand_in) and stand_in.name == constant.name
        assert list(stand_in.dims) == list(constant.shape) and not stand_in.HasField("raw_data")


def test_a_stand_in_whose_source_lacks_its_values_is_refused():
    model = Model.from_proto(mixed_model())
    light = Model.from_proto(model.to_proto(values=False))
    _rename(model, "W", "W_elsewhere")
    with pytest.raises(ValueError, match="'W' were left out, and the source lacks them"):
        stand_ins.take_back_values(light.graph, model.graph)


# --------------------------------------------------------------------------- shape inference


def test_infer_shapes_finds_what_inference_on_the_whole_model_finds():
    model = Model.from_proto(mixed_model())
    whole = Model.from_proto(onnx.shape_inference.infer_shapes(model.to_proto(), data_prop=True))
    inferred = infer_shapes(model)
    assert fields(inferred.to_proto()) == fields(whole.to_proto())
    assert inferred.to_proto().graph.value_info == whole.to_proto().graph.value_info
    assert inferred.graph.tensors()["y"].shape == ["N", 1, 4, 8]  # read from the int64 shape and the scales


def test_infer_shapes_in_place_annotates_the_model_as_the_copy_is():
    """A pass owns its model: in place, the types found are written onto its own tensors
    (no second import), and its export is the copy's, value_info included."""
    copied = infer_shapes(Model.from_proto(mixed_model()))
    model = Model.from_proto(mixed_model())
    assert infer_shapes(model, in_place=True) is model
    assert model.to_proto().graph == copied.to_proto().graph
    assert model.graph.tensors()["y"].shape == ["N", 1, 4, 8]


IF_BODY = """
<ir_version: 8, opset_import: ["" : 17]>
branchy (float[N, 4] x, bool c) => (float[N, 4] y)
{
    y = If (c) <
        then_branch = then_body () => (float[N, 4] t) { t = Relu(x) },
        else_branch = else_body () => (float[N, 4] e) { e = Neg(x) }
    >
}
"""


def test_infer_shapes_in_place_falls_back_to_a_copy_on_subgraphs_and_clashing_names():
    """Names may repeat across If/Loop bodies, and two tensors may share one name (an import
    makes them one): there the copy is made, as without in_place."""
    branchy = Model.from_proto(onnx.parser.parse_model(IF_BODY))
    inferred = infer_shapes(branchy, in_place=True)
    assert inferred is not branchy
    assert (
        inferred.to_proto().graph == infer_shapes(Model.from_proto(onnx.parser.parse_model(IF_BODY))).to_proto().graph
    )
    clashing = Model.from_proto(mixed_model())
    u = clashing.graph.tensors()["u"]
    twin = gs.Variable("u")
    clashing.graph.nodes.append(gs.Node("Identity", inputs=[u], outputs=[twin]))
    clashing.graph.outputs.append(twin)
    assert infer_shapes(clashing, in_place=True) is not clashing


# --------------------------------------------------------------------------- verification


@pytest.fixture
def checked(monkeypatch):
    """The sizes of the models the checker is handed from now on: a path (a file written for
    it) or a ModelProto."""
    calls = []
    check = onnx.checker.check_model

    def spy(model, *args, **kwargs):
        size = Path(model).stat().st_size if isinstance(model, str) else model.ByteSize()
        calls.append(size)
        return check(model, *args, **kwargs)

    monkeypatch.setattr(onnx.checker, "check_model", spy)
    return calls


def test_verify_does_not_hand_the_checker_the_weights(checked):
    model = mixed_model()
    checked.clear()
    verify_model(model)
    assert len(checked) == 1 and checked[0] < 2048, "W (8 KiB) and H (4 KiB) were left out"


def test_verify_checks_the_length_of_the_weights_it_leaves_out(checked):
    model = mixed_model()
    weight = next(t for t in model.graph.initializer if t.name == "W")
    weight.raw_data = weight.raw_data[:-4]
    checked.clear()
    with pytest.raises(InvalidModelError) as info:
        verify_model(model)
    assert str(info.value) == (
        "model is not a valid ONNX model: TensorProto (tensor name: W) raw_data size (8188 bytes) is too small "
        "for the declared shape and type (8192 bytes required)."
    )
    # W is handed to the checker (H is still left out), then the whole model, for its message
    assert len(checked) == 2 and 8188 < checked[0] < model.ByteSize() == checked[1]


def test_an_invalid_model_gets_the_checkers_own_message():
    model = mixed_model()
    model.graph.node[0].input[1] = "nowhere"
    with pytest.raises(InvalidModelError) as info:
        verify_model(model)
    with pytest.raises(onnx.checker.ValidationError) as direct:
        onnx.checker.check_model(model, full_check=True)
    assert str(info.value) == f"model is not a valid ONNX model: {verify.one_line(direct.value)}"


def test_verify_of_an_export_without_values(checked):
    model = Model.from_proto(mixed_model())
    checked.clear()
    verify_model(model.to_proto(values=False), values_from=model)
    assert len(checked) == 1 and checked[0] < 2048
    broken = Model.from_proto(mixed_model())
    broken.graph.nodes[0].op = "MatMulNoSuchOp"
    with pytest.raises(InvalidModelError) as light:
        verify_model(broken.to_proto(values=False), values_from=broken)
    with pytest.raises(InvalidModelError) as whole:
        verify_model(broken.to_proto())
    assert str(light.value) == str(whole.value)


def test_verify_of_an_export_without_values_checks_their_length():
    source = mixed_model()
    weight = next(t for t in source.graph.initializer if t.name == "W")
    weight.raw_data = weight.raw_data[:-4]
    model = Model.from_proto(source)
    with pytest.raises(InvalidModelError, match=r"raw_data size \(8188 bytes\) is too small"):
        verify_model(model.to_proto(values=False), values_from=model)


# --------------------------------------------------------------------------- the PassManager


def test_only_the_final_result_is_exported_with_its_weights(monkeypatch):
    exports = []
    to_proto = Model.to_proto

    def spy(self, *, values=True, **kwargs):
        exports.append(values)
        return to_proto(self, values=values, **kwargs)

    source = mixed_model()
    monkeypatch.setattr(Model, "to_proto", spy)
    pipeline = "loss(kind=mse, output=y), identity_elimination, autodiff(trainable=[W, b]), dce"
    result = graphforge.compile(source, pipeline)
    assert exports.count(True) == 1, exports  # the weights are copied once, for the result
    assert [r.changed for r in result.records] == [True, True, True, False]
    monkeypatch.setattr(Model, "to_proto", to_proto)
    eager = graphforge.compile(source, pipeline, verify_with_ort=True)  # exports every result whole
    assert result.model.SerializeToString() == eager.model.SerializeToString()


@pytest.mark.parametrize("options", [{}, {"verify_with_ort": True}, {"verify": False}])
def test_a_compile_of_its_own_copy_writes_the_result_over_it(monkeypatch, options):
    """Read from a file (here bytes), the source is the PassManager's own: the result is
    written over it, weights in place, and equals the result from a caller's ModelProto."""
    written = []
    write_over = gio._write_over

    def spy(exported, left_out, target):
        written.append(write_over(exported, left_out, target))
        return written[-1]

    pipeline = "loss(kind=mse, output=y), identity_elimination, autodiff(trainable=[W, b]), dce"
    source = mixed_model()
    from_proto = graphforge.compile(source, pipeline, **options).model
    assert written == []  # a caller's ModelProto is never written over
    monkeypatch.setattr(gio, "_write_over", spy)
    from_bytes = graphforge.compile(source.SerializeToString(), pipeline, **options).model
    # onnxruntime's check has each change exported whole, the result too, before the last
    # pass (which changes nothing here) runs
    assert written == ([] if options.get("verify_with_ort") else [True])
    assert from_bytes.SerializeToString() == from_proto.SerializeToString()


def test_a_compile_with_a_dump_folder_keeps_its_source_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(gio, "_write_over", lambda *args: pytest.fail("written over a source a dump may show"))
    result = graphforge.compile(mixed_model().SerializeToString(), "loss(kind=mse, output=y), dce", dump_dir=tmp_path)
    assert len(result.model.graph.node) > len(mixed_model().graph.node)


def test_a_compile_measures_each_weight_read_from_the_source_once(monkeypatch):
    """Measuring raw_data copies it (GPT-2 small: 0.5 GB a verification): the input model's
    verification measures each weight, and every later one (each pass's, the whole result's)
    knows the values it took from there. A truncated weight is still refused, at the input."""

    measured = []
    long_enough = stand_ins.long_enough

    def spy(tensor):
        measured.append(tensor.name)
        return long_enough(tensor)

    monkeypatch.setattr(stand_ins, "long_enough", spy)  # the payload-free copies and the Model's export measure
    pipeline = "loss(kind=mse, output=y), identity_elimination, autodiff(trainable=[W, b]), dce"
    graphforge.compile(mixed_model(), pipeline)
    assert sorted(measured) == ["H", "W"]
    source = mixed_model()
    weight = next(t for t in source.graph.initializer if t.name == "W")
    weight.raw_data = weight.raw_data[:-4]
    with pytest.raises(graphforge.GraphforgeError, match=r"the input model is not a valid ONNX model: .* W"):
        graphforge.compile(source, pipeline)


# --------------------------------------------------------------------------- subgraphs

#: If branches read main-graph initializers from the enclosing scope: W (large: left out of
#: exports without values), w only inside the branches, and the small s; the else branch also
#: holds an initializer of its own
IF_BODIES = """
<ir_version: 8, opset_import: ["" : 17]>
branchy (float[N, 64] x, bool c) => (float[N, 32] y)
<float[32] w = {WS}, float s = {2.0}>
{
    t = MatMul(x, W)
    y = If (c) <then_branch = then () => (float[N, 32] a) { a = Mul(t, w) },
                else_branch = other () => (float[N, 32] e) <float k = {3.0}> { p = Mul(t, s)  e = Mul(p, k) }>
}
"""


def if_model() -> onnx.ModelProto:
    model = onnx.parser.parse_model(IF_BODIES.replace("WS", ", ".join(str(i / 32) for i in range(32))))
    weight = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(weight, "W"))
    onnx.checker.check_model(model, full_check=True)
    return model


def _initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer}


@pytest.mark.parametrize("values", [True, False])
def test_round_trip_keeps_outer_initializers_read_by_subgraphs_in_the_main_graph(values):
    source = if_model()
    proto = Model.from_proto(source).to_proto(values=values)
    main = _initializers(proto.graph)
    assert {"W", "w", "s"} <= set(main)  # one copy each, where the file had them
    branches = {a.name: a.g for a in next(n for n in proto.graph.node if n.op_type == "If").attribute}
    assert all(name not in _initializers(branches[b]) for b in branches for name in ("W", "w", "s"))
    assert is_stand_in(main["W"]) == (not values)  # values left out only when asked
    if values:
        onnx.checker.check_model(proto, full_check=True)
        for name in ("W", "w", "s"):
            np.testing.assert_array_equal(
                numpy_helper.to_array(main[name]), numpy_helper.to_array(_initializers(source.graph)[name])
            )
        x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
        for c in (True, False):
            feeds = {"x": x, "c": np.array(c)}
            want = graphforge.create_session(source, providers=["CPUExecutionProvider"]).run(None, feeds)
            got = graphforge.create_session(proto, providers=["CPUExecutionProvider"]).run(None, feeds)
            np.testing.assert_array_equal(got[0], want[0])
    else:
        verify_model(proto, values_from=Model.from_proto(source))


@pytest.mark.parametrize(
    "pipeline", ["dce", "identity_elimination", "loss(kind=mse, output=y), autodiff(trainable=[W, w])"]
)
def test_a_pass_over_a_model_whose_branches_read_initializers(pipeline):
    result = graphforge.compile(if_model(), pipeline)
    onnx.checker.check_model(result.model, full_check=True)
    assert {"W", "w", "s"} <= set(_initializers(result.model.graph))


# --------------------------------------------------------------------------- compiled for shapes alone

TRAINING = "loss(kind=cross_entropy, output=logits), tensor_parallel(size=2, rank=0), autodiff, adamw(lr=1e-3)"


def _shapes(proto: onnx.ModelProto) -> dict[str, tuple[int, list[int]]]:
    return {t.name: (t.data_type, list(t.dims)) for t in proto.graph.initializer}


@pytest.fixture(scope="module")
def wide_gpt2(tmp_path_factory) -> Path:
    """GPT-2 of 1 layer 256 wide: its vectors too (LayerNorm's, the biases) are large enough
    to be left out, and the split reads some of them (a row-parallel bias's scale)."""
    import models

    return models.export_transformer(tmp_path_factory.mktemp("wide") / "gpt2.onnx", n_embd=256, n_head=4)


def test_a_model_without_its_weights_compiles_to_the_program_of_the_whole_one(wide_gpt2):
    """GPT-2 with every weight a stand-in compiles, through a tensor-parallel member's
    slicing, to the program the whole model compiles to: the same nodes and, for each
    weight, the stand-in of the member's slice (the planner reads no more)."""
    whole = onnx.load(wide_gpt2)
    passes = graphforge.parse_pipeline(TRAINING)
    want = graphforge.PassManager(passes).run(whole).model
    light = stand_ins.weights_left_out(whole)
    assert any(is_stand_in(t) and len(t.dims) == 1 for t in light.graph.initializer)
    got = graphforge.PassManager(graphforge.parse_pipeline(TRAINING), shapes_only=True).run(light).model
    assert [n.op_type for n in got.graph.node] == [n.op_type for n in want.graph.node]
    assert _shapes(got) == _shapes(want)
    left_out = {t.name for t in got.graph.initializer if is_stand_in(t)}
    assert left_out == {t.name for t in light.graph.initializer if is_stand_in(t)}
    c_attn = next(n for n in left_out if "c_attn.weight" in n)
    assert _shapes(got)[c_attn][1] == [256, 384]  # the member's 2 of 4 heads of each of Q, K and V


def test_weights_held_in_a_missing_file_are_left_out_and_anything_else_is_refused(tmp_path, transformer_path):
    """A model read without its external data has its weights left out as stand-ins; a compile
    that is not for shapes alone refuses them, naming the tensor."""
    graphforge.save(onnx.load(transformer_path), tmp_path / "model.onnx", external_data=True)
    (tmp_path / "model.onnx.data").unlink()  # a model larger than this machine: its graph alone
    graph_only = onnx.load(tmp_path / "model.onnx", load_external_data=False)
    light = stand_ins.weights_left_out(graph_only)
    assert [t.name for t in light.graph.initializer if is_stand_in(t)] == [
        t.name for t in graph_only.graph.initializer if t.data_location == TensorProto.EXTERNAL
    ]
    graphforge.PassManager(graphforge.parse_pipeline(TRAINING), shapes_only=True).run(light)
    with pytest.raises(graphforge.GraphforgeError, match="keeps its data in the external file"):
        graphforge.PassManager(graphforge.parse_pipeline(TRAINING)).run(light)


def test_symbolic_shapes_follow_a_model_whose_weights_are_left_out():
    """onnxruntime's symbolic inference reads the values of initializers an op's rule may fold
    (the norm weight under a Mul that a Qwen2-0.5B export's kv_cache pass met); a copy without
    the weights (``to_proto(values=False)``) gives it stand-ins, which it sees as inputs."""
    from graphforge.shapes import symbolic_shapes

    weight = onnx.numpy_helper.from_array(np.linspace(0.5, 1.5, 512, dtype=np.float32), "w")
    shape = onnx.numpy_helper.from_array(np.array([0, 8, 64], np.int64), "shape")
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Mul", ["x", "w"], ["scaled"]),
            onnx.helper.make_node("Reshape", ["scaled", "shape"], ["y"]),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 512])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [weight, shape],
    )
    proto = graphforge.Model.from_proto(onnx.helper.make_model(graph)).to_proto(values=False)
    assert is_stand_in(next(t for t in proto.graph.initializer if t.name == "w"))
    shapes = symbolic_shapes(proto)
    assert shapes is not None and shapes["y"] == ["batch", 8, 64], shapes
