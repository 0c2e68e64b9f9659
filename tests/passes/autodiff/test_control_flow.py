"""Gradients through If, against torch autograd: a torch.cond exported by the dynamo
exporter (its branches read a parameter straight from the enclosing scope), on both branches,
with the parameters found by default; and a parameter that reaches the loss both through an
If and beside it (the contributions must add up)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import torch

import graphforge
from graphforge import roles


class CondNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        out = torch.cond(h.sum() > 0, lambda h: torch.sin(h * self.w), lambda h: h * h + self.w, (h,))
        return out * self.w  # w is read outside the If too


@pytest.fixture(scope="module")
def cond_program(tmp_path_factory):
    path = tmp_path_factory.mktemp("cond") / "cond.onnx"
    net = CondNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 3),), str(path), dynamo=True, optimize=False, input_names=["x"],
                          output_names=["y"], external_data=False, verbose=False)  # fmt: skip
    assert "If" in {n.op_type for n in onnx.load(path).graph.node}
    trainable = "[" + ", ".join(n for n, _ in net.named_parameters()) + "]"
    result = graphforge.compile(str(path), f"loss(kind=mse, output=y), autodiff(trainable={trainable})")
    return net, result.model


@pytest.mark.slow  # a dynamo export
@pytest.mark.parametrize("then", [True, False], ids=["then", "else"])
def test_torch_cond_gradients_match_torch(cond_program, then):
    net, program = cond_program
    x = next(x for x in (np.full((2, 3), v, np.float32) for v in (10.0, -10.0)) if _takes_then(net, x) == then)
    labels = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    grads = json.loads({p.key: p.value for p in program.metadata_props}[roles.GRADIENTS])
    assert set(grads) == {"w", "lin.weight", "lin.bias"}
    session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
    names = ["loss", *grads.values()]
    got = dict(zip(names, session.run(names, {"x": x, "labels": labels}), strict=True))
    net.zero_grad()
    loss = torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(labels))
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(got[grads[name]], p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def _takes_then(net, x) -> bool:
    with torch.no_grad():
        return float(net.lin(torch.from_numpy(x)).sum()) > 0


#: w is read only inside the branches (an initializer, straight from the enclosing scope)
BRANCHES_ONLY = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[3] x) => (float loss)
<float[3] w = {1.0, 2.0, 3.0}, float zero = {0.0}>
{
    sx = ReduceSum <keepdims = 0> (x)
    cond = Greater(sx, zero)
    branch = If (cond) <then_branch = t () => (float[3] a) { a = Mul(x, w) },
                        else_branch = e () => (float[3] b) { b = Add(x, w) }>
    sq = Mul(branch, branch)
    loss = ReduceSum <keepdims = 0> (sq)
}
"""


@pytest.mark.parametrize("x", [[0.5, -0.2, 0.4], [-0.5, -0.2, 0.4]], ids=["then", "else"])
def test_parameter_read_only_inside_branches(x):
    program = graphforge.compile(onnx.parser.parse_model(BRANCHES_ONLY), "autodiff(trainable=[w])").model
    got = graphforge.create_session(program, providers=["CPUExecutionProvider"]).run(["w_grad"], {"x": np.float32(x)})
    t, w = torch.tensor(x), torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    branch = t * w if t.sum() > 0 else t + w
    (branch * branch).sum().backward()
    np.testing.assert_allclose(got[0], w.grad.numpy(), rtol=1e-6)
