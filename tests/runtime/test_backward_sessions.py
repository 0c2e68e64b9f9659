"""Sessions of programs with a backward: onnxruntime's optimizations must leave gradients exact.

Oracle: torch autograd in float64 on the same weights and batch (16 images of 3×64×64). A
ResNet-18 (BasicBlocks, BatchNorm in training mode) is the model where onnxruntime 1.31's
NchwcTransformer, which rewrites convolutions whose weights are constants (an
``autodiff``-only program's are), changed the gradients by up to 1.5% of their largest
value; graphforge's sessions run a program with a backward without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import graphforge

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from train_bench import export, resnet18  # noqa: E402  (the benchmark's model, built from code)

#: float32 gradients against float64, relative to each gradient's largest magnitude: torch's own
#: float32 ones came within 5.4e-6 here, graphforge's 5.0e-6, and 1.5e-2 with the transformer
TOLERANCE = 1e-4


def test_resnet_gradients_from_a_session_match_float64_autograd(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3, 64, 64)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    module = resnet18(10)
    path = export(module, x, tmp_path / "resnet.onnx", "x", training=True)
    program = graphforge.compile(str(path), "loss(kind=cross_entropy, output=logits), autodiff").model
    session = graphforge.create_session(program)
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(names, {"x": x, "labels": y}), strict=True))

    module.double().train()
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x).double()), torch.from_numpy(y))
    loss.backward()
    for name, p in module.named_parameters():
        expected = p.grad.numpy()
        error = np.abs(got[f"{name}_grad"] - expected).max() / np.abs(expected).max()
        assert error < TOLERANCE, f"{name}: {error:.1e}"
