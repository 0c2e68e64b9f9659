"""docs/guides/lora.md as a reader runs it: every block in order, in a fresh folder holding the
shipped fables (Python blocks in this process, the venv's python, commands through bash with the venv's
bin first on PATH, the TOML saved as train.toml); each exits 0, the page's own PEFT comparison
holds, and the merged model is not the base model again (the adapters trained and were merged)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import models
import numpy as np
import pytest
from _pages import REPO, page_block
from _tracebacks import assert_no_traceback

PAGE = "docs/guides/lora.md"


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRAPHFORGE_PROVIDERS": "cpu", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args[-1][:80]!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert_no_traceback(done.stdout + done.stderr)
    return done


def _python(block: str, cwd: Path, monkeypatch, capsys) -> str:
    """``block`` run in this process (the venv's python, torch already imported), from ``cwd``;
    what it printed."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's tracer warnings
        exec(compile(block, PAGE, "exec", dont_inherit=True), {"__name__": "__main__"})
    return capsys.readouterr().out


def _sh(block: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run(["bash", "-euo", "pipefail", "-c", block], cwd)


@pytest.mark.slow
def test_the_lora_page_runs_top_to_bottom(tmp_path, monkeypatch, capsys):
    shutil.copy(REPO / "data" / "text" / "fables.jsonl", tmp_path)
    _python(page_block(PAGE, "python", "class Logits(LlamaForCausalLM)"), tmp_path, monkeypatch, capsys)
    (tmp_path / "train.toml").write_text(page_block(PAGE, "toml", "lora(r=8, alpha=16"))
    trained = _sh(page_block(PAGE, "sh", "graphforge train train.toml --out run"), tmp_path)
    assert "10 steps" in trained.stdout and "fables.jsonl" in trained.stdout
    _sh(page_block(PAGE, "sh", "--adapters peft -o adapter"), tmp_path)
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    compared = _python(page_block(PAGE, "python", "PeftModel.from_pretrained"), tmp_path, monkeypatch, capsys)
    assert "merged.onnx gives PEFT's logits" in compared
    generated = _sh(page_block(PAGE, "sh", "graphforge generate merged.onnx"), tmp_path)
    assert generated.stdout.strip()

    # the merged model is the base model plus trained adapters, not the base model again
    ids = np.random.default_rng(0).integers(0, 400, (2, 12))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    merged = models.run(tmp_path / "merged.onnx", feeds)["logits"]
    base = models.run(tmp_path / "model.onnx", feeds)["logits"]
    assert merged.shape == base.shape == (2, 12, 400)
    assert np.abs(merged - base).max() > 1e-3
