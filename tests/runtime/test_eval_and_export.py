"""Eval mode (dropout off, BatchNorm on running statistics, current parameters bound) and
the exported inference model, checked against torch in eval mode with the trained values."""

from __future__ import annotations

import _training_models as tm
import numpy as np
import onnx
import pytest

import graphforge
from graphforge import Module, Optimizer

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore:autodiff. the loss does not depend")


def _train(module, optimizer, count, *, shape=(tm.N_IN,), seed=5):
    for x, target in tm.batches(count, batch=4, shape=shape, seed=seed):
        module(x, target)
        optimizer.step()


def _torch_with(reference, module: Module):
    """``reference`` in eval mode holding the module's current parameters and buffers."""
    values = {**module.parameters, **module.buffers}
    with torch.no_grad():
        for name, tensor in [*reference.named_parameters(), *reference.named_buffers()]:
            if name in values:
                tensor.copy_(torch.from_numpy(values[name]))
    return reference.eval()


@pytest.fixture(scope="module")
def trained_cnn():
    module = Module(tm.compile_program(tm.cnn_onnx(), "sgd(lr=0.1, momentum=0.9)"), device="cpu")
    optimizer = Optimizer(module)
    _train(module, optimizer, 8, shape=(2, 5, 5))
    return module


@pytest.fixture(scope="module")
def trained_dropout_mlp():
    module = Module(tm.compile_program(tm.dropout_mlp_onnx(), "adam(lr=0.01)"), device="cpu")
    optimizer = Optimizer(module)
    _train(module, optimizer, 8)
    return module


@pytest.mark.parametrize("which", ["cnn", "dropout_mlp"])
def test_eval_mode_equals_torch_eval_with_the_current_values(request, which):
    module = request.getfixturevalue(f"trained_{which}")
    reference = _torch_with(getattr(tm, which)(), module)
    shape = (2, 5, 5) if which == "cnn" else (tm.N_IN,)
    x, target = tm.batches(1, batch=5, shape=shape, seed=9)[0]
    before, step = module.state.tensors, module.state.step
    module.eval()
    try:
        loss, y = module(x, target, outputs=["y"])
        loss_again = module(x, labels=target)
    finally:
        module.train()
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, np.mean((expected - target) ** 2), rtol=1e-5)
    assert np.array_equal(loss, loss_again)  # deterministic: dropout is off
    assert module.state.step == step  # eval updates nothing, running statistics included
    for name, value in module.state.tensors.items():
        assert np.array_equal(value, before[name]), name


def test_eval_follows_training(trained_dropout_mlp):
    """The eval session binds the live buffers: after more training, eval sees the new values."""
    module = trained_dropout_mlp
    x, target = tm.batches(1, seed=11)[0]
    first = module.eval()(x, target)
    module.train()
    _train(module, module._optimizer, 2, seed=12)
    second = module.eval()(x, target)
    module.train()
    assert not np.array_equal(first, second)
    reference = _torch_with(tm.dropout_mlp(), module)
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(second, np.mean((expected - target) ** 2), rtol=1e-5)


@pytest.mark.parametrize("which", ["cnn", "dropout_mlp"])
def test_exported_inference_model_holds_the_trained_values(request, tmp_path, which):
    module = request.getfixturevalue(f"trained_{which}")
    path = module.export_model_for_inferencing(tmp_path / "infer.onnx", ["y"])
    model = onnx.load(path)
    assert [i.name for i in model.graph.input] == ["x"]  # no labels, no parameter inputs
    assert [o.name for o in model.graph.output] == ["y"]
    assert not any(n.op_type.endswith("Grad") or n.name.startswith("optim::") for n in model.graph.node)
    shape = (2, 5, 5) if which == "cnn" else (tm.N_IN,)
    x, target = tm.batches(1, batch=3, shape=shape, seed=13)[0]
    (y,) = graphforge.create_session(str(path)).run(["y"], {"x": x})
    module.eval()
    try:
        _, y_eval = module(x, target, outputs=["y"])
    finally:
        module.train()
    np.testing.assert_allclose(y, y_eval, rtol=1e-6, atol=1e-7)
    reference = _torch_with(getattr(tm, which)(), module)
    with torch.no_grad():
        np.testing.assert_allclose(y, reference(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)
