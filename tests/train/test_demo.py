"""The digits demo (``make demo``), the Training page and the training API guide, and the
README's example, run as written."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import _train_helpers as th
import numpy as np
import pytest
from _pages import page_block, page_text

import graphforge.train
from graphforge.train.config import Config, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = th.REPO
DIGITS = REPO / "examples/digits"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"digits_{name}", DIGITS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAINING = "docs/getting-started/training.md"
TRAINING_API = "docs/guides/training-api.md"


@pytest.fixture
def workspace(tmp_path):
    """A fresh folder that looks like a checkout to the pages' relative paths."""
    for name in ("examples", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(th.GRAPHFORGE.parent.parent)
    return tmp_path


def test_the_shipped_model_is_what_the_build_script_writes():
    assert _script("build_model").build().SerializeToString() == (DIGITS / "model.onnx").read_bytes()


def test_the_stated_accuracy_agrees_everywhere():
    threshold = _script("evaluate").MIN_ACCURACY
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^DEMO_MIN_ACCURACY := (\S+)$", makefile, re.MULTILINE).group(1) == str(threshold)
    demo_line = next(line for line in page_text("README.md").splitlines() if line.startswith("make demo"))
    assert f"fails below {threshold}" in demo_line


def test_the_pages_config_block_is_the_demo_config():
    block = page_block(TRAINING, "toml", "[model]", "digits/train.npz")
    shown = Config.from_dict(tomllib.loads(block), base=DIGITS)
    shipped = load_config(DIGITS / "train.toml")
    for section in ("model", "data", "train", "schedule", "eval", "checkpoint", "log", "profile", "out"):
        assert getattr(shown, section) == getattr(shipped, section), section


def test_the_pages_training_commands_reach_the_stated_accuracy(workspace):
    """The demo's config, through the CLI as the Training page runs it: train, export, evaluate."""
    block = page_block(TRAINING, "sh", "graphforge train")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=workspace,
        env=th.env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    score = float(re.search(r"test accuracy (\S+) on 360 images", proc.stdout).group(1))
    assert score >= _script("evaluate").MIN_ACCURACY
    eval_accuracy = float(re.findall(r"accuracy (\d\.\d+) in ", proc.stdout)[-1])
    assert eval_accuracy == pytest.approx(score, abs=1e-4)  # the exported model scores as training evaluated it
    assert (workspace / "out/digits/model.onnx").is_file()
    # the page's last lines of the run: the done line, then the checkpoint saved at the end
    lines = proc.stdout.splitlines()
    done = next(i for i, line in enumerate(lines) if line.startswith("done "))
    assert re.fullmatch(
        r"done +step 675, last batch loss [\d.]+, eval loss [\d.]+, accuracy [\d.]+ in [\d.]+ s", lines[done]
    )
    assert lines[done + 1] == "saved    out/digits/checkpoints/checkpoint-00000675.safetensors"

    # the on-device page's artifacts commands: from the forward model (the optimizer made to
    # accumulate), then from this run (whose program does not accumulate, as the page says)
    artifacts = page_block("docs/on-device/training.md", "sh", "graphforge artifacts", "out/trained")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", artifacts], cwd=workspace, env=th.env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    notes = re.findall(
        r"the training model (accumulates gradients until lazyResetGrad|does not accumulate)", proc.stdout
    )
    assert notes == ["accumulates gradients until lazyResetGrad", "does not accumulate"], proc.stdout
    for folder in ("out/artifacts", "out/trained"):
        assert (workspace / folder / "manifest.json").is_file()


def test_the_pages_python_block_runs(workspace, monkeypatch):
    block = page_block(TRAINING, "python", "graphforge.train.run(")
    monkeypatch.chdir(workspace)
    namespace: dict = {}
    exec(compile(block, TRAINING, "exec", dont_inherit=True), namespace)
    result = namespace["result"]
    assert result.step == 675 and result.eval["eval_accuracy"] >= _script("evaluate").MIN_ACCURACY
    assert (workspace / namespace["report"].path) == workspace / "out/digits-api/model.onnx"
    assert (workspace / "out/digits-api/model.onnx").is_file()
    assert isinstance(result, graphforge.train.TrainResult)


def test_the_training_api_guides_block_runs_and_learns(workspace, monkeypatch, capsys):
    block = page_block(TRAINING_API, "python", "Module(", "Optimizer(")
    monkeypatch.chdir(workspace)
    namespace: dict = {}
    exec(compile(block, TRAINING_API, "exec", dont_inherit=True), namespace)
    printed = capsys.readouterr().out
    loss = float(re.search(r"loss (\S+) after 100 steps", printed).group(1))
    assert loss < 0.5  # from ln(10) ≈ 2.3 at the start
    state, module = namespace["state"], namespace["module"]
    assert state.step == 100
    # the exported model computes what the module computes in eval mode
    images = np.load(workspace / "data/digits/test.npz")["images"][:64]
    exported = graphforge.create_session(str(workspace / "out/model.onnx"), providers=["CPUExecutionProvider"])
    logits = exported.run(["logits"], {"images": images})[0]
    module.eval()
    _, expected = module(images, np.zeros(64, np.int64), outputs=["logits"])
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)
    assert (workspace / "out/step100.safetensors").is_file()


def test_the_readmes_example_trains_a_model_that_scores_on_the_test_split(workspace, monkeypatch, capsys):
    """README.md's Python example, as written; its exported model scored by a plain onnxruntime session."""
    block = page_block("README.md", "python", "graphforge.Module(")
    monkeypatch.chdir(workspace)
    exec(compile(block, "README.md", "exec", dont_inherit=True), {})
    loss = float(re.fullmatch(r"loss (\S+) after 300 steps\n", capsys.readouterr().out).group(1))
    assert loss < 0.5  # from ln(10) ≈ 2.3 at the start
    test = np.load(workspace / "data/digits/test.npz")
    session = graphforge.create_session(str(workspace / "out/digits.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"images": test["images"]})
    assert (logits.argmax(1) == test["labels"]).mean() >= _script("evaluate").MIN_ACCURACY
