"""graphforge's JavaScript runtime (js/) against graphforge in Python, on the same artifacts
and batches: on onnxruntime-node, bit for bit where the two onnxruntime builds run the same
kernels; on onnxruntime-web's wasm backend under Node, within what its kernels explain.
Checkpoints cross between the two in both directions, and the JS unit tests (node --test) pass.

The runtime is driven by js/test/driver/steps.mjs, one Node process per run; js/node_modules
is what ``make install`` (npm ci) made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from _tensor_file import write_tensors
from js_fixtures import write_fixtures

import graphforge
from graphforge import CheckpointState, Module, Optimizer
from graphforge.ondevice.artifacts import write_artifacts
from graphforge.program import ProgramRoles
from graphforge.runtime import CosineSchedule

REPO = Path(__file__).resolve().parents[2]
JS = REPO / "js"
DRIVER = JS / "test" / "driver" / "steps.mjs"
DIGITS = REPO / "examples" / "digits" / "model.onnx"
DATA = np.load(REPO / "data" / "digits" / "train.npz")
NODE = shutil.which("node")


@pytest.fixture(scope="module", autouse=True)
def runtime_installed():
    if NODE is None:
        pytest.fail("node is not on PATH: make install sets it up (Node.js 20 from the system's packages)")
    if not (JS / "node_modules" / "onnxruntime-node").is_dir():
        pytest.fail("onnxruntime-node is missing: run make install first (it runs npm ci in js/)")


def batches_file(folder: Path, batches: list[dict[str, np.ndarray]]) -> dict:
    """The batches as the driver reads them: one file of their bytes, and where each tensor is."""
    path = folder / "batches.bin"
    return {"file": str(path), "steps": write_tensors(path, (batch.items() for batch in batches))}


def run_js(job: dict, timeout: float = 300) -> dict:
    done = subprocess.run([NODE, str(DRIVER), json.dumps(job)], capture_output=True, text=True, timeout=timeout, cwd=JS)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def digits_batches(count: int, size: int = 28, start: int = 0) -> list[dict[str, np.ndarray]]:
    return [
        {
            "images": DATA["images"][(start + i) * size : (start + i + 1) * size],
            "labels": DATA["labels"][(start + i) * size : (start + i + 1) * size],
        }
        for i in range(count)
    ]


def cnn_case(folder: Path, count: int) -> tuple[Path, list[dict[str, np.ndarray]]]:
    """A small CNN whose BatchNorm trains (exported from torch for training) and ``count``
    batches of 16 random 8×8 images."""
    torch = pytest.importorskip("torch")
    from graphforge.torch import export_for_training

    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 10)
    )
    path = folder / "cnn.onnx"
    graphforge.save(export_for_training(net, (torch.zeros(2, 1, 8, 8),), input_names=["x"]), path)
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.standard_normal((16, 1, 8, 8)).astype(np.float32), "labels": rng.integers(0, 10, 16)}
        for _ in range(count)
    ]
    return path, batches


def python_steps(program, batches, steps, *, accumulate=1, state=None, schedule=None):
    """graphforge's Module on the program (its ONNX update, as the artifacts hold it), the
    loop a JS user writes: the losses, and the Module."""
    module = Module(program, state or CheckpointState.from_program(program), device="cpu", update="onnx")
    optimizer = Optimizer(module)
    rates = schedule(optimizer) if schedule else None
    losses, at = [], 0
    for _ in range(steps):
        total = 0.0
        for _ in range(accumulate):
            total += float(module(*batches[at].values()))
            at += 1
        optimizer.step()
        module.lazy_reset_grad()
        losses.append(total / accumulate)
        if rates:
            rates.step()
    return losses, module


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    folder = tmp_path_factory.mktemp("js-digits")
    program = graphforge.compile(
        DIGITS, "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, weight_decay=0.01, accumulate=true)"
    ).model
    write_artifacts(program, folder / "art", outputs=["logits"])
    return folder, program


def test_fifty_digits_steps_on_onnxruntime_node_equal_python_bit_for_bit(digits):
    """50 AdamW steps: every loss and, through the checkpoint the JS runtime writes (which
    graphforge in Python loads, CRCs checked), every carried tensor equal to the Module's."""
    folder, program = digits
    batches = digits_batches(50)
    job = {"backend": "node", "artifacts": str(folder / "art"), "batches": batches_file(folder, batches), "steps": 50}
    got = run_js({**job, "save": str(folder / "js.ckpt")})
    want, module = python_steps(program, batches, 50)
    assert got["losses"] == want and got["step"] == 50
    saved = CheckpointState.load(folder / "js.ckpt", program)
    assert saved.step == 50 and saved.learning_rate == pytest.approx(0.01)
    for name, value in module.state.tensors.items():
        assert np.array_equal(saved.tensors[name], value), name


def test_a_lora_program_trains_on_node_as_python_bit_for_bit_and_on_wasm_within_its_rounding(tmp_path):
    """The digits MLP with adapters on fc1 and fc2: the adapters are the artifacts' parameters
    (the base their frozen state, as write_artifacts keeps a program's frozen weights); 10
    AdamW steps on onnxruntime-node equal the Module's bit for bit (losses, and every carried
    tensor of the checkpoint the JS runtime writes), on onnxruntime-web's wasm within 1e-5."""
    pipeline = "lora(r=4, alpha=8, targets=[fc1, fc2]), loss(kind=cross_entropy, output=logits), autodiff, " \
        "adamw(lr=1e-2, accumulate=true)"  # fmt: skip
    program = graphforge.compile(DIGITS, pipeline).model
    manifest = write_artifacts(program, tmp_path / "art", outputs=["logits"])
    assert {s.name for s in manifest.state if s.role == "parameter"} == {
        f"fc{i}.lora_{x}.weight" for i in (1, 2) for x in "AB"
    }
    batches = digits_batches(10)
    job = {"artifacts": str(tmp_path / "art"), "batches": batches_file(tmp_path, batches), "steps": 10}
    got = run_js({**job, "backend": "node", "save": str(tmp_path / "js.ckpt")})
    want, module = python_steps(program, batches, 10)
    assert got["losses"] == want
    saved = CheckpointState.load(tmp_path / "js.ckpt")  # (the artifacts' checkpoint: the frozen base besides)
    assert set(saved.tensors) == set(module.state.tensors) | set(ProgramRoles.read(program).frozen)
    for name, value in module.state.tensors.items():
        assert np.array_equal(saved.tensors[name], value), name
    web = run_js({**job, "backend": "web"})
    np.testing.assert_allclose(web["losses"], want, rtol=1e-5)


def test_accumulation_and_a_schedule_equal_python(digits):
    """Two micro-batches a step (runTrainStep twice, then runOptimizerStep, lazyResetGrad),
    the rate from a cosine schedule with warmup built in JS: the rates and losses of graphforge's."""
    folder, program = digits
    batches = digits_batches(24)
    options = {"warmupSteps": 3, "totalSteps": 12, "baseLr": 0.02, "endLr": 0.001}
    job = {"backend": "node", "artifacts": str(folder / "art"), "batches": batches_file(folder, batches), "steps": 12,
           "accumulate": 2, "schedule": {"kind": "cosine", "options": options}}  # fmt: skip
    got = run_js(job)

    def cosine(optimizer):
        return CosineSchedule(optimizer, base_lr=0.02, warmup_steps=3, total_steps=12, end_lr=0.001)

    want, _ = python_steps(program, batches, 12, accumulate=2, schedule=cosine)
    expected_rates = [cosine(None).lr_at(k) for k in range(12)]
    assert got["learningRates"] == expected_rates
    assert got["losses"] == want


@pytest.mark.parametrize(
    ("pipeline", "steps_per_run"),
    [
        ("adamw(lr=1e-2, weight_decay=0.01, accumulate=true)", 4),
        (
            "lora(r=4, alpha=8, dropout=0.25, targets=[fc1]), LOSS, autodiff, sgd(lr=0.05, momentum=0.9, accumulate=true)",
            3,
        ),
    ],
    ids=["adamw", "lora-dropout-sgd"],
)
def test_k_steps_in_one_run_on_node_equal_pythons_single_steps(tmp_path, pipeline, steps_per_run):
    """runSteps(feeds, k) on train_steps.onnx, the rates of a cosine schedule with warmup
    (schedule.nextRates(k)), 7 steps in runs of k and a shorter last run: the losses, the rates
    and every carried tensor equal graphforge's Module stepping one step at a time, bit for bit
    (AdamW; SGD with momentum on a LoRA program whose adapter dropout draws each step's masks)."""
    loss = "loss(kind=cross_entropy, output=logits)"
    text = pipeline.replace("LOSS", loss) if "LOSS" in pipeline else f"{loss}, autodiff, {pipeline}"
    program = graphforge.compile(DIGITS, text).model
    write_artifacts(program, tmp_path / "art")
    batches = digits_batches(7)
    options = {"warmupSteps": 2, "totalSteps": 7, "baseLr": 0.02, "endLr": 0.001}
    job = {"backend": "node", "artifacts": str(tmp_path / "art"), "batches": batches_file(tmp_path, batches), "steps": 7,
           "stepsPerRun": steps_per_run, "schedule": {"kind": "cosine", "options": options}, "save": str(tmp_path / "js.ckpt")}  # fmt: skip
    got = run_js(job)

    def cosine(optimizer):
        return CosineSchedule(optimizer, base_lr=0.02, warmup_steps=2, total_steps=7, end_lr=0.001)

    want, module = python_steps(program, batches, 7, schedule=cosine)
    assert got["learningRates"] == [cosine(None).lr_at(k) for k in range(7)]
    assert got["losses"] == want and got["step"] == 7
    saved = CheckpointState.load(tmp_path / "js.ckpt")
    for name, value in module.state.tensors.items():
        assert np.array_equal(saved.tensors[name], value), name


def test_a_checkpoint_crosses_between_python_and_javascript_both_ways(digits):
    """Python trains 10 steps and saves; the JS runtime resumes for 10 more and saves; Python
    resumes that for 10 more: the same as 30 uninterrupted steps in Python."""
    folder, program = digits
    batches = digits_batches(30)
    first, module = python_steps(program, batches[:10], 10)
    module.state.save(folder / "py10.ckpt")
    job = {"backend": "node", "artifacts": str(folder / "art"), "batches": batches_file(folder, batches[10:20]),
           "steps": 10, "resume": str(folder / "py10.ckpt"), "save": str(folder / "js20.ckpt")}  # fmt: skip
    second = run_js(job)
    resumed = CheckpointState.load(folder / "js20.ckpt", program)
    assert resumed.step == 20
    third, final = python_steps(program, batches[20:], 10, state=resumed)
    whole, uninterrupted = python_steps(program, batches, 30)
    assert first + second["losses"] + third == whole
    for name, value in uninterrupted.state.tensors.items():
        assert np.array_equal(final.state.tensors[name], value), name


def test_a_cnn_with_batchnorm_and_a_small_gpt2_equal_python(tmp_path):
    """A CNN whose BatchNorm trains (its statistics carried) and evaluates on them, and the
    shipped 2-layer GPT-2: 50 steps on onnxruntime-node, the losses, the eval loss and every
    carried tensor (through the checkpoint the JS runtime writes) equal to Python's."""
    cnn_path, cnn = cnn_case(tmp_path, 51)
    rng = np.random.default_rng(0)
    gpt2 = [{"input_ids": rng.integers(0, 128, (4, 16)), "labels": rng.integers(0, 128, (4, 16))} for _ in range(51)]
    cases = {
        "cnn": (cnn_path, cnn, "sgd(lr=0.05, momentum=0.9, accumulate=true)"),
        "gpt2": (REPO / "golden_models" / "gpt2_tiny" / "model.onnx", gpt2, "adamw(lr=1e-3, accumulate=true)"),
    }
    for name, (model, batches, optimizer) in cases.items():
        program = graphforge.compile(model, f"loss(kind=cross_entropy, output=logits), autodiff, {optimizer}").model
        write_artifacts(program, tmp_path / name)
        job = {
            "backend": "node",
            "artifacts": str(tmp_path / name),
            "batches": batches_file(tmp_path, batches),
            "steps": 50,
            "eval": 50,
            "save": str(tmp_path / f"{name}.ckpt"),
        }
        got = run_js(job)
        want, module = python_steps(program, batches, 50)
        assert got["losses"] == want, name
        saved = CheckpointState.load(tmp_path / f"{name}.ckpt", program)
        for tensor, value in module.state.tensors.items():
            assert np.array_equal(saved.tensors[tensor], value), (name, tensor)
        module.eval()
        assert got["evalLoss"] == float(module(*batches[50].values())), name


def test_onnxruntime_web_wasm_under_node_trains_as_python(digits, tmp_path):
    """The same runtime on onnxruntime-web (its wasm backend, in Node): 20 steps of the digits MLP
    and of the BatchNorm CNN within 1e-5 of Python's losses (its kernels are another build of
    onnxruntime's CPU ones)."""
    folder, program = digits
    cnn_path, cnn = cnn_case(tmp_path, 20)
    pipeline = "loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.05, momentum=0.9, accumulate=true)"
    cnn_program = graphforge.compile(cnn_path, pipeline).model
    write_artifacts(cnn_program, tmp_path / "cnn")
    for artifacts, model, batches in (
        (folder / "art", program, digits_batches(20)),
        (tmp_path / "cnn", cnn_program, cnn),
    ):
        job = {"backend": "web", "artifacts": str(artifacts), "batches": batches_file(tmp_path, batches), "steps": 20}
        got = run_js(job)
        assert got["executionProviders"] == ["wasm"]  # onnxruntime-web's own backend, without asking
        want, _ = python_steps(model, batches, 20)
        np.testing.assert_allclose(got["losses"], want, rtol=1e-5, err_msg=str(artifacts))


def test_the_javascript_unit_tests_pass(tmp_path):
    """npm test's runner (js/test/run.mjs) on the fixtures js_fixtures.py writes: three artifact
    sets (accumulating, not, with frozen parameters), the schedules' rates and dropout keys."""
    write_fixtures(tmp_path)
    env = {**os.environ, "GRAPHFORGE_JS_FIXTURES": str(tmp_path)}
    done = subprocess.run([NODE, "test/run.mjs"], capture_output=True, text=True, timeout=300, cwd=JS, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "# skipped 0" in done.stdout and "# fail 0" in done.stdout


def test_frozen_parameters_train_and_load_as_in_python(tmp_path):
    """generate_artifacts(frozen_params=...) on the digits MLP, trained 10 steps by the JS runtime
    and by graphforge.ondevice's Module: the same losses, the same contiguous parameters, trainable
    (fc2) and all (fc1 too, unchanged); a buffer loaded with trainableOnly false (the frozen
    parameters halved) gives the same eval loss on both."""
    from graphforge import artifacts
    from graphforge.ondevice import CheckpointState as State
    from graphforge.ondevice import Module as DropIn
    from graphforge.ondevice import Optimizer as DropInOptimizer

    folder = tmp_path / "art"
    artifacts.generate_artifacts(
        onnx.load(DIGITS), frozen_params=["fc1.weight", "fc1.bias"], loss=artifacts.LossType.CrossEntropyLoss,
        artifact_directory=folder,
    )  # fmt: skip
    batches = digits_batches(11)
    module = DropIn(
        folder / "training_model.onnx", State.load_checkpoint(folder / "checkpoint"), folder / "eval_model.onnx"
    )
    optimizer = DropInOptimizer(folder / "optimizer_model.onnx", module)
    before = module.get_contiguous_parameters(trainable_only=False)
    losses = []
    for batch in batches[:10]:
        losses.append(float(module(*batch.values())))
        optimizer.step()
        module.lazy_reset_grad()
    trainable, everything = module.get_contiguous_parameters(trainable_only=True), module.get_contiguous_parameters()
    assert trainable.size == 650 and everything.size == 4810
    np.testing.assert_array_equal(everything[650:], before[650:])  # fc1, frozen, after fc2 in the checkpoint
    loaded = everything.copy()
    loaded[650:] *= np.float32(0.5)
    (tmp_path / "buffer.bin").write_bytes(loaded.tobytes())
    module.copy_buffer_to_parameters(loaded, trainable_only=False)
    module.eval()
    eval_loss = float(module(*batches[10].values()))

    job = {"backend": "node", "artifacts": str(folder), "batches": batches_file(tmp_path, batches), "steps": 10,
           "parameters": True, "load": {"file": str(tmp_path / "buffer.bin"), "trainableOnly": False}, "eval": 10}  # fmt: skip
    got = run_js(job)
    assert got["losses"] == losses
    assert got["trainable"] == trainable.tolist() and got["all"] == everything.tolist()
    assert got["evalLoss"] == eval_loss


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_on_wasm_a_transformers_gradients_are_float32_roundings_of_the_same_values(tmp_path, name):
    """A 2-layer GPT-2 and a Llama-style model, one training run on onnxruntime-web's wasm (in
    Node) and on onnxruntime-node: a few of the wasm build's kernels round differently (GPT-2's
    LayerNormalization and ReduceMean, the Llama's Cos, Sin and ReduceMean: benchmarks/wasm_kernels.py),
    so the gradients are not bit for bit. The
    tolerance that explains them: against the same training model run in float64, every
    gradient of wasm's is within 3 times native's own float32 error of native's."""
    import onnxruntime as ort
    from _float64 import in_float64

    if name == "gpt2":
        model = REPO / "golden_models" / "gpt2_tiny" / "model.onnx"
    else:
        pytest.importorskip("transformers")
        import models

        model = models.export_dynamo(models.llama_module(), tmp_path / "llama.onnx", opset=18)
    program = graphforge.compile(
        model, "loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.1, accumulate=true)"
    ).model
    manifest = write_artifacts(program, tmp_path / "art")
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 128, (4, 16)), "labels": rng.integers(0, 128, (4, 16))}
    index = batches_file(tmp_path, [batch])
    runs = {}
    for backend in ("node", "web"):
        job = {"backend": backend, "artifacts": str(tmp_path / "art"), "batches": index, "steps": 0,
               "gradientsOnly": True, "save": str(tmp_path / f"{backend}.ckpt")}  # fmt: skip
        run_js(job)
        runs[backend] = CheckpointState.load(tmp_path / f"{backend}.ckpt").tensors
    training = manifest.model("training")
    state = CheckpointState.load(tmp_path / "art" / "checkpoint").tensors
    feeds = dict(batch)
    for port in training.inputs:
        if port.role == "state":
            value = state[port.state]
            feeds[port.name] = value.astype(np.float64) if value.dtype == np.float32 else value
        elif port.role == "reset":
            feeds[port.name] = np.array(True)
    double = onnx.load(tmp_path / "art" / training.file)
    session = ort.InferenceSession(in_float64(double).SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    reference = dict(zip(names, session.run(names, feeds), strict=True))
    gradients = [
        p
        for p in training.outputs
        if p.role == "state" and any(s.name == p.state and s.role == "accumulator" for s in manifest.state)
    ]
    assert gradients
    for port in gradients:
        exact = reference[port.name]
        native, wasm = (runs[b][port.state].astype(np.float64) for b in ("node", "web"))
        own = np.linalg.norm(native - exact)
        assert np.linalg.norm(wasm - native) <= 3 * own + 1e-12 * np.linalg.norm(exact), port.state
        assert np.linalg.norm(wasm - exact) <= 4 * own + 1e-12 * np.linalg.norm(exact), port.state


def test_a_frozen_backbone_kept_constant_trains_on_node_as_python(tmp_path):
    """freeze(names=[fc1.*]) on the digits MLP, its artifacts written with the frozen weights
    constants of the models (--frozen-constants): the state holds fc2 and its Adam moments alone;
    10 steps on onnxruntime-node give the Module's losses, and its checkpoint the Module's fc2, bit
    for bit."""
    program = graphforge.compile(
        DIGITS, "freeze(names=['fc1.*']), loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2)"
    ).model
    manifest = write_artifacts(program, tmp_path / "art", frozen=[])
    assert not [s.name for s in manifest.state if s.name.startswith("fc1")]
    batches = digits_batches(10)
    job = {"backend": "node", "artifacts": str(tmp_path / "art"), "batches": batches_file(tmp_path, batches),
           "steps": 10, "save": str(tmp_path / "js.ckpt")}  # fmt: skip
    got = run_js(job)
    want, module = python_steps(program, batches, 10)
    assert got["losses"] == want  # bit for bit: the same kernels on the same constants
    saved = CheckpointState.load(tmp_path / "js.ckpt", program)
    for name in ("fc2.weight", "fc2.bias"):
        assert np.array_equal(saved.tensors[name], module.state.tensors[name]), name
