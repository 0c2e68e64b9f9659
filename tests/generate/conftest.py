"""The generation tests' models and tokenizer, made once per session (read them, never write
beside them): the tiny GPT-2 and Llama, each as the repository's builders export it and with
cache inputs (_generate_helpers.py)."""

from __future__ import annotations

import _generate_helpers as helpers
import pytest


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory):
    pytest.importorskip("tokenizers")
    return helpers.tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _exported(tmp_path_factory, kind: str, cache: bool):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp(f"{kind}_{'cache' if cache else 'plain'}")
    export = helpers.export_with_cache if cache else helpers.export_plain
    return export(kind, folder / "model.onnx")


@pytest.fixture(scope="session")
def gpt2_plain(tmp_path_factory):
    return _exported(tmp_path_factory, "gpt2", cache=False)


@pytest.fixture(scope="session")
def gpt2_cache(tmp_path_factory):
    return _exported(tmp_path_factory, "gpt2", cache=True)


@pytest.fixture(scope="session")
def llama_plain(tmp_path_factory):
    return _exported(tmp_path_factory, "llama", cache=False)


@pytest.fixture(scope="session")
def llama_cache(tmp_path_factory):
    return _exported(tmp_path_factory, "llama", cache=True)
