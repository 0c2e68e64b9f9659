"""Whole models exported by torch's dynamo exporter (``torch.onnx.export(..., dynamo=True,
optimize=False)``), against torch autograd: GPT-2 at opset 18 (torch.split arrives as
SplitToSequence/SequenceAt, shapes as computed constants) and a small Llama at opset 23
(scaled_dot_product_attention arrives as the Attention op). One compiled graph, two batch
sizes and sequence lengths. The parameters are passed as an explicit trainable= list of the
initializers holding torch's parameters (which exporter constants are trainable by default
is the autodiff pass's own business, tested elsewhere)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # dynamo exports take seconds each
pytest.importorskip("transformers")

import models  # noqa: E402
import torch_models  # noqa: E402
from graphforge.passes import Autodiff, Loss  # noqa: E402

import graphforge  # noqa: E402
from graphforge import roles  # noqa: E402

#: (batch, sequence) sizes, none equal to the export example's (2, 8)
SIZES = [(1, 5), (3, 12)]
VOCAB = 128


def _export_and_compile(module, path, opset: int):
    models.export_dynamo(module, path, opset, vocab=VOCAB)
    exported = onnx.load(str(path))
    uses = torch_models.parameter_uses(exported, module)
    trainable = tuple(u.initializer for held in uses.values() for u in held)
    program = graphforge.compile(
        str(path), [Loss(kind="cross_entropy", output="logits"), Autodiff(trainable=trainable)]
    )
    return exported, uses, program.model


@pytest.fixture(scope="module", params=[("gpt2", 18), ("llama", 23)], ids=["gpt2-opset18", "llama-opset23"])
def compiled(request, tmp_path_factory):
    name, opset = request.param
    module = torch_models.gpt2() if name == "gpt2" else models.llama_module()
    exported, uses, program = _export_and_compile(module, tmp_path_factory.mktemp(name) / f"{name}.onnx", opset)
    return name, module, exported, uses, program


def test_the_exports_hold_what_the_dynamo_exporter_writes(compiled):
    name, _, exported, _, program = compiled
    ops = {n.op_type for n in exported.graph.node}
    assert ("SequenceAt" in ops) if name == "gpt2" else ("Attention" in ops)
    assert {n.domain for n in program.graph.node} <= {"", "ai.onnx"}
    dims = next(i for i in program.graph.input if i.name == "input_ids").type.tensor_type.shape.dim
    assert dims[0].dim_param and dims[1].dim_param  # batch and sequence stay symbolic


def test_at_fixed_dims_no_node_of_the_step_stays_on_the_host(compiled):
    """Specialized to a batch's dims (as the runner makes its sessions), the step computes no
    shape on the host: RMSNorm's mean and rotary's slices take their gradients' sizes from
    Size nodes, which fold as Shape does (a Llama export kept 18 Range nodes over them)."""
    from graphforge.passes.specialize import input_dims

    from graphforge.inspection.host_syncs import session_syncs

    *_, program = compiled
    with_optimizer = graphforge.compile(program, "adamw(lr=1e-3)").model
    batch, seq = next(i for i in program.graph.input if i.name == "input_ids").type.tensor_type.shape.dim
    dims = {batch.dim_param: 3, seq.dim_param: 7}
    assert set(dims) == input_dims(program)
    for session in session_syncs(with_optimizer, dims):
        assert session.syncs == [], (session.label, [s.describe() for s in session.syncs[:5]])


@pytest.mark.parametrize(("batch", "seq"), SIZES)
def test_gradients_match_torch(compiled, batch, seq):
    _, module, _, uses, program = compiled
    grads = json.loads({p.key: p.value for p in program.metadata_props}[roles.GRADIENTS])
    rng = np.random.default_rng(batch * 100 + seq)
    ids, labels = rng.integers(0, VOCAB, (batch, seq)), rng.integers(0, VOCAB, (batch, seq))
    session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
    names = ["loss", *grads.values()]
    got = dict(zip(names, session.run(names, {"input_ids": ids, "labels": labels}), strict=True))
    module.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(ids)), torch.from_numpy(labels))
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5, atol=1e-6)
    for name, param in module.named_parameters():
        parts = [got[grads[u.initializer]].T if u.transposed else got[grads[u.initializer]] for u in uses[name]]
        assert parts, f"{name}: no gradient"
        np.testing.assert_allclose(sum(parts), param.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


class NormAttention(torch.nn.Module):
    """F.rms_norm and scaled_dot_product_attention: RMSNormalization and Attention at opset 23."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.nn.functional.rms_norm(x, (8,), weight=self.w)
        q = self.q(h).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_rms_norm_and_attention_ops_match_torch(tmp_path):
    module, path = NormAttention(), tmp_path / "norm_attention.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 5, 8),), str(path), dynamo=True, optimize=False, opset_version=23,
                          input_names=["x"], output_names=["y"], external_data=False, verbose=False,
                          dynamic_shapes=({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},))  # fmt: skip
    exported = onnx.load(str(path))
    assert {"RMSNormalization", "Attention"} <= {n.op_type for n in exported.graph.node}
    uses = torch_models.parameter_uses(exported, module)
    trainable = tuple(u.initializer for held in uses.values() for u in held)
    program = graphforge.compile(str(path), [Loss(kind="mse", output="y"), Autodiff(trainable=trainable)]).model
    session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
    for batch, seq in SIZES:
        rng = np.random.default_rng(seq)
        x = rng.standard_normal((batch, seq, 8)).astype(np.float32)
        labels = rng.standard_normal((batch, 2, seq, 4)).astype(np.float32)
        names = ["loss", *(f"{n}_grad" for n in trainable)]
        got = dict(zip(names, session.run(names, {"x": x, "labels": labels}), strict=True))
        module.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(module(torch.from_numpy(x)), torch.from_numpy(labels))
        loss.backward()
        np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
        for name, param in module.named_parameters():
            parts = [
                got[f"{u.initializer}_grad"].T if u.transposed else got[f"{u.initializer}_grad"] for u in uses[name]
            ]
            np.testing.assert_allclose(sum(parts), param.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
