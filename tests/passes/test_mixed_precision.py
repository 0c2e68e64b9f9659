"""The mixed_precision pass against float32 training of the same models (its oracle): the
loss curve, the gradients, and the loss scaler's skips and growth, on the CPU provider.

Tolerances. float16 keeps 11 significant bits (a relative rounding of 2^-11 ≈ 4.9e-4 per
operation); a gradient through a few layers of float16 GEMMs differs from float32's by
about 1e-3 of its norm, so gradients are compared per parameter within 1e-2 of the float32
gradient's norm, and a loss curve's end within 2% of float32's. What float16 does not touch
(a skipped update, the float32 export) is compared bit for bit or within 1e-6.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import models
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

import graphforge
from graphforge.errors import PipelineError
from graphforge.placement.precision import Policy, convert, op_policy
from graphforge.runtime import Module, Optimizer

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "digits" / "model.onnx"
MLP = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, weight_decay=0.01)"
GPT = "loss(kind=mse, output=logits), autodiff, adamw(lr=3e-3)"
#: where the programs train: the CPU here and in CI (onnxruntime computes most float16 arithmetic
#: in float32 between casts there); GRAPHFORGE_TEST_DEVICE=cuda runs the same tests on a GPU,
#: where float16 arithmetic is real
DEVICE = os.environ.get("GRAPHFORGE_TEST_DEVICE", "cpu")
FP16 = f"mixed_precision(dtype=float16, provider={DEVICE})"
GRADIENT_RELATIVE = 1e-2
LOSS_RELATIVE = 0.02


def _compile(path, pipeline: str) -> onnx.ModelProto:
    return graphforge.compile(str(path), pipeline).model


def _digits_batches(count: int, batch: int = 32, seed: int = 0) -> list[dict[str, np.ndarray]]:
    data = np.load(REPO / "data" / "digits" / "train.npz")
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, len(data["labels"]), (count, batch))
    return [{"images": data["images"][r], "labels": data["labels"][r]} for r in rows]


def _gpt_batches(count: int, batch: int = 8, seq: int = 16, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Each token's one-hot as its logits' target (mse): a task the 1-layer model learns."""
    vocab = models.GPT2_CONFIG["vocab_size"]
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        ids = rng.integers(0, vocab, (batch, seq))
        targets = np.eye(vocab, dtype=np.float32)[ids] * 4.0
        batches.append({"input_ids": ids, "labels": targets})
    return batches


def _output_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.output, *graph.input]}


def _op_dtypes(model: onnx.ModelProto) -> collections.Counter:
    """(op, type of its first output) of every node: the program's op/dtype histogram."""
    types = _output_types(model)
    return collections.Counter((n.op_type, types.get(n.output[0])) for n in model.graph.node)


def _train(program, batches, *, in_place: bool = True) -> tuple[list[float], Module]:
    module = Module(program, device=DEVICE, in_place=in_place)
    losses = [float(module.train_step(**b)) for b in batches]
    return losses, module


@pytest.fixture(scope="module")
def gpt_programs(transformer_path):
    return _compile(transformer_path, GPT), _compile(transformer_path, f"{GPT}, {FP16}")


# ---------------------------------------------------------------------- what the program is


def test_gemms_run_in_float16_and_parameters_stay_float32(gpt_programs):
    _, fp16 = gpt_programs
    histogram = _op_dtypes(fp16)
    low = {op: n for (op, dtype), n in histogram.items() if dtype == onnx.TensorProto.FLOAT16}
    assert low.get("Gemm", 0) + low.get("MatMul", 0) >= 10, low
    assert not any(dtype == onnx.TensorProto.FLOAT16 for (op, dtype) in histogram if op in ("Softmax", "ReduceMean"))
    roles = graphforge.ProgramRoles.of_proto(fp16)
    initializers = {t.name: t for t in fp16.graph.initializer}
    for spec in roles.carried:
        assert spec.dtype in ("float32", "int64"), spec
        if spec.init == "initializer":
            assert initializers[spec.input].data_type == onnx.TensorProto.FLOAT
    types = _output_types(fp16)
    for gradient in roles.gradients.values():
        assert types[gradient] == onnx.TensorProto.FLOAT, gradient
    # one cast per weight, whatever the number of its readers (forward and backward)
    casts = [n for n in fp16.graph.node if n.op_type == "Cast" and n.name.startswith("amp::")]
    sources = collections.Counter((n.input[0], n.attribute[0].i) for n in casts)
    assert max(sources.values()) == 1
    weights = {p for p in roles.parameters}
    assert any(source in weights for source, _ in sources)


def test_the_batch_and_sequence_dims_stay_dynamic(gpt_programs):
    _, fp16 = gpt_programs
    ids = next(i for i in fp16.graph.input if i.name == "input_ids")
    assert [d.dim_param for d in ids.type.tensor_type.shape.dim] == ["batch", "seq"]
    losses, _ = _train(fp16, _gpt_batches(2, batch=3, seq=5) + _gpt_batches(1, batch=5, seq=9))
    assert all(np.isfinite(losses))


def test_keep_fp32_keeps_the_named_ops_in_float32(transformer_path):
    program = _compile(
        transformer_path, f"{GPT}, mixed_precision(dtype=float16, provider={DEVICE}, keep_fp32=[MatMul])"
    )
    histogram = _op_dtypes(program)
    assert histogram[("MatMul", onnx.TensorProto.FLOAT16)] == 0
    assert histogram[("Gemm", onnx.TensorProto.FLOAT16)] > 0


# ---------------------------------------------------------------------- against float32


def test_gradients_equal_float32_within_float16_precision(gpt_programs):
    fp32, fp16 = gpt_programs
    batch = _gpt_batches(1)[0]
    roles = graphforge.ProgramRoles.of_proto(fp32)
    names = list(roles.gradients.values())
    want = Module(fp32, device=DEVICE, in_place=False).train_step(**batch, outputs=names)[1:]
    module = Module(fp16, device=DEVICE, in_place=False)
    scale = module.loss_scale
    got = module.train_step(**batch, outputs=names)[1:]
    for name, g16, g32 in zip(names, got, want, strict=True):
        error = np.linalg.norm(g16 / scale - g32) / np.linalg.norm(g32)  # the outputs are the scaled gradients
        assert error <= GRADIENT_RELATIVE, f"{name}: {error:.2e} relative"


@pytest.mark.parametrize("model", ["digits", "gpt"])
def test_200_steps_reach_float32s_loss_within_2_percent(model, transformer_path):
    if model == "digits":
        path, pipeline, batches = DIGITS, MLP, _digits_batches(200)
    else:
        path, pipeline, batches = transformer_path, GPT, _gpt_batches(200)
    fp32, _ = _train(_compile(path, pipeline), batches)
    fp16, module = _train(_compile(path, f"{pipeline}, {FP16}"), batches)
    last32, last16 = np.mean(fp32[-10:]), np.mean(fp16[-10:])
    assert last32 < 0.7 * np.mean(fp32[:10])  # it learned
    assert abs(last16 - last32) <= LOSS_RELATIVE * last32, (last16, last32)
    assert module.skipped_updates == 0 and module.loss_scale == 2.0**16


def test_bfloat16_trains_where_the_provider_computes_it(transformer_path):
    """bfloat16 keeps 8 significant bits (2^-8 ≈ 3.9e-3 per operation): the loss within 5%.
    onnxruntime's CPU provider has no bfloat16 GEMM, so there the pass says so instead."""
    pipeline = f"{GPT}, mixed_precision(dtype=bfloat16, provider={DEVICE})"
    try:
        program = _compile(transformer_path, pipeline)
    except PipelineError as exc:
        assert "no node can compute in bfloat16" in str(exc)
        pytest.skip(f"no bfloat16 kernels on {DEVICE}: {exc}")
    roles = graphforge.ProgramRoles.of_proto(program)
    assert roles.mixed_precision["dtype"] == "bfloat16" and roles.loss_scaling is None
    batches = _gpt_batches(200)
    fp32, _ = _train(_compile(transformer_path, GPT), batches)
    bf16, _ = _train(program, batches)
    assert abs(np.mean(bf16[-10:]) - np.mean(fp32[-10:])) <= 0.05 * np.mean(fp32[-10:])


@pytest.mark.parametrize("order", ["recompute first", "mixed_precision first"])
def test_recompute_composes(transformer_path, order):
    """Recomputation changes no value: the float16 program trains the same with it, within
    1e-5 (not bit for bit: on the CPU, onnxruntime keeps or drops the float32 casts it puts
    around an emulated float16 node by its neighbours, which a recomputed copy changes)."""
    recompute = 'recompute(budget=0, dims=["batch=8", "seq=16"])'
    steps = f"{recompute}, {FP16}" if order == "recompute first" else f"{FP16}, {recompute}"
    program = _compile(transformer_path, f"{GPT}, {steps}")
    assert any(n.name.startswith("recompute::") for n in program.graph.node)
    batches = _gpt_batches(5)
    got, _ = _train(program, batches)
    want, _ = _train(_compile(transformer_path, f"{GPT}, {FP16}"), batches)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_pipeline_stages_are_refused(transformer_path):
    with pytest.raises(graphforge.errors.GraphforgeError, match="pipeline"):
        _compile(transformer_path, f"{GPT}, {FP16}, pipeline(stages=2, microbatches=2)")


def test_clipping_reads_the_unscaled_gradients(transformer_path):
    """clip_grad_norm's norm (the output grad_norm) is of the gradients after 1/scale: equal to
    float32's within float16's precision, and the clipped training follows float32's."""
    pipeline = "loss(kind=mse, output=logits), autodiff, adamw(lr=3e-3, clip_grad_norm=0.05)"
    batches = _gpt_batches(30)
    norms = []
    for program in (_compile(transformer_path, pipeline), _compile(transformer_path, f"{pipeline}, {FP16}")):
        module = Module(program, device=DEVICE)
        losses = [float(module.train_step(**b)) for b in batches]
        norms.append((module.last_grad_norm, losses[-1]))
    (norm32, loss32), (norm16, loss16) = norms
    assert norm32 > 0.05  # the clipping worked on every step
    assert abs(norm16 - norm32) <= GRADIENT_RELATIVE * norm32
    assert abs(loss16 - loss32) <= LOSS_RELATIVE * loss32


def test_accumulation_composes(transformer_path):
    pipeline = "loss(kind=mse, output=logits), autodiff, adamw(lr=3e-3, accumulate=true)"
    batches = _gpt_batches(40, batch=4)
    results = []
    for program in (_compile(transformer_path, pipeline), _compile(transformer_path, f"{pipeline}, {FP16}")):
        module = Module(program, device=DEVICE)
        optimizer = Optimizer(module)
        losses = []
        for first, second in zip(batches[::2], batches[1::2], strict=True):
            losses.append(float(module(**first)) + float(module(**second)))
            optimizer.step()
            module.lazy_reset_grad()
        results.append(losses)
    assert abs(np.mean(results[1][-5:]) - np.mean(results[0][-5:])) <= LOSS_RELATIVE * np.mean(results[0][-5:])


# ---------------------------------------------------------------------- loss scaling


@pytest.mark.parametrize("in_place", [True, False])
def test_an_overflowing_step_is_skipped_exactly_and_the_scale_backs_off(transformer_path, in_place):
    """A scale of 2^40 makes the float16 backward overflow on step 2: that update is
    skipped (parameters, optimizer states and the optimizer's step count as they were), the
    scale backs off by 2^-24 to 2^16, and the run continues as if step 2 had not been."""
    program = _compile(
        transformer_path, f"{GPT}, mixed_precision(dtype=float16, provider={DEVICE}, backoff_factor={2.0**-24})"
    )
    batches = _gpt_batches(4)
    skipping = Module(program, device=DEVICE, in_place=in_place)
    skipping.train_step(**batches[0])
    before = skipping.runner.read_tensors()
    skipping.runner.write_tensors({**before, "loss_scale": np.array(2.0**40, np.float32)})
    loss = skipping.train_step(**batches[1])
    assert np.isfinite(loss) and skipping.last_update_skipped and skipping.skipped_updates == 1
    assert skipping.loss_scale == 2.0**16
    after = skipping.runner.read_tensors()
    for name, value in before.items():
        if not name.startswith("loss_scale"):
            assert np.array_equal(after[name], value), f"{name} changed on a skipped step"
    for batch in batches[2:]:
        skipping.train_step(**batch)
        assert not skipping.last_update_skipped
    plain = Module(program, device=DEVICE, in_place=in_place)
    for batch in (batches[0], *batches[2:]):
        plain.train_step(**batch)
    got, want = skipping.runner.read_tensors(), plain.runner.read_tensors()
    for name, value in want.items():
        if name in ("loss_scale.skipped", "loss_scale.growth_tracker"):  # a skip counts, and restarts growth
            continue
        if DEVICE == "cpu":
            assert np.array_equal(got[name], value), f"{name}: the skipped step left a trace"
        else:  # CUDA's scatter-add of the embedding gradient sums in no fixed order: two runs differ by rounding
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_with_the_default_backoff_a_skip_halves_the_scale(gpt_programs):
    _, program = gpt_programs
    module = Module(program, device=DEVICE)
    state = module.runner.read_tensors()
    module.runner.write_tensors({**state, "loss_scale": np.array(2.0**40, np.float32)})
    batch = _gpt_batches(1)[0]
    module.train_step(**batch)
    assert module.last_update_skipped and module.loss_scale == 2.0**39 and module.skipped_updates == 1


def test_the_scale_grows_after_growth_interval_finite_steps(transformer_path):
    program = _compile(
        transformer_path,
        f"{GPT}, mixed_precision(dtype=float16, provider={DEVICE}, init_scale=1024, growth_interval=3)",
    )
    module = Module(program, device=DEVICE)
    scales = []
    for batch in _gpt_batches(7):
        module.train_step(**batch)
        scales.append(module.loss_scale)
    assert scales == [1024, 1024, 2048, 2048, 2048, 4096, 4096]


def test_bfloat16_scales_no_loss_by_default_and_a_number_is_a_static_scale():
    from graphforge.passes import MixedPrecision

    assert MixedPrecision(dtype="bfloat16").scaling == "none"
    assert MixedPrecision(dtype="float16").scaling == "dynamic"
    assert MixedPrecision(loss_scale=128).scaling == "static"
    with pytest.raises(ValueError, match="backoff_factor"):
        MixedPrecision(backoff_factor=2)


def test_the_shipped_config_trains_and_logs_the_scale(tmp_path):
    """examples/digits/train_mixed_precision.toml through the CLI: loss_scale and
    skipped_updates in every log line, and the model it exports scores as the float32 demo's."""
    from typer.testing import CliRunner

    from graphforge.cli import app

    config = REPO / "examples" / "digits" / "train_mixed_precision.toml"
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["train", str(config), "--out", str(out), "--steps", "150", "--quiet"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(records) >= 10
    assert all(r["loss_scale"] == 2.0**16 and r["skipped_updates"] == 0 for r in records)
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]


# ---------------------------------------------------------------------- placement rules


def _chain(*ops: str) -> gs.Graph:
    """x -> MatMul(w) -> ops... -> y, all float32."""
    x = gs.Variable("x", dtype=np.float32, shape=[2, 4])
    w = gs.Constant("w", np.ones((4, 4), np.float32))
    out = gs.Variable("h", dtype=np.float32, shape=[2, 4])
    nodes = [gs.Node("MatMul", name="mm", inputs=[x, w], outputs=[out])]
    for i, op in enumerate(ops):
        nxt = gs.Variable(f"t{i}", dtype=np.float32, shape=[2, 4])
        nodes.append(gs.Node(op, name=f"n{i}", inputs=[out], outputs=[nxt]))
        out = nxt
    return gs.Graph(nodes=nodes, inputs=[x], outputs=[out], opset=17)


def test_elementwise_ops_follow_their_activations_and_fp32_ops_cast_up():
    graph = _chain("Relu", "Exp", "Relu")
    done = convert(graph, onnx.TensorProto.FLOAT16, op_policy, lambda node, types: True)
    types = {t.name: np.dtype(t.dtype) for t in graph.tensors().values() if t.dtype is not None}
    assert types["h"] == np.float16 and types["t0"] == np.float16  # MatMul, then Relu follows it
    assert types["t1"] == np.float32 and types["t2"] == np.float32  # Exp in float32; Relu follows that
    assert graph.outputs[0].name == "t2" and np.dtype(graph.outputs[0].dtype) == np.float32
    assert dict(done.low) == {"MatMul": 1, "Relu": 1}


def test_a_node_without_a_low_precision_kernel_computes_in_float32():
    graph = _chain("Relu")
    done = convert(graph, onnx.TensorProto.FLOAT16, op_policy, lambda node, types: node.op != "Relu")
    assert dict(done.fallback) == {"Relu": 1}
    assert np.dtype(graph.outputs[0].dtype) == np.float32
    out = models.run(gs.export_onnx(graph), {"x": np.ones((2, 4), np.float32)})
    np.testing.assert_array_equal(out["t0"], np.full((2, 4), 4.0, np.float32))


def test_outside_nodes_read_the_original_type():
    graph = _chain("Relu")
    convert(
        graph, onnx.TensorProto.FLOAT16, lambda n: Policy.OUTSIDE if n.op == "Relu" else op_policy(n), lambda *a: True
    )
    relu = next(n for n in graph.nodes if n.op == "Relu")
    assert np.dtype(relu.inputs[0].dtype) == np.float32


def test_a_pass_that_cannot_lower_anything_says_so(transformer_path, monkeypatch):
    import graphforge.ort_compat as ort_compat

    monkeypatch.setattr(ort_compat, "node_kernel", lambda *a: None)
    import graphforge.placement.precision as precision

    monkeypatch.setattr(precision, "node_kernel", lambda *a: None)
    with pytest.raises(PipelineError, match="no node can compute in float16"):
        _compile(transformer_path, f"{GPT}, {FP16}")


def test_it_needs_an_optimizer(transformer_path):
    with pytest.raises(graphforge.errors.GraphforgeError, match="optimizer"):
        _compile(transformer_path, f"loss(kind=mse, output=logits), autodiff, {FP16}")


# ---------------------------------------------------------------------- export


def test_prune_exports_float32_by_default_and_float16_on_request(gpt_programs):
    fp32_program, fp16_program = gpt_programs
    batches = _gpt_batches(20)
    _, module = _train(fp16_program, batches)
    values = module.runner.read_role("parameter", "buffer")
    trained = onnx.ModelProto()
    trained.CopyFrom(fp16_program)
    for t in trained.graph.initializer:
        if t.name in values:
            t.CopyFrom(onnx.numpy_helper.from_array(values[t.name], t.name))
    ids = {"input_ids": batches[0]["input_ids"]}
    default = graphforge.compile(trained, "prune(outputs=logits)").model
    assert not any(n.name.startswith("amp::") for n in default.graph.node)
    assert not any(dtype == onnx.TensorProto.FLOAT16 for (_, dtype) in _op_dtypes(default))
    # the float32 forward of the same weights: the float32 program's, pruned, with them
    reference = onnx.ModelProto()
    reference.CopyFrom(fp32_program)
    for t in reference.graph.initializer:
        if t.name in values:
            t.CopyFrom(onnx.numpy_helper.from_array(values[t.name], t.name))
    want = models.run(graphforge.compile(reference, "prune(outputs=logits)").model, ids)["logits"]
    got = models.run(default, ids)["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    half = graphforge.compile(trained, f"prune(outputs=logits, dtype=float16, provider={DEVICE})").model
    weights = {t.name: t.data_type for t in half.graph.initializer}
    assert weights["inner.transformer.h.0.attn.c_attn.weight"] == onnx.TensorProto.FLOAT16
    assert _op_dtypes(half)[("Gemm", onnx.TensorProto.FLOAT16)] > 0
    low = models.run(half, ids)["logits"]
    assert low.dtype == np.float32
    assert np.linalg.norm(low - want) <= GRADIENT_RELATIVE * np.linalg.norm(want)


def test_a_kernel_the_cpu_refuses_at_run_time_stays_in_float32():
    """onnxruntime's CPU provider registers ScatterElements for float16 but refuses to run it
    with reduction='add' (the MaxPool gradient's): that node stays float32, and the program
    trains instead of failing at its first step."""
    from graphforge.ort_compat import CPU, NATIVE, node_kernel

    scatter = onnx.helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], axis=0, reduction="add")
    types = (onnx.TensorProto.FLOAT16, onnx.TensorProto.INT64, onnx.TensorProto.FLOAT16)
    assert node_kernel(CPU, scatter.SerializeToString(), types, (("", 17),)) is None
    plain = onnx.helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], axis=0)
    assert node_kernel(CPU, plain.SerializeToString(), types, (("", 17),)) == NATIVE

    rng = np.random.default_rng(0)
    model = models.parse(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 2, 4, 4] x) => (float[N, 3] logits)
          <float[4, 2, 3, 3] w = {{{", ".join(map(str, rng.normal(0, 0.3, 72).round(3)))}}},
           float[3, 16] fc = {{{", ".join(map(str, rng.normal(0, 0.3, 48).round(3)))}}}> {{
          c = Conv <pads = [1, 1, 1, 1]> (x, w)
          p = MaxPool <kernel_shape = [3, 3], strides = [2, 2], pads = [1, 1, 1, 1]> (c)
          f = Flatten (p)
          logits = Gemm <transB = 1> (f, fc)
        }}
    """)
    program = graphforge.compile(model, f"{MLP}, mixed_precision(dtype=float16, provider=cpu)").model
    reducing = [  # the overlapping windows' gradient sums
        n
        for n in program.graph.node
        if n.op_type == "ScatterElements" and any(a.name == "reduction" for a in n.attribute)
    ]
    assert reducing
    types = _output_types(program)
    assert all(types[n.output[0]] == onnx.TensorProto.FLOAT for n in reducing)
    module = Module(program, device="cpu")
    x, y = rng.random((4, 2, 4, 4)).astype(np.float32), rng.integers(0, 3, 4)
    assert all(np.isfinite(float(module.train_step(x, y))) for _ in range(3))
