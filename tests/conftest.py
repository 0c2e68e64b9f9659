"""Shared fixtures: models exported from PyTorch once per session, and small hand-written ones.

Session-scoped model files are shared by every test: read them, never write beside them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import models  # tests/models.py: the builders behind these fixtures
import pytest

REPO = Path(__file__).resolve().parent.parent

#: the modules that take longest (seconds of their tests, 2 workers on 2 cores with other work
#: running, measured with ``pytest -n 2 --dist loadscope --durations=0`` and summed by module;
#: 2026-12-02): make test's workers take whole modules in collection order
#: (--no-loadscope-reorder), so these go first, longest first, and the last module a worker takes
#: is a short one, not a 3-minute one that runs alone at the end
LONGEST = {
    "distributed/test_tensor_parallel_members.py": 335,
    "test_cli.py": 212,
    "passes/autodiff/test_backend_conformance.py": 190,
    "distributed/test_distributed_pages.py": 150,
    "distributed/test_train_distributed.py": 122,
    "distributed/test_train_tensor.py": 110,
    "diff/test_diff_cli.py": 88,
    "train/test_text_training.py": 84,
    "distributed/test_stages.py": 84,
    "passes/test_tensor_parallel.py": 78,
    "passes/test_recompute.py": 74,
    "train/test_demo.py": 73,
    "planning/test_plan.py": 61,
    "analysis/test_memory.py": 60,
    "distributed/test_train_zero.py": 52,
    "distributed/test_zero.py": 48,
    "ondevice/test_js_runtime.py": 44,
    "distributed/test_data_parallel.py": 40,
    "distributed/test_train_pipeline.py": 34,
    "distributed/test_train_options.py": 33,
    "train/test_stop_and_resume_checks.py": 31,
    "test_graph_io.py": 31,
}


def pytest_collection_modifyitems(items) -> None:
    """The longest modules first (LONGEST), the others after them in their own order."""
    tests = REPO / "tests"

    def weight(item) -> int:
        path = Path(str(item.fspath))
        return -LONGEST.get(path.relative_to(tests).as_posix(), 0) if path.is_relative_to(tests) else 0

    items.sort(key=weight)  # (stable: each module's tests keep their order)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def mlp_path(tmp_path_factory) -> Path:
    """A torch 16-32-32-4 ReLU MLP exported with TorchScript (input x [batch, 16], output y)."""
    pytest.importorskip("torch")
    return models.export_mlp(tmp_path_factory.mktemp("mlp") / "mlp.onnx")


@pytest.fixture(scope="session")
def transformer_path(tmp_path_factory) -> Path:
    """A 1-layer GPT-2 (random weights) exported with dynamic batch and sequence axes."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return models.export_transformer(tmp_path_factory.mktemp("gpt2") / "gpt2.onnx")


@pytest.fixture(scope="session")
def external_data_path(tmp_path_factory) -> Path:
    """``model.onnx`` whose weights live in ``model.onnx.data`` beside it."""
    return models.external_data_model(tmp_path_factory.mktemp("external"))
