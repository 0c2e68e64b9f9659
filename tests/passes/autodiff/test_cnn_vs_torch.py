"""A small CNN's parameter gradients against torch autograd.

Conv - BatchNorm (training mode) - ReLU - MaxPool (overlapping, padded) - grouped strided
Conv - AveragePool - Flatten - Linear, exported once with a dynamic batch axis and
compiled once with ``loss(kind=cross_entropy), autodiff``; the one compiled graph must give
torch's gradients at two batch sizes.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import graphforge

torch = pytest.importorskip("torch")

OPSET = 17  # MaxPool's overlapping windows need ScatterElements(reduction=add), opset 16+


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.pool = torch.nn.MaxPool2d(3, stride=2, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.avg = torch.nn.AvgPool2d(2)
        self.fc = torch.nn.Linear(8 * 2 * 2, 5)

    def forward(self, x):
        h = self.pool(torch.relu(self.bn(self.conv1(x))))
        h = self.avg(self.conv2(h))
        return self.fc(torch.flatten(h, 1))


def _module() -> SmallCNN:
    torch.manual_seed(0)
    module = SmallCNN()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the TorchScript exporter merges equal initializers (zero biases, unit BN scales)
        for param in module.parameters():
            if param.dim() == 1:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return module.train()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript exporter deprecation and tracer warnings
        torch.onnx.export(
            _module(),
            (torch.zeros(2, 3, 16, 16),),
            str(path),
            dynamo=False,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,  # BatchNormalization keeps training_mode=1
            opset_version=OPSET,
            input_names=["x"],
            output_names=["logits"],
            dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
        )
        # BatchNorm's running statistics are initializers the loss does not depend on: they
        # get no gradient, and the autodiff pass says so in a warning
        result = graphforge.compile(path, "loss(kind=cross_entropy, output=logits), autodiff")
    return graphforge.create_session(result.model, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("batch", [4, 7])
def test_cnn_gradients_match_torch(compiled, batch):
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)
    labels = rng.integers(0, 5, size=batch).astype(np.int64)

    module = _module()
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(labels))
    loss.backward()
    expected = {name: p.grad.numpy() for name, p in module.named_parameters()}

    names = [f"{name}_grad" for name in expected]
    got_loss, *got = compiled.run(["loss", *names], {"x": x, "labels": labels})
    np.testing.assert_allclose(got_loss, loss.item(), rtol=1e-5)
    for (name, grad), value in zip(expected.items(), got, strict=True):
        np.testing.assert_allclose(value, grad, rtol=1e-4, atol=1e-5, err_msg=name)
