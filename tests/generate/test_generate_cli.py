"""`graphforge generate` as a reader runs it: the language-models page's command and Python
block, in a folder holding a model and its tokenizer files, give the text the Python API gives;
a refusal is one line and exit status 2, with no traceback."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _pages import page_block
from _tracebacks import assert_no_traceback

from graphforge.generate import Generator

PAGE = "docs/guides/language-models.md"


@pytest.fixture(scope="module")
def folder(tmp_path_factory, gpt2_cache, tokenizer_file) -> Path:
    """model.onnx (the tiny GPT-2 with cache inputs) and its tokenizer files, and .venv."""
    workspace = tmp_path_factory.mktemp("language-models")
    (workspace / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (workspace / "model.onnx").symlink_to(gpt2_cache)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_file.parent / name, workspace / name)
    return workspace


def _run(command: list[str] | str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRAPHFORGE_PROVIDERS": "cpu"}
    env.pop("PYTHONPATH", None)
    args = ["bash", "-euo", "pipefail", "-c", command] if isinstance(command, str) else command
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_pages_command_prints_the_text_the_api_gives(folder):
    block = page_block(PAGE, "sh", "graphforge generate model.onnx")
    done = _run(block, folder)
    assert done.returncode == 0, done.stderr
    assert_no_traceback(done.stdout + done.stderr)
    generator = Generator(folder / "model.onnx", folder / "tokenizer.json", device="cpu")
    expected = generator.generate("The fox and the crow", max_new_tokens=16, temperature=0.8, top_p=0.9, seed=0,
                                  stop=["crow."])  # fmt: skip
    assert done.stdout == expected.text + "\n"
    assert done.stderr == ""  # a model with cache inputs: no note


def test_the_pages_python_block_runs(folder, monkeypatch):
    monkeypatch.chdir(folder)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(page_block(PAGE, "python", "from graphforge.generate import Generator"), {})
    generator = Generator(folder / "model.onnx", folder / "tokenizer.json", device="cpu")
    greedy = generator.generate("The fox and the crow", max_new_tokens=16)
    sampled = generator.generate("The fox and the crow", max_new_tokens=16, top_k=20, seed=1)
    lines = printed.getvalue().split("\n")
    assert lines[0] == f"{greedy.text} {greedy.ids} {greedy.stop_reason}"
    assert lines[1] == sampled.text


def test_a_refusal_is_one_line_and_exit_2(folder, gpt2_plain, monkeypatch, capsys):
    """With --no-cache, a plain model's note on stderr, then the refusal of a prompt past its
    48 positions (run in this process: the page's command above is the real process)."""
    from graphforge.cli import main

    monkeypatch.chdir(folder)
    prompt = "The fox and the crow. " * 10
    monkeypatch.setattr(sys, "argv", ["graphforge", "generate", str(gpt2_plain), "--tokenizer", "tokenizer.json",
                                      "--prompt", prompt, "--device", "cpu", "--no-cache"])  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    done = capsys.readouterr()
    assert_no_traceback(done.out + done.err)
    lines = done.err.splitlines()
    assert lines[0] == f"note: no KV cache in {gpt2_plain}: recomputing the prefix each token (cache off)"
    assert len(lines) == 2 and lines[1].startswith("error: the prompt is ")
    assert "longer than the 48 positions" in lines[1]
    assert done.out == ""
