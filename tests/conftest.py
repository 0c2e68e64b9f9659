"""Shared fixtures: models exported from PyTorch once per session, and small hand-written ones.

Session-scoped model files are shared by every test: read them, never write beside them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import models  # tests/models.py: the builders behind these fixtures
import pytest

REPO = Path(__file__).resolve().parent.parent


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
