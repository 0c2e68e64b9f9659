"""graphforge.torch.train_program: an nn.Module exported for training and compiled, then
trained by graphforge.Module, equals the same module trained by torch.optim.AdamW step for
step; the export keeps torch's parameters apart (equal values are not merged), one where
torch has one (a tied weight), frozen where torch's is, and leaves the module as it was."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from _torch_modules import RMSNormNet  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from graphforge import GraphforgeError, Module  # noqa: E402
from graphforge.torch import export_for_training, train_program  # noqa: E402

STEPS = 20
LR, WEIGHT_DECAY = 1e-2, 0.01
PIPELINE = f"loss(kind=cross_entropy, output=logits), autodiff, adamw(lr={LR}, weight_decay={WEIGHT_DECAY})"
#: float32 sums in another order over 20 AdamW steps
RTOL, ATOL = 1e-5, 1e-6


def mlp_with_batchnorm():
    torch.manual_seed(0)
    # no bias right before a BatchNorm, which removes it: its gradient is rounding noise, which
    # AdamW's normalisation turns into steps of size lr in any direction, on both sides
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16, bias=False),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
    )
    for layer in net:
        if isinstance(layer, torch.nn.Linear) and layer.bias is not None:
            torch.nn.init.zeros_(layer.bias)  # equal values: the TorchScript exporter would merge them
    return net, (16, 8)


def cnn_with_batchnorm():
    torch.manual_seed(1)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(4, 4, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 3),
    )
    return net, (6, 3, 8, 8)


def batches(shape, count=STEPS, classes=3, seed=2):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal(shape).astype(np.float32), rng.integers(0, classes, shape[0]).astype(np.int64))
        for _ in range(count)
    ]


def train_both(net, shape, pipeline=PIPELINE, count=STEPS, exporter="auto"):
    """Train a copy of ``net`` with graphforge and ``net`` itself with torch; per-step losses."""
    import copy

    reference = copy.deepcopy(net).train()
    example = torch.from_numpy(batches(shape, 1)[0][0])
    module = Module(train_program(net, example, pipeline, exporter=exporter).model, device="cpu")
    trained = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, weight_decay=WEIGHT_DECAY)
    ours, theirs = [], []
    for x, y in batches(shape, count):
        ours.append(float(module.train_step(x, y)))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        theirs.append(loss.item())
    return module, reference, ours, theirs


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("build", [mlp_with_batchnorm, cnn_with_batchnorm])
def test_training_equals_torch_adamw_step_for_step(build, exporter):
    """The dynamo exporter writes BatchNorm in inference mode: put back in training mode, the
    running statistics move as torch's do."""
    net, shape = build()
    module, reference, ours, theirs = train_both(net, shape, exporter=exporter)
    np.testing.assert_allclose(ours, theirs, rtol=RTOL)
    expected = {name: p.detach().numpy() for name, p in reference.named_parameters()}
    assert sorted(module.parameters) == sorted(expected)  # torch's names, none merged
    for name, value in expected.items():
        np.testing.assert_allclose(module.parameters[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
    running = {n: b.numpy() for n, b in reference.named_buffers() if n.endswith(("running_mean", "running_var"))}
    assert sorted(module.buffers) == sorted(running)
    for name, value in running.items():
        np.testing.assert_allclose(module.buffers[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_the_export_leaves_the_module_as_it_was():
    net, shape = mlp_with_batchnorm()
    net.eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = export_for_training(net, torch.randn(*shape))
    assert not net.training
    after = net.state_dict()
    for name, value in before.items():  # num_batches_tracked and the running statistics too
        assert torch.equal(after[name], value), name
    values = {t.name: t for t in model.graph.initializer}
    np.testing.assert_array_equal(numpy_helper.to_array(values["0.bias"]), np.zeros(16, np.float32))
    np.testing.assert_array_equal(numpy_helper.to_array(values["7.bias"]), np.zeros(3, np.float32))


def test_a_buffer_the_tracer_bakes_into_a_constant_keeps_its_value():
    """TorchScript's tracer writes a one-element buffer read under no_grad as a Constant node
    (GPT-NeoX's rotary inv_freq): the export, traced on placeholder values, had kept the
    placeholder there; the Constant now gives way to the buffer's initializer."""

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.tensor([1.0]), persistent=False)

        @torch.no_grad()
        def forward(self, x):
            positions = torch.arange(x.shape[1], device=x.device)[None, :, None].float()
            return (positions * self.inv_freq.to(device=x.device, dtype=torch.float)).cos()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.fc = torch.nn.Linear(4, 3)
            self.rotary = Rotary()

        def forward(self, x):
            return self.fc(x) * self.rotary(x)

    net, x = Net(), torch.randn(2, 5, 4)
    model = export_for_training(net, x, exporter="torchscript")
    assert "rotary.inv_freq" in {t.name for t in model.graph.initializer}
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()}
    )
    np.testing.assert_allclose(y, net(x).detach().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_tied_weight_stays_one_parameter(exporter):
    class TiedLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.embed = torch.nn.Embedding(11, 6)
            self.mix = torch.nn.Linear(6, 6)
            self.head = torch.nn.Linear(6, 11, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.mix(self.embed(ids))))

    net = TiedLM()
    example = torch.randint(0, 11, (5,))
    module = Module(train_program(net, example, PIPELINE, exporter=exporter).model, device="cpu")
    assert "embed.weight" in module.parameters and "head.weight" not in module.parameters
    reference = TiedLM()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    rng = np.random.default_rng(4)
    for _ in range(10):
        ids, labels = rng.integers(0, 11, 5), rng.integers(0, 11, 5)
        ours = float(module.train_step(ids, labels))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(ids)), torch.from_numpy(labels))
        loss.backward()
        optimizer.step()
        np.testing.assert_allclose(ours, loss.item(), rtol=RTOL)
    np.testing.assert_allclose(
        module.parameters["embed.weight"], reference.embed.weight.detach().numpy(), rtol=RTOL, atol=ATOL
    )


def test_a_frozen_parameter_is_not_trained():
    net, shape = mlp_with_batchnorm()
    net[0].weight.requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    module, reference, ours, theirs = train_both(net, shape, count=5)
    np.testing.assert_allclose(ours, theirs, rtol=RTOL)
    assert "0.weight" not in module.parameters
    assert torch.equal(reference[0].weight, frozen)
    np.testing.assert_allclose(module.parameters["7.bias"], reference[7].bias.detach().numpy(), rtol=RTOL, atol=ATOL)


def test_bad_inputs_are_one_clear_error():
    net, _ = mlp_with_batchnorm()
    with pytest.raises(GraphforgeError, match="example_inputs must be a tensor or a non-empty sequence of tensors"):
        export_for_training(net, [])
    with pytest.raises(GraphforgeError, match=r"1 example input\(s\) but 2 input name\(s\)"):
        export_for_training(net, torch.randn(4, 8), input_names=["a", "b"])
    with pytest.raises(GraphforgeError, match=r"torch\.onnx\.export failed: RuntimeError"):
        export_for_training(net, torch.randn(4, 5))  # the first Linear takes 8 features
    half = torch.nn.Linear(4, 2).to(torch.bfloat16)
    with pytest.raises(GraphforgeError, match=r"cannot export bias, weight \(torch.bfloat16\)"):
        export_for_training(half, torch.randn(3, 4, dtype=torch.bfloat16))


def test_auto_turns_to_the_dynamo_exporter_where_torchscript_cannot_export():
    net = RMSNormNet()
    module, reference, ours, theirs = train_both(net, (16, 8), count=8)
    np.testing.assert_allclose(ours, theirs, rtol=RTOL)
    np.testing.assert_allclose(
        module.parameters["norm.weight"], reference.norm.weight.detach().numpy(), rtol=RTOL, atol=ATOL
    )
    with pytest.raises(GraphforgeError, match=r"torch\.onnx\.export failed: .*rms_norm"):
        train_program(net, torch.randn(4, 8), PIPELINE, exporter="torchscript")
    with pytest.raises(GraphforgeError, match="exporter must be 'auto' or one of 'torchscript', 'dynamo'"):
        train_program(net, torch.randn(4, 8), PIPELINE, exporter="jit")
