"""Seeded dropout: masks are a pure function of (seed, step, micro-batch, node, element), kept
at the right rate and scaled by 1/(1-p); the gradient drops what the forward dropped; runs
repeat and resume bit-identically; the inference export has no dropout left."""

from __future__ import annotations

import zlib

import _training_models as tm
import numpy as np
import onnx
import onnx.parser
import onnx.utils
import pytest

import graphforge
from graphforge import CheckpointState, GraphforgeError, Module, Optimizer
from graphforge.runtime.dropout import KEY_INPUT, fmix_reference, run_key, seeded_dropout

pytest.importorskip("torch")

N = 4096


def _dropout_model(ratio: float, n: int = N) -> onnx.ModelProto:
    """y = Dropout(x * w, ratio, training=true), with a w of ones: y's zeros are the dropped elements."""
    model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    net (float[B, {n}] x) => (float[B, {n}] y) <float ratio = {{{ratio}}}, bool train = {{1}}, float[{n}] w = {{{", ".join(["1.0"] * n)}}}>
    {{
        h = Mul (x, w)
        y, m = Dropout (h, ratio, train)
    }}""")
    return graphforge.compile(model, "loss(kind=mse, output=y), autodiff, sgd(lr=0.1)").model


def _masks(module, x, target):
    _, y = module(x, target, outputs=["y"])
    return y != 0, y


def _expected_mask(key: np.ndarray, node_output: str, shape, ratio: float) -> np.ndarray:
    """The mask the emitted ops must give, from graphforge/runtime/dropout.py's formula in numpy."""
    node_id = zlib.crc32(node_output.encode())
    with np.errstate(over="ignore"):  # uint32 arithmetic wraps, as onnxruntime's does
        k1 = fmix_reference(np.uint32(key[0]) + np.uint32(node_id))
        k2 = fmix_reference(np.uint32(key[1]) + np.uint32((node_id * 0x9E3779B9) & 0xFFFFFFFF))
        index = np.arange(int(np.prod(shape)), dtype=np.uint32).reshape(shape)
        h = fmix_reference(fmix_reference(index * np.uint32(0x9E3779B9) + k1) + k2)
    threshold = np.uint32(min((1.0 - np.float64(np.float32(ratio))) * 2.0**32, 2.0**32 - 1))
    return h < threshold


def test_the_mask_is_the_documented_function_of_the_key():
    """Integer arithmetic pinned bit for bit: the same masks on any device and build."""
    module = Module(_dropout_model(0.3), device="cpu")
    module.state.seeds["dropout"] = 7
    x, target = np.ones((3, N), np.float32), np.zeros((3, N), np.float32)
    mask, _ = _masks(module, x, target)
    assert np.array_equal(mask, _expected_mask(run_key(7, 0, 0), "y", (3, N), 0.3))


def test_the_cuda_variant_gives_the_same_bits():
    """On CUDA the right shifts are Divs (no BitShift kernel there): run both on the CPU."""
    import onnxruntime as ort

    program = _dropout_model(0.4)
    x = np.random.default_rng(2).standard_normal((2, N)).astype(np.float32)
    feeds = {"x": x, KEY_INPUT: run_key(3, 5, 1)}
    masks = []
    for shift in ("bitshift", "div"):
        rewritten, _ = seeded_dropout(program, shift)
        assert {"bitshift": "BitShift", "div": "Div"}[shift] in {n.op_type for n in rewritten.graph.node}
        model = onnx.utils.Extractor(rewritten).extract_model(["x", KEY_INPUT], ["y"])
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        masks.append(session.run(["y"], feeds)[0] != 0)
    assert np.array_equal(*masks)
    assert np.array_equal(masks[0], _expected_mask(run_key(3, 5, 1), "y", (2, N), 0.4))


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
def test_keep_rate_and_scale(ratio):
    module = Module(_dropout_model(ratio), device="cpu")
    rng = np.random.default_rng(0)
    x = rng.uniform(1, 2, (16, N)).astype(np.float32)
    mask, y = _masks(module, x, np.zeros_like(x))
    n, keep = mask.size, 1 - ratio
    sigma = np.sqrt(n * keep * (1 - keep))
    assert abs(mask.sum() - n * keep) < 4 * sigma, (mask.mean(), keep)
    scale = np.float32(1) / (np.float32(1) - np.float32(ratio))
    assert np.array_equal(y[mask], x[mask] * scale) and not y[~mask].any()
    # no structure between neighbours: P(both kept) ≈ keep², within 4 sigma
    both = (mask[:, 1:] & mask[:, :-1]).mean()
    pairs = mask[:, 1:].size
    assert abs(both - keep**2) < 4 * np.sqrt(keep**2 * (1 - keep**2) / pairs)


def test_masks_change_with_step_micro_batch_and_seed_and_repeat_exactly():
    model = _dropout_model(0.5)
    x, target = np.ones((2, N), np.float32), np.zeros((2, N), np.float32)
    seen = {}
    for seed in (0, 1):
        for step in (0, 1):
            for micro in (0, 1):
                module = Module(model, device="cpu")
                module.state.seeds["dropout"] = seed
                module.state.step, module.state.micro_batch = step, micro
                seen[seed, step, micro] = _masks(module, x, target)[0]
    masks = list(seen.values())
    for i, a in enumerate(masks):
        for b in masks[i + 1 :]:
            agreement = (a == b).mean()
            assert 0.45 < agreement < 0.55  # independent masks of p = 0.5 agree on half the elements
    again = Module(model, device="cpu")
    again.state.seeds["dropout"], again.state.step, again.state.micro_batch = 1, 1, 1
    assert np.array_equal(_masks(again, x, target)[0], seen[1, 1, 1])


def test_each_data_parallel_replica_draws_its_own_masks_and_replica_0_those_of_one_process():
    model = _dropout_model(0.5)
    x, target = np.ones((2, N), np.float32), np.zeros((2, N), np.float32)
    masks = {}
    for replica in (0, 1, 2):
        module = Module(model, device="cpu")
        module.state.step = 3
        module.replica = replica
        masks[replica] = _masks(module, x, target)[0]
    single = Module(model, device="cpu")
    single.state.step = 3
    assert np.array_equal(masks[0], _masks(single, x, target)[0])
    for a, b in ((0, 1), (0, 2), (1, 2)):
        # other keys agree on about half the elements (the add-shift hash leaves masks of two
        # keys up to ~8% correlated: 0.42 to 0.54 measured over other seeds, steps and replicas)
        assert 0.4 < (masks[a] == masks[b]).mean() < 0.6
    assert np.array_equal(run_key(3, 4, 5, replica=0), run_key(3, 4, 5))


def test_module_calls_count_micro_batches_and_an_update_resets_them():
    program = tm.compile_program(tm.dropout_mlp_onnx(), "sgd(lr=0.1, accumulate=true)")
    module = Module(program, device="cpu")
    optimizer = Optimizer(module)
    x, target = tm.batches(1)[0]
    module(x, target)
    module(x, target)
    assert module.state.micro_batch == 2
    optimizer.step()
    assert module.state.micro_batch == 0 and module.state.step == 1


def test_the_gradient_drops_what_the_forward_dropped():
    ratio = 0.3
    module = Module(_dropout_model(ratio), device="cpu")
    Optimizer(module)
    rng = np.random.default_rng(1)
    x, target = rng.uniform(1, 2, (5, N)).astype(np.float32), rng.standard_normal((5, N)).astype(np.float32)
    _, y, w_grad = module.train_step(x, target, outputs=["y", "w_grad"])
    kept = (y != 0).astype(np.float64)
    scale = 1 / (1 - np.float32(ratio))
    # mse = mean((y - t)^2), y = x * w * mask * scale: dL/dw = sum_batch 2 (y - t) x mask scale / size
    expected = (2 * (y - target) * x * kept * scale).sum(axis=0) / y.size
    np.testing.assert_allclose(w_grad, expected, rtol=1e-4, atol=1e-9)


def test_two_runs_are_identical_and_resume_is_bit_identical(tmp_path):
    program = tm.compile_program(tm.dropout_mlp_onnx(), "adamw(lr=0.01, accumulate=true)")
    batches = tm.batches(13, seed=3)

    def train(module, optimizer, part, start=0):
        for i, (x, target) in enumerate(part, start):
            module(x, target)
            if i % 2 == 1:  # two micro-batches a step; an odd count leaves one pending
                optimizer.step()
                module.lazy_reset_grad()

    runs = []
    for _ in range(2):
        module = Module(program, device="cpu")
        train(module, Optimizer(module), batches)
        runs.append(module.state.tensors)
    first = Module(program, device="cpu")
    train(first, Optimizer(first), batches[:7])  # stops mid-accumulation, as a checkpoint may
    path = first.state.save(tmp_path / "mid.safetensors")
    resumed = Module(program, CheckpointState.load(path, program), device="cpu")
    train(resumed, Optimizer(resumed), batches[7:], start=7)
    for name, value in runs[0].items():
        assert np.array_equal(value, runs[1][name]), name
        assert np.array_equal(value, resumed.state.tensors[name]), name


def test_onnxruntime_dropout_is_still_available_and_the_rewrite_is_standard_onnx():
    program = tm.compile_program(tm.dropout_mlp_onnx(), "sgd(lr=0.1)")
    rewritten, count = seeded_dropout(program)
    assert count == 1 and KEY_INPUT in [i.name for i in rewritten.graph.input]
    assert "Dropout" not in {n.op_type for n in rewritten.graph.node}
    assert {n.domain for n in rewritten.graph.node} <= {"", "ai.onnx"}
    onnx.checker.check_model(rewritten)
    module = Module(program, device="cpu", dropout="onnxruntime")
    x, target = tm.batches(1)[0]
    assert np.isfinite(module.train_step(x, target))
    with pytest.raises(GraphforgeError, match="dropout='philox'"):
        Module(program, device="cpu", dropout="philox")


def test_the_training_copy_holds_no_second_copy_of_the_carried_tensors():
    """The Module's rewritten program leaves out the initial values of what it always binds."""
    program = tm.compile_program(tm.dropout_mlp_onnx(), "adamw(lr=0.01)")
    module = Module(program, device="cpu")
    carried = set(module.state.tensors)
    assert set(module.parameters) <= {t.name for t in program.graph.initializer}
    kept = {t.name for t in module._train_program.graph.initializer}
    assert KEY_INPUT in [i.name for i in module._train_program.graph.input] and not carried & kept
    assert np.isfinite(module.train_step(*tm.batches(1)[0]))


def test_the_inference_export_has_no_dropout(tmp_path):
    program = tm.compile_program(tm.dropout_mlp_onnx(), "sgd(lr=0.1)")
    module = Module(program, device="cpu")
    Optimizer(module)
    for x, target in tm.batches(3):
        module.train_step(x, target)
    path = module.export_model_for_inferencing(tmp_path / "model.onnx", ["y"])
    exported = onnx.load(path)
    assert not [n for n in exported.graph.node if n.op_type == "Dropout" or n.name.startswith("dropout::")]
    assert KEY_INPUT not in [i.name for i in exported.graph.input]
    x, target = tm.batches(1, seed=9)[0]
    session = graphforge.create_session(exported, providers=["CPUExecutionProvider"])
    _, y_eval = module.eval()(x, target, outputs=["y"])
    np.testing.assert_array_equal(session.run(["y"], {"x": x})[0], y_eval)
