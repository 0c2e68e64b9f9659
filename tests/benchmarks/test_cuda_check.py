"""The GPU check (benchmarks/cuda_check.py, ``make cuda-check``) where it runs in CI: without a
GPU it says so plainly and exits 0 with a report saying so; its pieces (the import folder, a
stage that fails or hangs, the report) behave as the GPU session that runs it will need."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cuda_check():
    spec = importlib.util.spec_from_file_location("cuda_check", REPO / "benchmarks" / "cuda_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    """As `make cuda-check` runs it: the plain python3, a PATH with no nvidia-smi."""
    done = subprocess.run(
        ["make", "--no-print-directory", "cuda-check", f"OUT={tmp_path}", f"PYTHON={sys.executable}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "cuda-check: all: skipped (0 s) no GPU: nothing to check" in done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and report["device"].startswith("none: no NVIDIA GPU here")
    assert "no GPU: nothing to check" in (tmp_path / "report.md").read_text()


def test_the_import_folder_lays_the_checkout_out_as_the_installed_package(cuda_check, tmp_path):
    """The GPU image has no graphforge installed: passes/ must import as graphforge.passes."""
    root = cuda_check.import_folder(tmp_path)
    package = importlib.machinery.PathFinder.find_spec("graphforge", [str(root)])
    assert package is not None and Path(package.origin).resolve() == REPO / "graphforge" / "__init__.py"
    passes = importlib.machinery.PathFinder.find_spec("graphforge.passes", [str(root / "graphforge")])
    assert passes is not None and Path(passes.origin).resolve() == REPO / "passes" / "__init__.py"
    assert not (root / "graphforge" / "__pycache__").exists()
    assert cuda_check.import_folder(tmp_path) == root  # made again from scratch: no stale links


def test_a_stage_that_fails_or_hangs_is_reported_and_the_report_says_why(cuda_check, tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    failed = cuda_check.run_stage("tests", [sys.executable, "-c", "print('1 failed, 3 passed'); raise SystemExit(1)"],
                                  env, 30)  # fmt: skip
    assert (failed.status, failed.detail) == ("failed", "1 failed, 3 passed")
    hung = cuda_check.run_stage("benchmark", [sys.executable, "-c", "import time; time.sleep(30)"], env, 1)
    assert hung.status == "timed out" and hung.detail == "stopped after 1 s"
    passed = cuda_check.run_stage("environment", [sys.executable, "-c", "print('ok')"], env, 30)
    report = cuda_check.Report("now", {"python": "3"}, "a GPU", [passed, failed, hung])
    assert not report.ok
    text = report.markdown()
    assert "| tests | failed |" in text and "| benchmark | timed out |" in text
    assert "## tests: the end of its output" in text and "## environment: the end" not in text


def test_the_cuda_tests_it_runs_exist(cuda_check):
    missing = [t for t in cuda_check.CUDA_TESTS if not (REPO / t).is_file()]
    assert not missing
