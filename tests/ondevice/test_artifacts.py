"""On-device artifacts: the files, their plain inputs, the manifest that describes them, and
models that compute what the program computes (the program run by graphforge's Module is the
oracle): the training then optimizer models equal a Module's step, the one-model step equals
them, eval runs BatchNorm on its statistics, Dropout draws the Module's masks."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _pages import page_block

import graphforge
import graphforge.train
from graphforge import artifacts
from graphforge.errors import GraphforgeError
from graphforge.ondevice.artifacts import write_artifacts
from graphforge.ondevice.manifest import FILES, MANIFEST, Manifest, ManifestError
from graphforge.runtime.dropout import run_key

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "digits" / "model.onnx"
DATA = np.load(REPO / "data" / "digits" / "train.npz")
PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, accumulate=true)"
GRAPHFORGE = Path(sys.executable).parent / "graphforge"


def _batch(i: int, size: int = 32):
    return DATA["images"][i * size : (i + 1) * size], DATA["labels"][i * size : (i + 1) * size]


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[onnx.ModelProto, Path, Manifest]:
    program = graphforge.compile(DIGITS, PIPELINE).model
    folder = tmp_path_factory.mktemp("digits-artifacts")
    return program, folder, write_artifacts(program, folder, outputs=["logits"])


def test_the_files_and_their_plain_inputs(digits):
    """Every file the manifest names, each model valid, and no initializer that is an input
    too (onnxruntime's C API would leave that input out of the session and drop its feed)."""
    _, folder, manifest = digits
    names = {p.name for p in folder.iterdir()}
    assert names == {*FILES.values(), "checkpoint", MANIFEST}
    for key, entry in manifest.models.items():
        model = onnx.load(folder / entry.file)
        onnx.checker.check_model(model, full_check=True)
        inputs = [i.name for i in model.graph.input]
        assert not {t.name for t in model.graph.initializer} & set(inputs), key
        assert [p.name for p in entry.inputs] == inputs and [p.name for p in entry.outputs] == [
            o.name for o in model.graph.output
        ]
        session = ort.InferenceSession(str(folder / entry.file), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == inputs, key  # every input a session input


def test_the_manifest_names_every_role(digits):
    _program, folder, manifest = digits
    document = json.loads((folder / MANIFEST).read_text())
    assert document["format"] == "graphforge.ondevice" and document["version"] == 2
    training = manifest.model("training")
    roles = {p.name: (p.role, p.state) for p in training.inputs}
    assert roles["images"] == ("batch", None) and roles["labels"] == ("labels", None)
    assert roles["lazy_reset_grad"] == ("reset", None)
    assert roles["fc1.weight"] == ("state", "fc1.weight") and roles["fc1.weight_grad_acc"][0] == "state"
    outputs = {p.name: (p.role, p.state) for p in training.outputs}
    assert training.outputs[0].name == "loss" and outputs["loss"] == ("loss", None)
    assert outputs["logits"] == ("output", None)
    assert outputs["fc1.weight_grad_acc_next"] == ("state", "fc1.weight_grad_acc")
    optimizer = {p.name: (p.role, p.state) for p in manifest.model("optimizer").inputs}
    assert optimizer["lr"] == ("lr", None) and optimizer["step"] == ("step", None)
    assert optimizer["fc1.weight_grad_acc"] == ("state", "fc1.weight_grad_acc")  # the accumulated gradient
    updated = {p.state for p in manifest.model("optimizer").outputs if p.role == "state"}
    assert updated == {c["name"] for c in document["state"] if c["role"] in ("parameter", "optimizer")}
    assert manifest.accumulates and manifest.optimizer == "adamw" and manifest.default_lr == 0.01
    assert {p.role for p in manifest.model("inference").inputs} == {"batch"}
    shape = {p.name: p.shape for p in training.inputs}
    assert shape["images"] == ("batch", 8, 8) and shape["fc1.weight"] == (64, 64)


def test_the_training_then_optimizer_models_are_a_modules_step(digits):
    """Run by hand as any runtime runs them (the state fed from the checkpoint, the outputs
    written back by the manifest's pairs), 10 steps equal graphforge's Module on the program,
    bit for bit; the whole-step model equals the two."""
    program, folder, manifest = digits
    state = graphforge.CheckpointState.load(folder / "checkpoint").tensors
    whole = dict(state)
    sessions = {
        k: ort.InferenceSession(str(folder / e.file), providers=["CPUExecutionProvider"])
        for k, e in manifest.models.items()
    }
    module = graphforge.Module(program, device="cpu", update="onnx")
    optimizer = graphforge.Optimizer(module)

    def run(key, feeds, held):
        entry = manifest.model(key)
        values = dict(zip([p.name for p in entry.outputs], sessions[key].run(None, feeds), strict=True))
        for port in entry.outputs:
            if port.role == "state":
                held[port.state] = values[port.name]
        return values

    for step in range(10):
        images, labels = _batch(step)
        feeds = {"images": images, "labels": labels, "lazy_reset_grad": np.array(True)}
        training = manifest.model("training")
        loss = run(
            "training", {**feeds, **{p.name: state[p.state] for p in training.inputs if p.role == "state"}}, state
        )
        scalars = {"lr": np.array(0.01, np.float32), "step": np.array(step, np.int64)}
        update = manifest.model("optimizer")
        run("optimizer", {**scalars, **{p.name: state[p.state] for p in update.inputs if p.role == "state"}}, state)
        one = manifest.model("train_step")
        whole_feeds = {**feeds, **scalars, **{p.name: whole[p.state] for p in one.inputs if p.role == "state"}}
        fused = run("train_step", whole_feeds, whole)
        expected = module(images, labels)
        optimizer.step()
        module.lazy_reset_grad()
        assert float(loss["loss"]) == float(expected) == float(fused["loss"])
    for name, value in module.state.tensors.items():
        assert np.array_equal(state[name], value), name
        assert np.array_equal(whole[name], value), name


def test_batchnorm_trains_in_the_training_model_and_is_frozen_in_eval(tmp_path):
    """A CNN with BatchNorm: the training model updates the running statistics (state pairs);
    the eval and inference models normalize with them, as graphforge's evaluation does."""
    torch = pytest.importorskip("torch")
    from graphforge.torch import export_for_training

    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 10)
    )
    path = tmp_path / "cnn.onnx"
    graphforge.save(export_for_training(net, (torch.zeros(2, 1, 8, 8),), input_names=["x"]), path)
    program = graphforge.compile(
        path, "loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.1, accumulate=true)"
    ).model
    manifest = write_artifacts(program, tmp_path / "art")
    buffers = [s.name for s in manifest.state if s.role == "buffer"]
    assert buffers and {p.state for p in manifest.model("training").outputs if p.role == "state"} >= set(buffers)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((6, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 6)
    state = graphforge.CheckpointState.load(tmp_path / "art" / "checkpoint").tensors
    state = {k: v + 0.5 if k in buffers else v for k, v in state.items()}  # statistics a run would have
    evaluate = ort.InferenceSession(str(tmp_path / "art" / "eval_model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {
        "x": x,
        "labels": y,
        **{p.name: state[p.state] for p in manifest.model("eval").inputs if p.role == "state"},
    }
    (eval_loss,) = evaluate.run(["loss"], feeds)
    module = graphforge.Module(program, graphforge.CheckpointState.from_program(program), device="cpu")
    module.runner.write_tensors(state)
    module.eval()
    np.testing.assert_allclose(eval_loss, module(x, y), rtol=1e-6)


def test_dropout_draws_the_modules_masks(tmp_path):
    """Dropout's masks come from a key input (uint32[2]) a runtime computes from the seed,
    the step and the micro-batch: fed run_key, the training model's loss is the Module's."""
    torch = pytest.importorskip("torch")
    from graphforge.torch import export_for_training

    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 3))
    path = tmp_path / "dropout.onnx"
    graphforge.save(export_for_training(net, (torch.zeros(2, 8),), input_names=["x"]), path)
    program = graphforge.compile(
        path, "loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.1, accumulate=true)"
    ).model
    manifest = write_artifacts(program, tmp_path / "art")
    assert manifest.dropout == {"input": "graphforge.dropout_key", "seed": 0, "key": "splitmix64"}
    training = manifest.model("training")
    assert {p.name: p.role for p in training.inputs}["graphforge.dropout_key"] == "dropout_key"
    state = graphforge.CheckpointState.load(tmp_path / "art" / "checkpoint").tensors
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((5, 8)).astype(np.float32), rng.integers(0, 3, 5)
    session = ort.InferenceSession(str(tmp_path / "art" / "training_model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "labels": y, "lazy_reset_grad": np.array(True), "graphforge.dropout_key": run_key(0, 0, 0)}
    feeds.update({p.name: state[p.state] for p in training.inputs if p.role == "state"})
    (loss,) = session.run(["loss"], feeds)
    module = graphforge.Module(program, device="cpu")
    assert float(loss) == float(module(x, y))
    feeds["graphforge.dropout_key"] = run_key(0, 0, 1)  # another micro-batch: other masks
    assert float(session.run(["loss"], feeds)[0]) != float(loss)


def test_a_program_that_does_not_accumulate_hands_its_gradients_over(tmp_path):
    program = graphforge.compile(DIGITS, "loss(kind=cross_entropy, output=logits), autodiff, sgd(lr=0.1)").model
    manifest = write_artifacts(program, tmp_path)
    assert not manifest.accumulates
    handed = manifest.model("training").names("gradient", outputs=True)
    assert handed and sorted(manifest.model("optimizer").names("gradient")) == sorted(handed)
    assert "reset" not in {p.role for p in manifest.model("training").inputs}


def test_frozen_parameters_are_inputs_read_from_the_checkpoint(tmp_path):
    """generate_artifacts(frozen_params=...): each frozen parameter is a plain input of the
    models that read it (an initializer of none), a state entry and a checkpoint tensor of the
    role frozen with the forward model's value, and no model's output replaces it."""
    artifacts.generate_artifacts(
        onnx.load(DIGITS), frozen_params=["fc1.weight", "fc1.bias"], loss=artifacts.LossType.CrossEntropyLoss,
        artifact_directory=tmp_path,
    )  # fmt: skip
    manifest = Manifest.read(tmp_path)
    frozen = [s for s in manifest.state if s.role == "frozen"]
    assert [(s.name, s.shape) for s in frozen] == [("fc1.weight", (64, 64)), ("fc1.bias", (64,))]
    assert [s.name for s in manifest.state if s.role == "parameter"] == ["fc2.weight", "fc2.bias"]
    for key, entry in manifest.models.items():
        model = onnx.load(tmp_path / entry.file)
        assert not {"fc1.weight", "fc1.bias"} & {t.name for t in model.graph.initializer} or key == "inference", key
        reads = {p.state for p in entry.inputs if p.role == "state"}
        assert ({"fc1.weight", "fc1.bias"} <= reads) == (key in ("training", "eval", "train_step", "train_steps")), key
        assert not {"fc1.weight", "fc1.bias"} & {p.state for p in entry.outputs if p.role == "state"}, key
    state = graphforge.CheckpointState.load(tmp_path / "checkpoint")
    assert {s.name: s.role for s in state.specs}["fc1.bias"] == "frozen"
    forward = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(DIGITS).graph.initializer}
    assert np.array_equal(state.tensors["fc1.weight"], forward["fc1.weight"])
    with pytest.raises(GraphforgeError, match="frozen parameter 'nope' is no initializer of the program"):
        write_artifacts(graphforge.compile(DIGITS, PIPELINE).model, tmp_path / "x", frozen=["nope"])
    with pytest.raises(GraphforgeError, match=r"frozen parameter 'fc1\.bias' is trained by the program"):
        write_artifacts(graphforge.compile(DIGITS, PIPELINE).model, tmp_path / "x", frozen=["fc1.bias"])


@pytest.mark.parametrize(
    ("pipeline", "frozen"),
    [
        (PIPELINE.replace("autodiff", "autodiff(frozen=[fc1.weight])"), ["fc1.weight"]),
        ("lora(r=2, targets=[fc1]), " + PIPELINE, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]),
    ],
    ids=["autodiff", "lora"],
)
def test_write_artifacts_reads_the_programs_frozen_role(tmp_path, pipeline, frozen):
    """Without ``frozen=``, the program's frozen weights are the artifacts' frozen state, in the
    program's order, with the forward model's values; the trained ones are its parameters."""
    program = graphforge.compile(DIGITS, pipeline).model
    manifest = write_artifacts(program, tmp_path)
    assert [s.name for s in manifest.state if s.role == "frozen"] == frozen
    assert not {s.name for s in manifest.state if s.role == "parameter"} & set(frozen)
    state = graphforge.CheckpointState.load(tmp_path / "checkpoint")
    forward = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(DIGITS).graph.initializer}
    assert all(np.array_equal(state.tensors[name], forward[name]) for name in frozen)


def test_generate_artifacts_keeps_a_parameter_named_in_neither_list_a_constant(tmp_path):
    """requires_grad alone, as onnxruntime-training reads it: what it leaves out stays a constant
    of the models (the program records it frozen, the artifacts hold it as the models' own)."""
    artifacts.generate_artifacts(
        onnx.load(DIGITS), requires_grad=["fc2.weight", "fc2.bias"], loss=artifacts.LossType.CrossEntropyLoss,
        artifact_directory=tmp_path,
    )  # fmt: skip
    manifest = Manifest.read(tmp_path)
    assert [s.name for s in manifest.state if s.role in ("parameter", "frozen")] == ["fc2.weight", "fc2.bias"]
    training = onnx.load(tmp_path / manifest.models["training"].file)
    assert {"fc1.weight", "fc1.bias"} <= {t.name for t in training.graph.initializer}


def test_what_cannot_be_written_is_one_clear_error(tmp_path):
    dp = graphforge.compile(DIGITS, f"{PIPELINE}, allreduce").model
    with pytest.raises(
        GraphforgeError, match="compiled with the allreduce or zero pass: on-device artifacts train on one process"
    ):
        write_artifacts(dp, tmp_path / "dp")
    assert not (tmp_path / "dp").exists() or not any((tmp_path / "dp").iterdir())
    program = graphforge.compile(DIGITS, PIPELINE).model
    with pytest.raises(GraphforgeError, match="additional output 'nope' is no output of the program"):
        write_artifacts(program, tmp_path / "x", outputs=["nope"])
    (tmp_path / "taken").write_text("kept")
    with pytest.raises(GraphforgeError, match="taken is a file, not a folder"):
        write_artifacts(program, tmp_path / "taken")
    assert (tmp_path / "taken").read_text() == "kept"
    model = onnx.load(DIGITS)
    for keyword, message in (
        ({"ort_format": True}, "ort_format=True"),
        ({"nominal_checkpoint": True}, "nominal_checkpoint=True"),
        (
            {"requires_grad": ["fc1.weight"], "frozen_params": ["fc1.weight"]},
            "both frozen and requiring gradients: fc1.weight",
        ),
        ({"loss_input_names": ["nope"]}, "the loss reads 'nope', which is no output"),
    ):
        with pytest.raises(GraphforgeError, match=message):
            artifacts.generate_artifacts(
                model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path / "y", **keyword
            )


def test_a_damaged_or_newer_set_is_refused_naming_the_file(digits, tmp_path):
    _, folder, _manifest = digits
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    Manifest.read(copy)  # as written: every hash agrees
    damaged = bytearray((copy / "eval_model.onnx").read_bytes())
    damaged[-1] ^= 1
    (copy / "eval_model.onnx").write_bytes(bytes(damaged))
    with pytest.raises(ManifestError, match=r"eval_model.onnx: its sha256 is .* the manifest's"):
        Manifest.read(copy)
    (copy / "eval_model.onnx").write_bytes((folder / "eval_model.onnx").read_bytes())
    checkpoint = bytearray((copy / "checkpoint").read_bytes())
    checkpoint[-1] ^= 1  # the last byte of the tensor stored last: its CRC-32 names it
    (copy / "checkpoint").write_bytes(bytes(checkpoint))
    with pytest.raises(ManifestError, match=r"checkpoint: tensor '.+' is damaged: its bytes do not match the checksum"):
        Manifest.read(copy)
    checkpoint[-1] ^= 1
    stepped = bytes(checkpoint).replace(b'\\"step\\": 0', b'\\"step\\": 7', 1)  # every tensor whole, another state
    assert stepped != bytes(checkpoint)
    (copy / "checkpoint").write_bytes(stepped)
    with pytest.raises(ManifestError, match=r"checkpoint: its sha256 is .* the manifest's"):
        Manifest.read(copy)
    document = json.loads((copy / MANIFEST).read_text())
    document["version"] = 3
    (copy / MANIFEST).write_text(json.dumps(document))
    with pytest.raises(ManifestError, match="manifest version 3 is newer than this graphforge reads"):
        Manifest.read(copy)


def test_the_command_writes_them_from_a_pipeline_and_from_a_trained_run(tmp_path):
    """graphforge artifacts MODEL -p PIPELINE (the optimizer made to accumulate), and from
    graphforge train's program and checkpoint (the trained values in the checkpoint)."""
    pipeline = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, weight_decay=0.01)"
    done = subprocess.run([str(GRAPHFORGE), "artifacts", str(DIGITS), "-p", pipeline, "-o", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "adamw(lr=1e-2, weight_decay=0.01, accumulate=true)" in done.stdout
    assert Manifest.read(tmp_path / "a").accumulates
    run = graphforge.train.run(REPO / "examples" / "digits" / "train.toml", steps=40, out=tmp_path / "run", quiet=True)
    done = subprocess.run([str(GRAPHFORGE), "artifacts", str(run.program), "--checkpoint", str(tmp_path / "run"),
                           "-o", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    trained = graphforge.CheckpointState.load(run.checkpoint).tensors
    written = graphforge.CheckpointState.load(tmp_path / "b" / "checkpoint")
    assert written.step == 40 and all(np.array_equal(written.tensors[n], v) for n, v in trained.items())
    for argv, message in (
        ([str(DIGITS), "-o", str(tmp_path / "c")], "is a forward model: give it a pipeline (-p, e.g."),
        ([str(run.program), "-p", pipeline, "-o", str(tmp_path / "c")], "is a training program already"),
    ):
        done = subprocess.run([str(GRAPHFORGE), "artifacts", *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
        assert not (tmp_path / "c").exists()


def test_the_pages_frozen_backbone_keeps_it_a_constant_of_the_models_and_trains_alike(tmp_path):
    """docs/on-device/training.md's --freeze/--frozen-constants command: fc1 is a constant of every
    model (no input, state entry or checkpoint tensor); 3 steps of its artifacts, run as onnxruntime's
    on-device API runs them, equal those of the artifacts that read fc1 from the checkpoint (held to
    a Module's step above) within the rounding of onnxruntime's prepacked constants."""
    from graphforge.ondevice import CheckpointState, Module, Optimizer

    block = page_block("docs/on-device/training.md", "sh", "--frozen-constants")
    argv = shlex.split(block.replace("\\\n", " ").split("#", 1)[0])
    assert argv[:2] == [".venv/bin/graphforge", "artifacts"] and "out/frozen" in argv, argv
    argv = [str(GRAPHFORGE), *[str(tmp_path / "constants") if a == "out/frozen" else a for a in argv[1:]]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    pipeline = argv[argv.index("-p") + 1]
    artifacts.artifacts_from(DIGITS, tmp_path / "inputs", pipeline=pipeline, freeze=["fc1.*"])
    frozen = {"fc1.weight", "fc1.bias"}
    constants = Manifest.read(tmp_path / "constants")
    assert [s.name for s in constants.state if s.role in ("parameter", "frozen")] == ["fc2.weight", "fc2.bias"]
    inputs = Manifest.read(tmp_path / "inputs")
    assert [s.name for s in inputs.state if s.role == "frozen"] == ["fc1.weight", "fc1.bias"]
    for key, entry in constants.models.items():
        model = onnx.load(tmp_path / "constants" / entry.file)
        assert frozen <= {t.name for t in model.graph.initializer} or key == "optimizer", key
        assert not frozen & {i.name for i in model.graph.input}, key
    losses = {}
    for side in ("constants", "inputs"):
        folder = tmp_path / side
        state = CheckpointState.load_checkpoint(folder / "checkpoint")
        module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
        optimizer = Optimizer(folder / "optimizer_model.onnx", module)
        losses[side] = []
        for i in range(3):
            losses[side].append(float(module(*_batch(i))[0]))
            optimizer.step()
            module.lazy_reset_grad()
    np.testing.assert_allclose(losses["constants"], losses["inputs"], rtol=1e-5)
    with pytest.raises(GraphforgeError, match=r"training program already: give it no weights to freeze \(--freeze\)"):
        program = tmp_path / "program.onnx"
        graphforge.save(graphforge.compile(DIGITS, PIPELINE).model, program)
        artifacts.artifacts_from(program, tmp_path / "x", freeze=["fc1.*"])
