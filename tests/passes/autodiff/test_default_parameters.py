"""Which initializers the autodiff pass trains by default: floating-point initializers a
gradient reaches, minus what torch.export calls buffers and the constants its dynamo
exporter lifts; trainable=/frozen= still choose among them."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import onnx.parser
import pytest

import graphforge
from graphforge import roles
from graphforge.ir import TORCH_KINDS


def _compile(model, pipeline="loss(kind=mse, output=y), autodiff, sgd(lr=0.1)"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = graphforge.compile(model, pipeline)
    meta = {p.key: p.value for p in result.model.metadata_props}
    messages = [str(w.message) for w in caught if "autodiff" in str(w.message)]
    return result.model, json.loads(meta[roles.PARAMETERS]), messages


def _parsed(text: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    model.ir_version = 8
    return model


#: y = Dropout(BatchNorm(x) * scale + unused-free path), with a float ratio initializer and a
#: scalar parameter; 'head' feeds nothing the loss reads
BN_DROPOUT = """
<ir_version: 8, opset_import: ["" : 17]>
net (float[N, 2, 3] x) => (float[N, 2, 3] y, float[N, 2, 3] other)
<float[2] gamma = {1.0, 1.5}, float[2] beta = {0.1, -0.2}, float[2] mean = {0.0, 0.5}, float[2] var = {1.0, 2.0},
 float ratio = {0.25}, bool train = {1}, float scale = {2.0}, float[1] head = {3.0}>
{
  n, rm, rv = BatchNormalization <training_mode = 1, momentum = 0.9> (x, gamma, beta, mean, var)
  s = Mul (n, scale)
  y, mask = Dropout (s, ratio, train)
  other = Mul (x, head)
}
"""


#: y = Pad(Clip(x * w, low, high), pads, value): Clip's bounds and Pad's value are settings
SETTINGS = """
<ir_version: 8, opset_import: ["" : 17]>
net (float[N, 3] x) => (float[N, 5] y)
<float[3] w = {1.0, -2.0, 0.5}, float low = {-0.5}, float high = {0.75}, int64[4] pads = {0, 1, 0, 1},
 float value = {0.25}>
{
  h = Mul (x, w)
  c = Clip (h, low, high)
  y = Pad (c, pads, value)
}
"""


def test_settings_train_only_when_named():
    """Clip's bounds and Pad's value have gradients, but they are numbers in torch: by default
    no parameters (and no warning); named in trainable, they train."""
    model, parameters, messages = _compile(_parsed(SETTINGS))
    assert (parameters, messages) == (["w"], [])
    named = "loss(kind=mse, output=y), autodiff(trainable=[w, low, high, value]), sgd(lr=0.1)"
    model, parameters, messages = _compile(_parsed(SETTINGS), named)
    assert sorted(parameters) == ["high", "low", "value", "w"] and messages == []
    outputs = {o.name for o in model.graph.output}
    assert {"low_grad", "high_grad", "value_grad"} <= outputs


def test_a_zero_size_reshape_keeps_its_zero_in_the_gradient():
    """Reshape's gradient reshapes dy to x's shape, read at run time: with a zero-size dim that
    needs allowzero (opset 14+), or Reshape reads the 0 as "keep this dim" and fails."""
    model = _parsed("""
    <ir_version: 8, opset_import: ["" : 17]>
    net (float[N, 3] x) => (float[N, 3] y)
    <float[3] w = {1.0, 2.0, 3.0}, int64[2] wide = {3, -1}, int64[2] back = {-1, 3}>
    {
      h = Mul (x, w)
      r = Reshape (h, wide)
      y = Reshape (r, back)
    }
    """)
    program = graphforge.compile(model, "loss(kind=mse, reduction=sum, output=y), autodiff").model
    session = graphforge.create_session(program)
    empty = np.zeros((0, 3), np.float32)
    (grad,) = session.run(["w_grad"], {"x": empty, "labels": empty})
    assert np.array_equal(grad, np.zeros(3, np.float32))


def test_running_statistics_and_dropout_ratio_are_no_parameters_and_get_no_warning():
    model, parameters, messages = _compile(_parsed(BN_DROPOUT))
    assert parameters == ["gamma", "beta", "scale", "head"]  # the rank-0 'scale' is a parameter
    # 'head' is a real parameter the loss does not use: still warned about, alone
    assert messages == ["autodiff: the loss does not depend on 1 parameter(s), which get no gradient: head"]
    outputs = {o.name for o in model.graph.output}
    assert {"gamma_grad", "beta_grad", "scale_grad"} <= outputs
    assert not {"mean_grad", "var_grad", "ratio_grad"} & outputs


def test_a_statistic_named_in_trainable_is_warned_about():
    _, parameters, messages = _compile(
        _parsed(BN_DROPOUT), "loss(kind=mse, output=y), autodiff(trainable=[gamma, mean]), sgd(lr=0.1)"
    )
    assert parameters == ["gamma"]
    assert any("no gradient reaches mean (named in trainable)" in m for m in messages)


def test_frozen_still_removes_parameters():
    _, parameters, _ = _compile(
        _parsed(BN_DROPOUT), "loss(kind=mse, output=y), autodiff(frozen=['s*', head]), sgd(lr=0.1)"
    )
    assert parameters == ["gamma", "beta"]


def test_batchnorm_model_from_torch_trains_no_running_statistics():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
    import _training_models as tm

    model, parameters, messages = _compile(tm.cnn_onnx())
    assert not [p for p in parameters if "running" in p]
    assert messages == []  # no "does not depend" warning on every BatchNorm model
    state = json.loads({p.key: p.value for p in model.metadata_props}[roles.STATE])
    carried = {spec["input"]: spec["role"] for spec in state}
    assert carried["1.running_mean"] == carried["1.running_var"] == "buffer"  # still carried, as buffers


# --------------------------------------------------------------------------- torch.onnx's dynamo exporter


def _dynamo_export(tmp_path, optimize: bool):
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))  # a scalar parameter, as CLIP's
            self.register_buffer("offset", torch.full((3,), 0.5))

        def forward(self, x):
            return self.fc(x / 16.0) * self.logit_scale + self.offset

    return _exported(Net(), torch.zeros(2, 4), tmp_path / f"net_{optimize}.onnx", optimize, output="y")


def _exported(module, example, path, optimize: bool, output: str):
    """``module`` through torch.onnx's dynamo exporter into ``path``: input ``x``, one output."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (example,), str(path), dynamo=True, optimize=optimize, external_data=False,
                          input_names=["x"], output_names=[output], verbose=False)  # fmt: skip
    return path


@pytest.mark.parametrize("optimize", [True, False])
def test_dynamo_buffers_and_lifted_constants_are_no_parameters(tmp_path, optimize):
    path = _dynamo_export(tmp_path, optimize)
    model, parameters, messages = _compile(path)
    assert sorted(parameters) == ["fc.bias", "fc.weight", "logit_scale"]
    assert messages == []
    kinds = json.loads({p.key: p.value for p in model.metadata_props}[TORCH_KINDS])
    assert kinds["offset"] == "BUFFER" and kinds["logit_scale"] == "PARAMETER"

    module = graphforge.Module(model, device="cpu")
    graphforge.Optimizer(module)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, target = rng.standard_normal((2, 4)), rng.standard_normal((2, 3))
        module.train_step(x.astype(np.float32), target.astype(np.float32))
    assert sorted(module.parameters) == ["fc.bias", "fc.weight", "logit_scale"]  # 16.0 and offset: not carried
    assert module.parameters["logit_scale"] != 2.0
    if optimize:  # the exporter's optimizer lifted 16.0 into an initializer (else it stays a Constant node)
        lifted = [t for t in onnx.load(path).graph.initializer if t.name.startswith("val_")]
        floats = [float(onnx.numpy_helper.to_array(t)) for t in lifted if t.data_type == onnx.TensorProto.FLOAT]
        assert floats == [16.0]


def _dynamo_linear_on_a_sequence(tmp_path, optimize: bool):
    """A Linear on [N, T, C]: the exporter writes MatMul(x, Transpose(W)), which its optimizer
    folds into one new constant holding Wᵀ; W is gone from the model."""
    torch = pytest.importorskip("torch")
    return _exported(torch.nn.Linear(4, 3), torch.zeros(2, 5, 4), tmp_path / f"seq_{optimize}.onnx", optimize, "y")


def test_parameters_the_exporter_folded_away_are_warned_about(tmp_path):
    _, parameters, messages = _compile(_dynamo_linear_on_a_sequence(tmp_path, optimize=True))
    assert parameters == ["bias"]  # the folded transpose is a constant: nothing trains the weight
    assert messages == [
        "autodiff: torch.onnx.export's optimizer folded 1 of the module's parameters into constants (a Linear "
        "weight into its transpose) or merged equal ones, so they do not train: p_weight; export with "
        "optimize=False to train them"
    ]
    _, parameters, messages = _compile(_dynamo_linear_on_a_sequence(tmp_path, optimize=False))
    assert sorted(parameters) == ["bias", "weight"] and messages == []


def test_a_batchnorm_torch_trains_is_trained_so_from_a_dynamo_export(tmp_path):
    """The dynamo exporter writes a training-mode BatchNorm as an inference BatchNormalization
    (running statistics); its fx node metadata still says training=True, so autodiff makes it
    what torch computes. Oracle: torch.optim.AdamW on the module, step for step."""
    import copy

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(288, 5)
    ).train()
    reference = copy.deepcopy(net)
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    path = _exported(net, x, tmp_path / "bn.onnx", optimize=False, output="logits")
    model, _, messages = _compile(path, "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=0.01)")
    assert messages == [
        "autodiff: 1 BatchNormalization node(s) that torch ran in training mode were exported in inference mode "
        "(torch.onnx's dynamo exporter does so); they train in training mode, normalising with the batch's "
        "statistics, as torch does"
    ]
    module = graphforge.Module(model, device="cpu")
    assert sorted(module.buffers) == ["1.running_mean", "1.running_var"]
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for _ in range(3):
        ours = float(module.train_step(x.numpy(), y.numpy()))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(reference(x), y)
        loss.backward()
        optimizer.step()
        np.testing.assert_allclose(ours, loss.item(), rtol=1e-5)
    np.testing.assert_allclose(module.buffers["1.running_var"], reference[1].running_var.numpy(), rtol=1e-5)
