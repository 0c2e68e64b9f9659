"""Whole models against torch autograd: export with TorchScript, compile
``loss(kind=cross_entropy, output=logits), autodiff`` once, and compare the loss and every
parameter's gradient with torch's at several batch sizes and sequence lengths, all with
the one compiled graph (its batch and sequence dims stay symbolic)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch_models  # noqa: E402  (needs torch)

import graphforge  # noqa: E402
from graphforge import roles  # noqa: E402

PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff"
RTOL, ATOL = 1e-4, 1e-5
#: (batch, sequence) sizes, none equal to the export example's (2, 8)
SIZES = list(itertools.product((1, 3), (5, 12)))


@dataclass
class Compiled:
    module: torch.nn.Module
    exported: onnx.ModelProto
    model: onnx.ModelProto
    session: object
    input_name: str
    uses: dict[str, list[torch_models.Use]]  # torch parameter -> initializers holding it
    gradients: dict[str, str]  # initializer -> its gradient output

    def run(self, inputs: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
        names = ["loss", *self.gradients.values()]
        values = self.session.run(names, {self.input_name: inputs, "labels": labels})
        return dict(zip(names, values, strict=True))


def _compile(tmp_path_factory, name: str, module, example, input_name: str, dynamic: dict) -> Compiled:
    path = torch_models.export(module, example, tmp_path_factory.mktemp(name) / f"{name}.onnx", input_name, dynamic)
    exported = onnx.load(str(path))
    model = graphforge.compile(path, PIPELINE).model
    metadata = {p.key: p.value for p in model.metadata_props}
    return Compiled(
        module=module,
        exported=exported,
        model=model,
        session=graphforge.create_session(model, providers=["CPUExecutionProvider"]),
        input_name=input_name,
        uses=torch_models.parameter_uses(exported, module),
        gradients=json.loads(metadata[roles.GRADIENTS]),
    )


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Compiled:
    module = torch_models.mlp()
    example = torch.randn(2, torch_models.MLP_SIZES[0], generator=torch.Generator().manual_seed(0))
    dynamic = {"x": {0: "batch"}, "logits": {0: "batch"}}
    return _compile(tmp_path_factory, "mlp", module, example, "x", dynamic)


def _language_model(tmp_path_factory, name: str, module, vocab: int) -> Compiled:
    example = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    dynamic = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 2: "seq"}}
    return _compile(tmp_path_factory, name, module, example, "input_ids", dynamic)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Compiled:
    return _language_model(tmp_path_factory, "gpt2", torch_models.gpt2(), torch_models.GPT2_CONFIG["vocab_size"])


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Compiled:
    return _language_model(tmp_path_factory, "bert", torch_models.bert(), torch_models.BERT_CONFIG["vocab_size"])


@pytest.fixture(scope="module", params=["lstm", "gru", "rnn_tanh", "rnn_relu"])
def recurrent(tmp_path_factory, request) -> Compiled:
    module = torch_models.recurrent(request.param)
    example = torch.randn(2, 8, torch_models.RECURRENT_SIZES["features"], generator=torch.Generator().manual_seed(0))
    dynamic = {"x": {0: "batch", 1: "seq"}, "logits": {0: "batch"}}
    return _compile(tmp_path_factory, request.param, module, example, "x", dynamic)


def assert_matches_torch(compiled: Compiled, inputs: np.ndarray, labels: np.ndarray) -> None:
    """Loss and every parameter gradient equal torch autograd's. A torch parameter held by
    several initializers (or read in several places) gets the sum of their gradients."""
    module = compiled.module
    module.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(inputs)), torch.from_numpy(labels))
    loss.backward()
    got = compiled.run(inputs, labels)
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5, atol=1e-6, err_msg="loss")
    checked = 0
    for name, param in module.named_parameters():
        parts = [_gradient(compiled, got, use) for use in compiled.uses[name]]
        parts = [p for p in parts if p is not None]
        if param.grad is None:  # the forward pass never reads it: no gradient either side
            assert not parts, f"{name}: torch has no gradient, the compiled model does"
            continue
        assert parts, f"{name}: the compiled model has no gradient for it"
        np.testing.assert_allclose(sum(parts), param.grad.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)
        checked += 1
    assert checked == sum(1 for p in module.parameters() if p.grad is not None)


def _gradient(compiled: Compiled, got: dict, use: torch_models.Use) -> np.ndarray | None:
    output = compiled.gradients.get(use.initializer)
    if output is None:
        return None
    return got[output].T if use.transposed else got[output]


def _tokens(batch: int, seq: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (batch, seq)), rng.integers(0, vocab, (batch, seq))


# --------------------------------------------------------------------------- the models


@pytest.mark.parametrize("batch", [1, 7])
def test_mlp_gradients_match_torch(mlp, batch):
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, torch_models.MLP_SIZES[0])).astype(np.float32)
    labels = rng.integers(0, torch_models.MLP_SIZES[-1], batch)
    assert_matches_torch(mlp, x, labels)


@pytest.mark.parametrize(("batch", "seq"), SIZES)
def test_gpt2_gradients_match_torch(gpt2, batch, seq):
    assert_matches_torch(gpt2, *_tokens(batch, seq, torch_models.GPT2_CONFIG["vocab_size"], seed=batch * 100 + seq))


@pytest.mark.parametrize(("batch", "seq"), SIZES)
def test_bert_gradients_match_torch(bert, batch, seq):
    assert_matches_torch(bert, *_tokens(batch, seq, torch_models.BERT_CONFIG["vocab_size"], seed=batch * 100 + seq))


@pytest.mark.parametrize(("batch", "seq"), SIZES)
def test_recurrent_gradients_match_torch(recurrent, batch, seq):
    # torch.nn.LSTM/GRU/RNN export to the ONNX LSTM/GRU/RNN ops, differentiated by rules/recurrent.py
    ops = {n.op_type for n in recurrent.exported.graph.node}
    assert ops & {"LSTM", "GRU", "RNN"}, ops
    rng = np.random.default_rng(batch * 100 + seq)
    x = rng.standard_normal((batch, seq, torch_models.RECURRENT_SIZES["features"])).astype(np.float32)
    assert_matches_torch(recurrent, x, rng.integers(0, torch_models.RECURRENT_SIZES["classes"], batch))


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", ["mlp", "gpt2", "bert"])
def test_compiled_models_use_standard_ops_and_keep_dims_symbolic(name, request):
    compiled = request.getfixturevalue(name)
    assert {n.domain for n in compiled.model.graph.node} <= {"", "ai.onnx"}
    inputs = {i.name: i for i in compiled.model.graph.input}
    dims = inputs[compiled.input_name].type.tensor_type.shape.dim
    assert dims[0].dim_param, "the batch dim was baked into a number"
    if name != "mlp":
        assert dims[1].dim_param, "the sequence dim was baked into a number"


def test_gpt2_tied_embedding_is_one_parameter_read_twice(gpt2):
    # lm_head.weight is wte.weight: one torch parameter, one initializer, two readers
    # (the token embedding Gather and the output projection), so its gradient is a sum
    wte = gpt2.module.inner.transformer.wte.weight
    assert gpt2.module.inner.lm_head.weight is wte
    (use,) = gpt2.uses["inner.transformer.wte.weight"]
    readers = [n for n in gpt2.exported.graph.node if use.initializer in n.input]
    assert len(readers) >= 2, [n.op_type for n in readers]
