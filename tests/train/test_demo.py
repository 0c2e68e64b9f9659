"""The digits demo (``make demo``) and the README's Training section, run as written."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import _train_helpers as th
import numpy as np
import pytest

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


def _readme_blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


@pytest.fixture
def workspace(tmp_path):
    """A fresh folder that looks like a checkout to the README's relative paths."""
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
    demo_line = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("make demo"))
    assert f"fails below {threshold}" in demo_line


def test_readme_config_block_is_the_demo_config():
    (block,) = _readme_blocks("toml")
    shown = Config.from_dict(tomllib.loads(block), base=DIGITS)
    shipped = load_config(DIGITS / "train.toml")
    for section in ("model", "data", "train", "schedule", "eval", "checkpoint", "log", "profile", "out"):
        assert getattr(shown, section) == getattr(shipped, section), section


def test_readme_training_commands_reach_the_stated_accuracy(workspace):
    """The demo's config, through the CLI as the README runs it: train, export, evaluate."""
    (block,) = [b for b in _readme_blocks("sh") if "graphforge train" in b and "torchrun" not in b]
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


def test_readme_python_block_runs(workspace, monkeypatch):
    (block,) = [b for b in _readme_blocks("python") if "graphforge.train.run(" in b]
    monkeypatch.chdir(workspace)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec", dont_inherit=True), namespace)
    result = namespace["result"]
    assert result.step == 675 and result.eval["eval_accuracy"] >= _script("evaluate").MIN_ACCURACY
    assert (workspace / namespace["report"].path) == workspace / "out/digits-api/model.onnx"
    assert (workspace / "out/digits-api/model.onnx").is_file()
    assert isinstance(result, graphforge.train.TrainResult)


def test_readme_training_api_block_runs_and_learns(workspace, monkeypatch, capsys):
    (block,) = [b for b in _readme_blocks("python") if "Module(" in b and "Optimizer(" in b]
    monkeypatch.chdir(workspace)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec", dont_inherit=True), namespace)
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
