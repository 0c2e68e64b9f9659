"""Fixtures for the golden tests: copies of shipped golden models to damage, and the CLI run in-process."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from graphforge import cli

GOLDEN = Path(__file__).resolve().parents[2] / "golden_models"


@pytest.fixture
def golden_copy(tmp_path):
    """``golden_copy("demo_mlp", ...)``: a fresh golden folder holding copies of those models."""

    def make(*names: str) -> Path:
        folder = tmp_path / "golden"
        folder.mkdir(exist_ok=True)
        for name in names:
            shutil.copytree(GOLDEN / name, folder / name)
        return folder

    return make


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """``run_cli("golden", "check", DIR)``: graphforge.cli.main in this process (monkeypatches apply)."""

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["graphforge", *map(str, args)])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        captured = capsys.readouterr()
        return CliResult(exit_info.value.code, captured.out, captured.err)

    return run
