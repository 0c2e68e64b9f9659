"""Sessions of programs with a backward: onnxruntime's optimizations must leave gradients exact.

Oracle: torch autograd in float64 on the same weights and batch (16 images of 3×64×64). A
ResNet-18 (BasicBlocks, BatchNorm in training mode) is the model where onnxruntime 1.31's
NchwcTransformer, which rewrites convolutions whose weights are constants (an
``autodiff``-only program's are), changed the gradients by up to 1.5% of their largest
value; graphforge's sessions run a program with a backward without it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import graphforge
from graphforge import roles
from graphforge.ort_compat import nchwc_block_size

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from train_bench import export, resnet18  # noqa: E402  (the benchmark's model, built from code)

#: float32 gradients against float64, relative to each gradient's largest magnitude: torch's own
#: float32 ones came within 5.4e-6 here, graphforge's 5.0e-6, and 1.5e-2 with the transformer
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """(the exported model, a batch, its labels, torch's float64 gradients by parameter name)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3, 64, 64)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    module = resnet18(10)
    path = export(module, x, tmp_path_factory.mktemp("resnet") / "resnet.onnx", "x", training=True)
    module.double().train()
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x).double()), torch.from_numpy(y))
    loss.backward()
    return path, x, y, {name: p.grad.numpy() for name, p in module.named_parameters()}


@pytest.mark.parametrize(
    "fuse",
    [
        "",
        # its stacked convolutions (the 4x4 and 2x2 stages), NCHWc input gradients (16x16), NCHWc
        # forward convolutions (16x16 and 8x8) and ReLU masks sum in other orders or through other
        # kernels: the same oracle holds
        ", fuse(provider=cpu)",
    ],
    ids=["plain", "fused"],
)
def test_resnet_gradients_from_a_session_match_float64_autograd(resnet, fuse):
    path, x, y, expected = resnet
    program = graphforge.compile(str(path), f"loss(kind=cross_entropy, output=logits), autodiff{fuse}").model
    if fuse:
        fired = json.loads(roles.metadata_of(program)[roles.FUSION])["fired"]
        assert fired["conv_stacked"] == 10 and fired["conv_transpose_stacked"] == 10, fired
        assert fired.get("conv_nchwc", 0) == (8 if nchwc_block_size() else 0), fired
    session = graphforge.create_session(program)
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(names, {"x": x, "labels": y}), strict=True))
    for name, grad in expected.items():
        error = np.abs(got[f"{name}_grad"] - grad).max() / np.abs(grad).max()
        assert error < TOLERANCE, f"{name}: {error:.1e}"
