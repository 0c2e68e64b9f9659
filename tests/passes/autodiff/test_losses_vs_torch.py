"""Every loss kind the loss pass writes, against torch.nn.functional: the value and the
gradient with respect to the model output, for both reductions, [N, C] and [N, C, d, d]
layouts, ignore_index (cross_entropy, nll) and label smoothing (cross_entropy), with
symbolic dims and two batch sizes through one compiled graph."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import graphforge

F = torch.nn.functional


def _model(rank: int) -> onnx.ModelProto:
    shape = ["n", 4] + [f"d{i}" for i in range(rank - 2)]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["out"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _torch_loss(kind, t, labels, reduction, ignore, smoothing):
    if kind == "cross_entropy":
        return F.cross_entropy(t, labels, reduction=reduction, ignore_index=ignore, label_smoothing=smoothing)
    if kind == "nll":
        return F.nll_loss(t, labels, reduction=reduction, ignore_index=ignore)
    if kind == "bce_with_logits":
        return F.binary_cross_entropy_with_logits(t, labels, reduction=reduction)
    return {"mse": F.mse_loss, "l1": F.l1_loss}[kind](t, labels, reduction=reduction)


def _cases():
    for kind, rank, reduction in itertools.product(["cross_entropy", "nll", "mse", "l1", "bce_with_logits"], [2, 4],
                                                   ["mean", "sum"]):  # fmt: skip
        classes = kind in ("cross_entropy", "nll")
        for ignore, smoothing in itertools.product([-100, 2] if classes else [-100], [0.0, 0.2]):
            if smoothing and kind != "cross_entropy":
                continue
            yield pytest.param(
                kind,
                rank,
                reduction,
                ignore,
                smoothing,
                id=f"{kind}-rank{rank}-{reduction}-ignore{ignore}-ls{smoothing}",
            )


@pytest.mark.parametrize(("kind", "rank", "reduction", "ignore", "smoothing"), list(_cases()))
def test_loss_and_its_gradient_match_torch(kind, rank, reduction, ignore, smoothing):
    options = f", ignore_index={ignore}" if kind in ("cross_entropy", "nll") else ""
    options += f", label_smoothing={smoothing}" if smoothing else ""
    pipeline = f"loss(kind={kind}, output=out, reduction={reduction}{options}), autodiff(inputs=[x])"
    session = graphforge.create_session(
        graphforge.compile(_model(rank), pipeline).model, providers=["CPUExecutionProvider"]
    )
    for n in (3, 6):
        rng = np.random.default_rng(n)
        shape = (n, 4) + ((3, 2) if rank == 4 else ())
        x = (rng.standard_normal(shape) * 4).astype(np.float32)  # large logits: bce's stable form matters
        if kind in ("cross_entropy", "nll"):
            labels = rng.integers(0, 4, (n, *shape[2:]))
            labels.reshape(-1)[::4] = ignore  # every fourth target ignored (or class 2)
        elif kind == "bce_with_logits":
            labels = rng.random(shape).astype(np.float32)
        else:
            labels = rng.standard_normal(shape).astype(np.float32)
        t = torch.from_numpy(x).requires_grad_()
        expected = _torch_loss(kind, t, torch.from_numpy(labels), reduction, ignore, smoothing)
        expected.backward()
        loss, grad = session.run(["loss", "x_grad"], {"x": x, "labels": labels})
        np.testing.assert_allclose(loss, expected.item(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-4, atol=1e-6)
