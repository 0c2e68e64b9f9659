"""What PyTorch exports do not say in their ops, honoured by autodiff against torch autograd:
AffineGrid's gradient (a spatial transformer through TorchScript), the padding row of
``nn.Embedding(padding_idx=p)`` (dynamo's node metadata, or ``export_for_training``), and the
parameters torch does not train (``requires_grad=False``)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest

import graphforge
from graphforge import roles
from graphforge.program import ProgramRoles

torch = pytest.importorskip("torch")

from graphforge.torch import export_for_training  # noqa: E402  (needs torch)

RTOL, ATOL = 1e-4, 1e-6


def _compiled(model, pipeline: str):
    """The program, its gradients by parameter, and autodiff's warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = graphforge.compile(model, pipeline)
    gradients = json.loads(roles.metadata_of(result.model)[roles.GRADIENTS])
    return result.model, gradients, [str(w.message) for w in caught if str(w.message).startswith("autodiff:")]


def _run(program, feeds: dict, gradients: dict) -> dict[str, np.ndarray]:
    session = graphforge.create_session(program, providers=["CPUExecutionProvider"])
    names = ["loss", *gradients.values()]
    return dict(zip(["loss", *gradients], session.run(names, feeds), strict=True))


def _torch_gradients(module, loss) -> dict[str, np.ndarray]:
    """Each parameter's gradient under each of its names (a tied one under both: exporters pick one)."""
    module.zero_grad()
    loss.backward()
    return {n: p.grad.numpy() for n, p in module.named_parameters(remove_duplicate=False) if p.grad is not None}


def _assert_equal_gradients(ours: dict, theirs: dict, module) -> None:
    """Every parameter's gradient equals torch's, each parameter under the name its export gave it."""
    trained = {id(p) for p in module.parameters() if p.requires_grad}
    named = dict(module.named_parameters(remove_duplicate=False))
    assert {id(named[n]) for n in ours if n != "loss"} == trained, sorted(ours)
    for name, value in ours.items():
        if name != "loss":
            np.testing.assert_allclose(value, theirs[name], rtol=RTOL, atol=ATOL, err_msg=name)


# ----------------------------------------------------------------------------- AffineGrid


class SpatialTransformer(torch.nn.Module):
    """A localisation net predicts each image's affine transform; the image is resampled by it."""

    def __init__(self, align_corners: bool):
        super().__init__()
        torch.manual_seed(3)
        self.align_corners = align_corners
        self.localise = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2 * 6 * 5, 6))
        self.head = torch.nn.Linear(2 * 6 * 5, 3)

    def forward(self, x):
        theta = self.localise(x).view(-1, 2, 3)
        grid = torch.nn.functional.affine_grid(theta, list(x.shape), align_corners=self.align_corners)
        sampled = torch.nn.functional.grid_sample(x, grid, align_corners=self.align_corners)
        return self.head(sampled.flatten(1))


@pytest.mark.parametrize("align_corners", [False, True])
def test_a_spatial_transformer_exported_with_torchscript_trains_as_in_torch(tmp_path, align_corners):
    module = SpatialTransformer(align_corners)
    x = torch.randn(4, 2, 6, 5, generator=torch.Generator().manual_seed(4))
    labels = torch.tensor([0, 2, 1, 2])
    path = tmp_path / "stn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=20, do_constant_folding=False,
                          input_names=["x"], output_names=["logits"])  # fmt: skip
    assert "AffineGrid" in {n.op_type for n in onnx.load(path).graph.node}
    program, gradients, _ = _compiled(path, "loss(kind=cross_entropy, output=logits), autodiff")
    ours = _run(program, {"x": x.numpy(), "labels": labels.numpy()}, gradients)
    theirs = _torch_gradients(module, torch.nn.functional.cross_entropy(module(x), labels))
    _assert_equal_gradients(ours, theirs, module)


# ----------------------------------------------------------------------------- padding rows


class Padded(torch.nn.Module):
    """Token and position embeddings, the tokens' with a padding row, optionally tied to the head."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(5)
        self.tokens = torch.nn.Embedding(11, 6, padding_idx=1)
        self.positions = torch.nn.Embedding(4, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.tokens.weight

    def forward(self, ids):
        h = torch.tanh(self.tokens(ids) + self.positions.weight[: ids.shape[1]])
        return self.head(h.mean(dim=1))


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 2, 1, 3], [4, 1, 5, 1], [1, 1, 1, 6]])  # the padding id (1) many times


def _exported(module, path, *, dynamo: bool) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"optimize": False} if dynamo else {"do_constant_folding": False}
        torch.onnx.export(module, (_ids(),), str(path), dynamo=dynamo, input_names=["ids"], output_names=["logits"],
                          **kwargs)  # fmt: skip
    return str(path)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("how", ["dynamo", "export_for_training"])
def test_the_padding_row_gets_what_torch_gives_it(tmp_path, tied, how):
    """No gradient from the lookups, and a tied head's as in torch."""
    module = Padded(tied)
    if how == "dynamo":
        model = _exported(module, tmp_path / "padded.onnx", dynamo=True)
    else:
        model = export_for_training(module, _ids(), input_names=["ids"], output_names=["logits"])
    program, gradients, messages = _compiled(model, "loss(kind=cross_entropy, output=logits), autodiff")
    assert not [m for m in messages if "padding" in m]
    labels = torch.tensor([3, 0, 7])
    ours = _run(program, {"ids": _ids().numpy(), "labels": labels.numpy()}, gradients)
    theirs = _torch_gradients(module, torch.nn.functional.cross_entropy(module(_ids()), labels))
    if not tied:
        assert not theirs["tokens.weight"][1].any()  # what the test is about
    _assert_equal_gradients(ours, theirs, module)


def test_an_export_that_cannot_tell_the_padding_row_is_named_in_a_warning(tmp_path):
    _, _, messages = _compiled(
        _exported(Padded(False), tmp_path / "padded.onnx", dynamo=False),
        "loss(kind=cross_entropy, output=logits), autodiff",
    )
    (message,) = [m for m in messages if "padding" in m]
    assert "the embedding lookups of tokens.weight skip a padding row" in message, message
    assert "positions.weight" not in message  # sliced, not looked up


# ----------------------------------------------------------------------------- frozen parameters


def test_parameters_torch_does_not_train_stay_frozen_unless_named(tmp_path):
    module = Padded(False)
    module.positions.weight.requires_grad_(False)  # a fixed (sinusoidal, say) position table
    exported = export_for_training(module, _ids(), input_names=["ids"], output_names=["logits"])
    pipeline = "loss(kind=cross_entropy, output=logits), autodiff{}"
    program, gradients, messages = _compiled(exported, pipeline.format(""))
    assert sorted(gradients) == ["head.weight", "tokens.weight"]
    assert {n: f.by for n, f in ProgramRoles.read(program).frozen.items()} == {"positions.weight": "torch"}
    assert (
        "autodiff: 1 parameter(s) torch does not train (requires_grad=False) stay frozen: positions.weight; "
        "name them in trainable=[...] to train them"
    ) in messages
    program, gradients, messages = _compiled(exported, pipeline.format('(trainable=["*", "positions.weight"])'))
    assert sorted(gradients) == ["head.weight", "positions.weight", "tokens.weight"]
    assert ProgramRoles.read(program).frozen == {}
    assert not [m for m in messages if "frozen" in m]
