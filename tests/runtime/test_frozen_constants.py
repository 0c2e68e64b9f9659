"""A frozen weight stays a constant of every session the runner makes (an initializer that is
no input), so that onnxruntime may prepack it; training leaves it as it was; a LoRA run's
checkpoint holds the adapters and their states alone, and refers to the base by checksums."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from safetensors import safe_open

import graphforge
from graphforge.errors import CheckpointError
from graphforge.placement.lean import lean_model
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointState, Module
from graphforge.runtime.checkpoint import METADATA_KEY
from graphforge.train.inference_export import export

DIGITS = Path(__file__).resolve().parents[2] / "examples/digits/model.onnx"
PIPELINES = {
    "autodiff": "loss(kind=mse, output=y), autodiff(frozen=[w1, b1]), adamw(lr=0.1)",
    "lora": "lora(r=2, alpha=4, targets=[fc1, fc2]), loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=0.1)",
}


def _trained(name: str) -> tuple[onnx.ModelProto, Module, list[dict]]:
    if name == "lora":
        rng = np.random.default_rng(0)
        source = onnx.load(DIGITS)
        batches = [{"images": rng.integers(0, 17, (8, 8, 8), dtype=np.uint8),
                    "labels": rng.integers(0, 10, 8).astype(np.int64)} for _ in range(3)]  # fmt: skip
    else:
        source, batches = models.tanh_mlp(), models.tanh_mlp_batches(3)
    program = graphforge.compile(source, PIPELINES[name]).model
    module = Module(program, device="cpu")
    for batch in batches:
        module.train_step(**batch)
    return program, module, batches


@pytest.mark.parametrize("name", PIPELINES)
def test_a_frozen_weight_is_a_constant_of_every_session(name):
    program, module, _ = _trained(name)
    frozen = set(ProgramRoles.read(program).frozen)
    assert frozen  # the base (lora), w1 and b1 (autodiff)
    sessions = list(module.runner._sessions.values())
    assert sessions
    for bound in sessions:
        fed = {i.name for i in bound.session.get_inputs()}
        overridable = {i.name for i in bound.session.get_overridable_initializers()}
        assert not frozen & (fed | overridable | set(bound.defaults)), bound.where
    lean = lean_model(program, bound=module.runner.carried)
    kept = {t.name for t in lean.graph.initializer}
    assert frozen <= kept and not frozen & {i.name for i in lean.graph.input}


@pytest.mark.parametrize("name", PIPELINES)
def test_training_leaves_the_frozen_weights_as_they_were(name, tmp_path):
    program, module, _ = _trained(name)
    frozen = ProgramRoles.read(program).frozen
    start = {t.name: numpy_helper.to_array(t) for t in program.graph.initializer if t.name in frozen}
    output = "y" if name == "autodiff" else "logits"
    exported = onnx.load(module.export_model_for_inferencing(tmp_path / "inference.onnx", [output]))
    after = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer if t.name in frozen}
    assert after.keys() == start.keys()
    for adapter in ProgramRoles.read(program).lora:  # the export merges W + scale · (B A) (in W's layout)
        delta = adapter.scale * (module.parameters[adapter.b].astype(np.float64) @ module.parameters[adapter.a])
        after[adapter.weight] = after[adapter.weight] - (delta.T if adapter.fan_in_fan_out else delta)
    for key, value in start.items():
        np.testing.assert_allclose(after[key], value, rtol=0, atol=1e-6, err_msg=key)
    initial = {t.name: numpy_helper.to_array(t) for t in program.graph.initializer}
    trained = module.parameters
    assert trained and not frozen.keys() & trained.keys()
    assert any(not np.array_equal(value, initial[key]) for key, value in trained.items())  # the rest trained


def test_a_lora_checkpoint_holds_the_adapters_and_their_states_alone(tmp_path):
    """The base stays in the program (its constants, kept once): a checkpoint's tensor bytes
    are the adapters' and their two AdamW moments' (3 × the adapters'), and its document
    refers to the base by each frozen weight's CRC-32."""
    program, module, _ = _trained("lora")
    program_roles = ProgramRoles.read(program)
    path = module.state.save(tmp_path / "checkpoint.safetensors")
    initial = {t.name: numpy_helper.to_array(t) for t in program.graph.initializer}
    adapters = {n for a in program_roles.lora for n in (a.a, a.b)}
    with safe_open(str(path), framework="numpy") as f:
        names = set(f.keys())
        saved = sum(f.get_tensor(n).nbytes for n in names)
        document = json.loads(f.metadata()[METADATA_KEY])
    assert names == adapters | {f"{n}.{m}" for n in adapters for m in ("exp_avg", "exp_avg_sq")}
    assert saved == 3 * sum(initial[n].nbytes for n in adapters) == 4848  # r = 2: 2 · (64 + 64) + 2 · (64 + 10) values
    assert sum(initial[n].nbytes for n in program_roles.frozen) == 4 * (64 * 64 + 64 + 10 * 64 + 10)  # not saved
    base = {n: zlib.crc32(initial[n].tobytes()) for n in program_roles.frozen}  # the base's bytes as compiled
    assert document["base"] == base


def test_a_checkpoint_of_another_base_is_refused_by_name(tmp_path):
    """Resuming (CheckpointState.load with the program) or exporting with a checkpoint trained
    on another base is refused, naming the weight that differs; the same base loads."""
    program, module, _ = _trained("lora")
    path = module.state.save(tmp_path / "checkpoint.safetensors")
    assert CheckpointState.load(path, program).step == 3
    other = onnx.load(DIGITS)
    bias = next(t for t in other.graph.initializer if t.name == "fc2.bias")
    values = numpy_helper.to_array(bias).copy()
    values[0] += 1e-3
    bias.CopyFrom(numpy_helper.from_array(values, "fc2.bias"))
    other_program = graphforge.compile(other, PIPELINES["lora"]).model
    refused = r"was trained on another base model than the program's: the frozen weight 'fc2.bias' differs"
    with pytest.raises(CheckpointError, match=refused):
        CheckpointState.load(path, other_program)
    onnx.save(other_program, tmp_path / "other.onnx")
    with pytest.raises(CheckpointError, match=refused):
        export(tmp_path / "other.onnx", tmp_path / "inference.onnx", checkpoint=path)
    assert not (tmp_path / "inference.onnx").exists()


@pytest.mark.parametrize(
    ("extra", "tolerance"), [("recompute(budget=0)", 0.0), ("mixed_precision(dtype=float16)", 1e-3)]
)
def test_recompute_and_mixed_precision_train_a_lora_program_as_it_trains(extra, tolerance):
    """After the lora pass's forward nodes (``lora::``), recompute recomputes what it saved
    (the same numbers, bit for bit) and mixed_precision computes in float16 (its rounding):
    three steps' losses and adapters against the program without them."""
    plain, module, batches = _trained("lora")
    program = graphforge.compile(onnx.load(DIGITS), f"{PIPELINES['lora']}, {extra}").model
    assert extra.split("(")[0] in {r.split(".")[-1] for r in ProgramRoles.read(program).metadata}
    other = Module(program, device="cpu")
    losses = [float(other.train_step(**batch)) for batch in batches]
    again = Module(plain, device="cpu")
    expected = [float(again.train_step(**batch)) for batch in batches]
    np.testing.assert_allclose(losses, expected, rtol=tolerance, atol=0)
    for name, value in module.parameters.items():
        np.testing.assert_allclose(other.parameters[name], value, rtol=0, atol=10 * tolerance, err_msg=name)
