"""The freeze pass: a MobileNetV2-style model (inverted residuals, depthwise convolutions,
BatchNorm in inference mode) exported by torch, its backbone frozen by name or up to a tensor;
the program's gradients, from a graphforge session (the backbone's convolutions in onnxruntime's
NCHWc layout), equal torch's with ``requires_grad=False`` on the backbone, and its backward stops
at the first trained layer. Then the selections' errors on a small hand-written MLP."""

from __future__ import annotations

import warnings

import models
import numpy as np
import onnx
import pytest
from _pages import page_block, run_block

import graphforge
from graphforge.errors import GraphforgeError
from graphforge.pass_spec import format_value
from graphforge.program import ProgramRoles
from graphforge.runtime.sessions import nchwc_safe

torch = pytest.importorskip("torch")

#: the backbone: the stem and the first inverted residual block (torch's parameter names)
BACKBONE = ("features.0.", "features.1.")
TRAINING = "loss(kind=cross_entropy, output=logits), autodiff"
PAGE = "docs/guides/pytorch-export.md"


def _mobilenet():
    """Stem (3×3, stride 2), an inverted residual block (1×1 expansion, 3×3 depthwise, 1×1
    projection, a residual Add), a second one with stride 2, a 1×1 convolution, pooling, a
    linear head; BatchNorm and ReLU6 as MobileNetV2's, tiny channels."""
    from torch import nn

    def conv_bn(c_in, c_out, kernel, stride=1, groups=1, relu=True):
        layers = [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out)]
        return nn.Sequential(*layers, *([nn.ReLU6()] if relu else []))

    class Inverted(nn.Module):
        def __init__(self, c_in, c_out, stride):
            super().__init__()
            self.residual = stride == 1 and c_in == c_out
            self.conv = nn.Sequential(conv_bn(c_in, 2 * c_in, 1), conv_bn(2 * c_in, 2 * c_in, 3, stride, 2 * c_in),
                                      conv_bn(2 * c_in, c_out, 1, relu=False))  # fmt: skip

        def forward(self, x):
            return x + self.conv(x) if self.residual else self.conv(x)

    torch.manual_seed(0)
    features = nn.Sequential(conv_bn(3, 4, 3, 2), Inverted(4, 4, 1), Inverted(4, 8, 2), conv_bn(8, 8, 1))
    model = nn.Sequential()
    model.features, model.pool, model.flatten, model.classifier = (
        features,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    with torch.no_grad():  # a pretrained backbone's statistics; distinct values (the exporter ties equal ones)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.1, 0.1), m.running_var.uniform_(0.5, 1.5)
    return model.eval()


@pytest.fixture(scope="module")
def mobilenet(tmp_path_factory):
    """The torch module, its export, and a batch (x, labels)."""
    module = _mobilenet()
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((2, 3, 8, 8)).astype(np.float32), np.array([0, 2], np.int64)
    path = tmp_path_factory.mktemp("mobilenet") / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript exporter deprecation and tracer warnings
        torch.onnx.export(module, (torch.from_numpy(batch[0]),), str(path), dynamo=False, do_constant_folding=False,
                          opset_version=models.OPSET, input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})  # fmt: skip
    return module, onnx.load(path), batch


def _backbone_output(model: onnx.ModelProto) -> str:
    """The first block's output: its residual Add (the model's first)."""
    return next(n.output[0] for n in model.graph.node if n.op_type == "Add")


@pytest.fixture(scope="module")
def frozen_program(mobilenet):
    _, model, _ = mobilenet
    return graphforge.compile(model, f"freeze(before={format_value([_backbone_output(model)])}), {TRAINING}").model


def test_the_trained_layers_gradients_are_torchs_with_the_backbone_not_requiring_grad(mobilenet, frozen_program):
    module, _, (x, labels) = mobilenet
    for name, p in module.named_parameters():
        p.requires_grad_(not name.startswith(BACKBONE))
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(labels))
    loss.backward()
    expected = {name: p.grad.numpy() for name, p in module.named_parameters() if p.requires_grad}

    roles = ProgramRoles.read(frozen_program)
    assert sorted(roles.gradients) == sorted(expected)  # the backbone has none
    backbone = {n for n, _ in module.named_parameters() if n.startswith(BACKBONE)}
    assert backbone <= set(roles.frozen) and {f.by for f in roles.frozen.values()} == {"freeze"}
    assert not backbone & {i.name for i in frozen_program.graph.input}  # constants of the session
    session = graphforge.create_session(frozen_program)
    feeds = {"x": x, "labels": labels}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for name, grad in expected.items():
        np.testing.assert_allclose(got[roles.gradients[name]], grad, rtol=1e-4, atol=1e-6, err_msg=name)

    # a training program (the trained weights carried inputs): its backward reads no constant, so
    # the runner's session runs the backbone's convolutions in onnxruntime's NCHWc blocks; one SGD
    # step moves each trained weight by lr times torch's gradient
    lr = 0.5
    program = graphforge.compile(
        mobilenet[1], f"freeze(names=['features.0.*', 'features.1.*']), {TRAINING}, sgd(lr={lr})"
    )
    assert nchwc_safe(program.model)
    trained = graphforge.Module(program.model, device="cpu")
    start = {name: np.array(value, copy=True) for name, value in trained.parameters.items()}
    np.testing.assert_allclose(float(trained.train_step(x, labels)), loss.item(), rtol=1e-5)
    for name, grad in expected.items():
        moved = (start[name] - trained.parameters[name]) / lr
        np.testing.assert_allclose(moved, grad, rtol=1e-3, atol=2e-6, err_msg=name)


def test_the_backward_stops_at_the_first_trained_layer(mobilenet, frozen_program):
    """Every gradient node is the backward of a forward node after the backbone (the generated
    names carry their forward node's), and it has fewer than the unfrozen program's."""
    _, model, _ = mobilenet
    forward = [n.name for n in model.graph.node]
    backbone = [n for n in forward if n.startswith(("/features/features.0/", "/features/features.1/"))]
    assert len(backbone) > 10  # the stem and the first block: 6 Conv, 6 BatchNormalization, ...

    def backward_of(program) -> set[str]:
        grads = [n.name for n in program.graph.node if n.name.startswith("grad::")]
        return {f for f in forward if any(g.startswith(f"grad::{f}/") for g in grads)}

    unfrozen = graphforge.compile(model, TRAINING).model
    assert not nchwc_safe(unfrozen)  # its backward reads the constant weights
    assert set(backbone) & backward_of(unfrozen)  # the oracle's premise: names say where a gradient comes from
    assert backward_of(frozen_program) and not set(backbone) & backward_of(frozen_program)
    count = sum(n.name.startswith("grad::") for n in frozen_program.graph.node)
    assert count < sum(n.name.startswith("grad::") for n in unfrozen.graph.node)


def test_names_regex_and_before_select_the_same_backbone(mobilenet):
    """The three selections freeze the stem's and the first block's weights, BatchNorm's
    statistics included (autodiff keeps of the role the weights it would have trained)."""
    _, model, _ = mobilenet
    expected = {n.name for n in model.graph.initializer if n.name.startswith(BACKBONE)}
    selections = (
        f"before={format_value([_backbone_output(model)])}",
        "names=['features.0.*', 'features.1.*']",
        "regex='features[.][01][.].*'",
    )
    for selection in selections:
        program = graphforge.compile(model, f"freeze({selection})").model
        assert set(ProgramRoles.read(program).frozen) == expected, selection
    kept = graphforge.compile(model, "freeze(names=['features.*'], keep=['features.3.*'])").model
    assert not any(n.startswith("features.3.") for n in ProgramRoles.read(kept).frozen)


@pytest.mark.parametrize(
    ("pipeline", "message"),
    [
        ("freeze(names=[w9])", r"names pattern 'w9' matches no weight \(closest: w2, w1\)"),
        ("freeze(regex='b.*', names=[w1, w2])", "selects every one of the model's 4 weights: nothing would train"),
        ("freeze(before=[hiden])", r"before names 'hiden', no tensor or node of the model \(closest: hidden"),
        ("freeze(before=[x])", "no weight computes 'x'"),
        ("freeze", r"give names=\[...\], regex=... or before=\[...\]: the weights to freeze"),
        ("loss(kind=mse, output=y), autodiff, freeze(names=[w1])", "gradients"),
    ],
    ids=["no-match", "everything", "unknown-tensor", "an-input", "nothing-given", "after-autodiff"],
)
def test_a_selection_that_cannot_freeze_is_one_clear_error(pipeline, message):
    with pytest.raises(GraphforgeError, match=message):
        graphforge.compile(models.tanh_mlp(), pipeline)


def test_before_freezes_what_computes_a_tensor_and_training_leaves_it(tmp_path):
    """On the MLP: before=[hidden] freezes w1 and b1; a trained step leaves them, moves w2."""
    program = graphforge.compile(
        models.tanh_mlp(), "freeze(before=[hidden]), loss(kind=mse, output=y), autodiff, sgd(lr=0.1)"
    ).model
    assert sorted(ProgramRoles.read(program).frozen) == ["b1", "w1"]
    module = graphforge.Module(program, device="cpu")
    before = dict(module.parameters)
    module.train_step(**models.tanh_mlp_batches(1)[0])
    assert sorted(module.parameters) == ["b2", "w2"] and not np.array_equal(module.parameters["w2"], before["w2"])


def test_the_export_guides_frozen_backbone_block_runs(tmp_path, monkeypatch, capsys):
    """docs/guides/pytorch-export.md's transfer-learning block, as written in a fresh folder: the
    second convolution, its BatchNorm and the head train, and the page says what it prints."""
    block = page_block(PAGE, "python", "freeze(names=")
    monkeypatch.chdir(tmp_path)
    namespace = run_block(PAGE, block)
    printed = capsys.readouterr().out.strip()
    assert printed == "('4.weight', '4.bias', '3.weight', '3.bias', '8.weight', '8.bias')"
    assert printed in block
    frozen = ProgramRoles.read(namespace["program"]).frozen
    assert {"0.weight", "0.bias", "1.weight", "1.bias"} <= set(frozen)


def test_frozen_constants_keep_a_frozen_convolution_the_backward_reads_an_input(mobilenet, tmp_path):
    """The stem trains and the first block after it is frozen: the backward reads that block's
    convolution weights (the stem's gradient passes through them). With --frozen-constants the
    artifacts keep those an input, from the checkpoint (the JavaScript runtime cannot turn
    onnxruntime's NCHWc layout off under them), and every other frozen weight a constant."""
    from graphforge.ondevice.artifacts import artifacts_from
    from graphforge.ondevice.manifest import Manifest

    _, model, _ = mobilenet
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    pipeline = f"{TRAINING}, sgd(lr=0.1)"
    _, how = artifacts_from(path, tmp_path / "a", pipeline=pipeline, freeze=["features.1.*"], frozen_constants=True)
    frozen = {n.name for n in model.graph.initializer if n.name.startswith("features.1.")}
    read = {s.name for s in Manifest.read(tmp_path / "a").state if s.role == "frozen"}
    convolutions = {n.input[1] for n in model.graph.node if n.op_type == "Conv" and n.input[1] in frozen}
    assert read == convolutions and len(read) == 3, (read, convolutions)
    assert f"but the {len(read)} that the backward reads" in how
    training = onnx.load(tmp_path / "a" / "training_model.onnx")
    assert frozen - read <= {t.name for t in training.graph.initializer}
