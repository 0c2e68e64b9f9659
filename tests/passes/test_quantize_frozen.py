"""The quantize_frozen pass: a lora program's frozen base stored as int4 or int8 in blocks.

Oracles: a NumPy reference of the blocked symmetric quantization and onnxruntime's own
QuantizeLinear (the rounding); an unoptimized onnxruntime session (the fused forward); the same
lora program whose base holds the dequantized values as float weights (loss and adapter
gradients). A hand-written 32-64-32-16 model covers the three layouts of a linear weight:
MatMul's [in, out], torch's [out, in] through a Transpose, and a Gemm with transB."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _pages import page_block, run_block
from graphforge.passes.quantize_frozen import RANGES, dequantize_blocks
from onnx import TensorProto, helper, numpy_helper

import graphforge
from graphforge.errors import GraphforgeError
from graphforge.program import ProgramRoles
from graphforge.runtime.sessions import ENV_NBITS_ACCURACY, create_session, session_options

PAGE = "docs/guides/pytorch-export.md"
LORA = "lora(r=4, alpha=8, init=gaussian)"
TRAIN = "loss(kind=mse, output=y), autodiff"
#: the float weights: (name, shape as stored, whether their products read them transposed)
WEIGHTS = {"w1": ((32, 64), False), "w2": ((32, 64), True), "w3": ((16, 32), True)}


def base_model(seed: int = 0, values: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """x [N, 32] → MatMul by w1 [32, 64], + b1, Tanh → MatMul by Transpose(w2 [32, 64]) (torch's
    Linear), + b2, Tanh → Gemm by w3 [16, 32] (transB 1) + b3 → y [N, 16]; ``values`` replace weights."""
    rng = np.random.default_rng(seed)
    init = {n: (rng.standard_normal(shape) / np.sqrt(shape[1 if t else 0])).astype(np.float32)
            for n, (shape, t) in WEIGHTS.items()}  # fmt: skip
    init.update(b1=0.1 * rng.standard_normal(64), b2=0.1 * rng.standard_normal(32), b3=0.1 * rng.standard_normal(16))
    init.update(values or {})
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Tanh", ["a1"], ["h1"]),
        helper.make_node("Transpose", ["w2"], ["w2t"], perm=[1, 0]),
        helper.make_node("MatMul", ["h1", "w2t"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["a2"]),
        helper.make_node("Tanh", ["a2"], ["h2"]),
        helper.make_node("Gemm", ["h2", "w3", "b3"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "three_layouts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])],
        [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in init.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _dequantized(program: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Each quantized weight as its float values, in its own layout, from the program's integers and scales."""
    values = _initializers(program)
    out = {}
    for name, q in ProgramRoles.read(program).quantized.items():
        w = dequantize_blocks(values[q.data].astype(np.int8), values[q.scale], q.block)
        out[name] = w.T if q.transposed else w
    return out


def _batch(seed: int = 3, n: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 32)).astype(np.float32)
    return {"x": x, "labels": np.tanh(x[:, :16] * 2).astype(np.float32)}


def _run(model: onnx.ModelProto, feeds: dict, options: ort.SessionOptions | None = None) -> dict[str, np.ndarray]:
    session = create_session(model, providers=["cpu"], options=options)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


@pytest.fixture(scope="module")
def programs() -> dict[int, onnx.ModelProto]:
    """The forward models quantized at 4 and 8 bits (blocks of 16)."""
    return {b: graphforge.compile(base_model(), f"{LORA}, quantize_frozen(bits={b}, block=16)").model for b in (4, 8)}


@pytest.mark.parametrize("bits", [4, 8])
def test_weights_are_the_blocked_symmetric_quantization(programs, bits):
    """Per column and block of 16 rows of the [in, out] layout, scale = max|w| / qmax, every
    dequantized value lies within half a scale of the float one, and the integers are what
    onnxruntime's own QuantizeLinear (opset 21, blocked) makes of the float weights."""
    program, float_values = programs[bits], _initializers(base_model())
    values, quantized = _initializers(program), ProgramRoles.read(program).quantized
    assert set(quantized) == set(WEIGHTS) and not set(WEIGHTS) & set(values)  # the float weights are gone
    low, high = RANGES[bits]
    for name, (shape, transposed) in WEIGHTS.items():
        q = quantized[name]
        w = float_values[name].T if transposed else float_values[name]
        data, scale = values[q.data].astype(np.int8), values[q.scale]
        assert (q.bits, q.block, q.shape, q.transposed) == (bits, 16, shape, transposed)
        assert data.shape == w.shape and scale.shape == (w.shape[0] // 16, w.shape[1])
        expected_scale = np.abs(w.reshape(-1, 16, w.shape[1])).max(axis=1) / high
        np.testing.assert_allclose(scale, expected_scale, rtol=1e-7)
        error = np.abs(dequantize_blocks(data, scale, 16) - w)
        assert (error <= np.repeat(scale, 16, axis=0) / 2 * (1 + 1e-6)).all()
        assert data.min() >= low and data.max() <= high and data.min() < 0 < data.max()
        assert np.array_equal(dequantize_blocks(data, scale, 16), _ort_round_trip(w, scale, bits))


def _ort_round_trip(w: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """onnxruntime's QuantizeLinear → DequantizeLinear (opset 21, blocks of 16 along axis 0) of
    ``w`` with ``scale``: its Python API returns no int4 tensor, so the integers are compared
    through their dequantized values (one float32 product each, exact)."""
    kind = TensorProto.INT4 if bits == 4 else TensorProto.INT8
    zero = helper.make_tensor("z", kind, scale.shape, np.zeros(scale.size, int))
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["w", "s", "z"], ["q"], axis=0, block_size=16),
         helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], axis=0, block_size=16)], "qdq",
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, w.shape)],
        [helper.make_tensor_value_info("d", TensorProto.FLOAT, w.shape)], [numpy_helper.from_array(scale, "s"), zero],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), plain, providers=["CPUExecutionProvider"])
    return session.run(None, {"w": w})[0]


@pytest.mark.parametrize("bits", [4, 8])
def test_the_forward_fuses_into_matmulnbits_and_equals_the_unfused(programs, bits, tmp_path, monkeypatch):
    """Every quantized product becomes onnxruntime's MatMulNBits (read from the optimized
    model), and computes what an unoptimized session computes, within float32 rounding; at
    onnxruntime's default accuracy level 4 (int8 activations, asked for by the variable) it does not."""
    program = programs[bits]
    options = session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    feeds = {"x": _batch()["x"] * 4}
    fused = _run(program, feeds, options)["y"]
    ops = [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]
    assert ops.count("MatMulNBits") == 3 and "DequantizeLinear" not in ops
    plain = session_options()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    unfused = _run(program, feeds, plain)["y"]
    np.testing.assert_allclose(fused, unfused, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(ENV_NBITS_ACCURACY, "4")
    assert np.abs(_run(program, feeds)["y"] - unfused).max() > 1e-3


def test_the_training_program_fuses_its_forward_and_dequantizes_for_its_backward(tmp_path):
    """With the backward reading the same integers (one initializer each in the program), the
    session still fuses the forward's three products; the backward's input gradients keep a
    DequantizeLinear (their blocks would lie along the product's output)."""
    program = graphforge.compile(base_model(), f"{LORA}, quantize_frozen(bits=4, block=16), {TRAIN}").model
    assert sum(t.data_type == TensorProto.INT4 for t in program.graph.initializer) == 3
    options = session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    create_session(program, providers=["cpu"], options=options)
    ops = [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]
    assert ops.count("MatMulNBits") == 3
    assert ops.count("DequantizeLinear") == 2  # dX of the two layers before the head (x's takes none)


@pytest.mark.parametrize("bits", [4, 8])
def test_adapter_gradients_equal_the_dequantized_float_bases(bits):
    """The quantized program's loss and adapter gradients equal those of the same lora program
    whose base weights are the dequantized values as float32 (B non-zero, so A has a gradient)."""
    spec = f"{LORA}, quantize_frozen(bits={bits}, block=16), {TRAIN}"
    quantized = graphforge.compile(base_model(), spec).model
    reference = graphforge.compile(base_model(values=_dequantized(quantized)), f"{LORA}, {TRAIN}").model
    rng = np.random.default_rng(4)
    b_values = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in _initializers(reference).items()
                if n.endswith("lora_B.weight")}  # fmt: skip
    for model in (quantized, reference):
        for t in model.graph.initializer:
            if t.name in b_values:
                t.CopyFrom(numpy_helper.from_array(b_values[t.name], t.name))
    got, want = _run(quantized, _batch()), _run(reference, _batch())
    grads = [g for g in want if g.endswith("_grad")]
    assert sorted(grads) == [f"{m}.lora_{x}.weight_grad" for m in ("w1", "w2") for x in "AB"]
    for name in ["loss", *grads]:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_lora_program_on_an_int4_base_trains():
    """30 AdamW steps on one batch: the loss falls to under half, and only the adapters are carried."""
    from graphforge import Module

    spec = f"{LORA}, quantize_frozen(bits=4, block=32), {TRAIN}, adamw(lr=3e-2)"
    module = Module(graphforge.compile(base_model(), spec).model, device="cpu")
    losses = [float(module.train_step(**_batch())) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert {c.input for c in module.roles.carried if c.like is None} <= {
        f"{m}.lora_{x}.weight" for m in ("w1", "w2") for x in "AB"
    }


@pytest.mark.parametrize(("bits", "fraction"), [(4, 1 / 8), (8, 1 / 4)])
def test_the_program_file_holds_a_quarter_or_an_eighth(tmp_path, bits, fraction):
    """A 512 x 512 frozen weight: the saved program is smaller by the float weight less its
    integers (bits / 32 of it) and scales (one float32 per 32 values)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 512)).astype(np.float32)
    big = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "big",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 512])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 512])], [numpy_helper.from_array(w, "w")],
        ),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
    )  # fmt: skip
    sizes = {}
    for tag, spec in (("float", "lora(r=2)"), ("quantized", f"lora(r=2), quantize_frozen(bits={bits}, block=32)")):
        graphforge.save(graphforge.compile(big, spec).model, tmp_path / f"{tag}.onnx")
        sizes[tag] = (tmp_path / f"{tag}.onnx").stat().st_size
    saved = sizes["float"] - sizes["quantized"]
    expected = w.nbytes * (1 - fraction - 1 / 32)
    assert abs(saved - expected) < 512, (saved, expected)


def _with_function() -> onnx.ModelProto:
    model = base_model()
    body = helper.make_function("local", "Double", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                                [helper.make_opsetid("", 17)])  # fmt: skip
    model.functions.append(body)
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.graph.node[-1].output[0] = "y0"
    model.graph.node.append(helper.make_node("Double", ["y0"], ["y"], domain="local"))
    return model


@pytest.mark.parametrize(
    ("model", "spec", "message"),
    [
        (base_model, f"{LORA}, quantize_frozen(block=64)", "block 64 does not divide weight 'w1''s 32 input features"),
        (base_model, "quantize_frozen(bits=3)", "parameter 'bits': expected 4 or 8, got 3"),
        (base_model, "quantize_frozen(block=24)", "parameter 'block': expected a power of two ≥ 16"),
        (base_model, "quantize_frozen", "the model has no frozen weight (graphforge.frozen) to quantize"),
        (base_model, f"{LORA}, quantize_frozen(exclude=['w*'])", "none of the 6 frozen weights"),
        (_with_function, f"{LORA}, quantize_frozen", "has opset 17 and local functions (Double)"),
    ],
)
def test_bad_input_is_one_clear_error_and_the_model_is_untouched(model, spec, message):
    model = model()
    before = model.SerializeToString()
    with pytest.raises(GraphforgeError) as info:
        graphforge.compile(model, spec)
    assert message in str(info.value)
    assert model.SerializeToString() == before


def test_inspect_shows_the_quantized_weights(programs, tmp_path):
    from graphforge.inspection.summary import quantized_line

    line = quantized_line(ProgramRoles.read(programs[4]))
    assert line == "quantized: 3 weights (w1, w2, w3) to int4 in blocks of 16"


def test_the_export_guides_quantized_block_runs(tmp_path, monkeypatch, capsys):
    """docs/guides/pytorch-export.md's quantized base block, as written in a fresh folder."""
    block = page_block(PAGE, "python", "quantize_frozen(bits=4, block=32)")
    monkeypatch.chdir(tmp_path)
    namespace = run_block(PAGE, block)
    printed = capsys.readouterr().out.strip()
    assert printed in block  # the page says what it prints
    assert sorted(ProgramRoles.read(namespace["program"]).quantized) == ["0.weight", "2.weight", "4.weight"]


def test_the_export_keeps_the_adapters_beside_a_quantized_base(tmp_path):
    """graphforge export of a trained LoRA program on an int4 base: the base stays int4 and the
    adapters stay beside it (merging would undo the quantization), and the model's output is the
    forward of the dequantized float base with the trained adapters."""
    from graphforge import Module, train

    program = graphforge.compile(base_model(), f"{LORA}, quantize_frozen(bits=4, block=16), {TRAIN}, adamw(lr=3e-2)")
    path = graphforge.save(program.model, tmp_path / "program.onnx")
    module = Module(str(path), device="cpu")
    for _ in range(3):
        module.train_step(**_batch())
    checkpoint = module.state.save(tmp_path / "checkpoint.safetensors")
    report = train.export(path, tmp_path / "model.onnx", checkpoint=checkpoint)
    exported = onnx.load(report.path)
    assert report.adapters == "kept" and not set(WEIGHTS) & set(_initializers(exported))
    assert [n.op_type for n in exported.graph.node].count("DequantizeLinear") == 3
    reference = graphforge.compile(base_model(values=_dequantized(program.model)), LORA).model
    trained = module.parameters
    for t in reference.graph.initializer:
        if t.name in trained:
            t.CopyFrom(numpy_helper.from_array(trained[t.name], t.name))
    x = {"x": _batch(seed=9)["x"]}
    np.testing.assert_allclose(_run(exported, x)["y"], _run(reference, x)["y"], rtol=1e-5, atol=1e-6)
